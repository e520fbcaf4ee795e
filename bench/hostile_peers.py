"""Fake workers against a ``kvemu router`` process with no ``KVEMU_SECRET``, on 127.0.0.1: how many of 10 real
requests complete, and how long they take, while the fakes are registered.

``python -m bench.hostile_peers flood|mute|acker`` (a scenario override each: ``--set router.X=Y``):

- ``flood``: 2,000 registrations that never speak again;
- ``mute``: 8 fakes that heartbeat but never acknowledge a dispatch;
- ``acker``: 1 fake that heartbeats and accepts every dispatch but never produces a token.

One real worker (id 0) serves beside them; the router has its default settings. The requests are sent at once,
unpinned, a second after the fakes registered. With no attack named, runs all three. Prints, per attack:

  ATTACK real requests completed: N requests     (of 10; the exit status is 1 below 10)
  ATTACK slowest real request: S s
  ATTACK dispatches to fakes: N dispatches

``--quick`` lowers ``router.first_token_timeout_s`` to 5 s (the acker's requests wait that long, not 60 s);
``--json`` prints each attack's whole result as one JSON line instead.
Run: python -m bench.hostile_peers [flood|mute|acker] [--quick]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import anyio
import zmq

from kvemu.messages import (
    Abort,
    ClientRequest,
    Dispatch,
    DispatchAck,
    Heartbeat,
    Register,
    RegisterAck,
    decode_router_message,
    encode,
)
from kvemu.wire.subscriber import sized_context

from harness.procs.loadgen import _RouterClient
from harness.procs.up import Children

__all__ = ["ATTACKS", "Fakes", "attack"]

ATTACKS = {"flood": 2000, "mute": 8, "acker": 1}
"""Attack -> how many fake workers."""


def _scenario(folder: Path) -> Path:
    path = folder / "hostile.yaml"
    path.write_text("""
name: hostile
cluster: {workers: 1, engine: {block_size: 16, speedup_ratio: 50, decode_speedup_ratio: 50}}
router: {policy: kv}
workload: {kind: synthetic, rate_rps: 1, isl: {kind: constant, mean: 64}, osl: {kind: constant, mean: 4}}
run: {mode: live, duration_s: 1}
""")
    return path


class Fakes:
    """Fake workers on DEALER sockets, served by one thread: ``mute`` ones heartbeat, ``acker`` ones also accept
    every dispatch; the ``flood`` only registers."""

    def __init__(self, router: str, kind: str, n: int) -> None:
        self.ctx = sized_context(n + 16)
        self.kind = kind
        self.socks: list[zmq.Socket] = []
        self.dispatches = 0
        self.aborts: list[str] = []
        """The reasons of the ``Abort`` messages the fakes were sent."""
        self.accepted = 0
        """Registrations the router accepted."""
        for i in range(n):
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(router)
            s.send(encode(Register(worker_id=1000 + i, block_size=16)))
            self.socks.append(s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        if kind != "flood":  # (polling 2,000 sockets would load the machine the router runs on)
            self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        beat = 0.0
        while not self._stop.is_set():
            if self.kind != "flood" and time.monotonic() - beat > 0.5:
                beat = time.monotonic()
                for i, s in enumerate(self.socks):
                    s.send(encode(Heartbeat(worker_id=1000 + i)))
            for s, _ in poller.poll(50):
                self._read(s)

    def _read(self, s: zmq.Socket) -> None:
        msg = decode_router_message(s.recv())
        if isinstance(msg, RegisterAck):
            self.accepted += msg.accepted
        elif isinstance(msg, Abort):
            self.aborts.append(msg.reason)
        elif isinstance(msg, Dispatch):
            self.dispatches += 1
            if self.kind == "acker":
                s.send(encode(DispatchAck(request_id=msg.request_id, accepted=True)))

    def drain(self) -> None:
        """Read what the unserved (``flood``) fakes were sent."""
        for s in self.socks:
            while s.poll(0):
                self._read(s)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        self.ctx.destroy(linger=0)


def attack(kind: str, sets: list[str], requests: int = 10, cap_s: float = 120.0) -> dict:
    """Run one attack; returns how many requests completed, their failures and times, what the fakes saw (dispatches,
    accepted registrations, abort reasons), and which workers the router still had after the requests."""
    with tempfile.TemporaryDirectory() as tmp:
        path = _scenario(Path(tmp))
        kids = Children()
        fakes = None
        try:
            router = kids.start("router", ["router", "--listen", "tcp://127.0.0.1:0", "--config", str(path),
                                           *[x for s in sets for x in ("--set", s)]])["listen"]
            kids.start("w0", ["worker", "--router", router, "--worker-id", "0", "--config", str(path)])
            results: list[tuple[str | None, float]] = []
            workers: list[int] = []

            async def run() -> None:
                nonlocal fakes
                client = _RouterClient(router)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(client.listen)
                    with anyio.fail_after(30):
                        while 0 not in (await client.stats(timeout_s=10)).workers:
                            await anyio.sleep(0.05)
                    fakes = Fakes(router, kind, ATTACKS[kind])
                    await anyio.sleep(1.0)  # the fakes are registered (and heartbeating)
                    async def one(i: int) -> None:
                        t0 = time.monotonic()
                        rec = None
                        with anyio.move_on_after(cap_s):
                            rec = await client.submit(ClientRequest(request_id=f"r{i}", max_tokens=4,
                                                                    tokens=list(range(1 + i, 65 + i))))
                        results.append(("no answer" if rec is None else rec.failure, time.monotonic() - t0))

                    async with anyio.create_task_group() as each:
                        for i in range(requests):
                            each.start_soon(one, i)
                    workers.extend((await client.stats(timeout_s=10)).workers)
                    if kind == "flood":
                        fakes.drain()
                    tg.cancel_scope.cancel()

            anyio.run(run)
        finally:
            if fakes is not None:
                fakes.close()
            kids.stop_all()
    took = [round(t, 2) for _, t in results]
    return {"attack": kind, "fakes": ATTACKS[kind], "sets": sets,
            "completed": sum(why is None for why, _ in results), "of": requests,
            "failures": sorted({why for why, _ in results if why}), "seconds": took, "total_s": round(sum(took), 1),
            "fake_dispatches": fakes.dispatches if fakes is not None else 0,
            "fakes_accepted": fakes.accepted if fakes is not None else 0,
            "aborts": sorted(set(fakes.aborts)) if fakes is not None else [], "workers_after": workers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("attack", nargs="?", choices=sorted(ATTACKS), help="one attack (default: all three)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="router.KEY=VALUE")
    parser.add_argument("--cap", type=float, default=120.0, help="seconds a request may take before it counts as lost")
    parser.add_argument("--quick", action="store_true", help="a 5 s first-token bound instead of the default 60 s")
    parser.add_argument("--json", action="store_true", help="one JSON line per attack instead of figures")
    args = parser.parse_args()
    sets = (["router.first_token_timeout_s=5"] if args.quick else []) + args.sets
    whole = True
    for kind in [args.attack] if args.attack else sorted(ATTACKS):
        result = attack(kind, sets, cap_s=args.cap)
        whole = whole and result["completed"] == result["of"]
        if args.json:
            print(json.dumps(result), flush=True)
            continue
        print(f"{kind} real requests completed: {result['completed']} requests", flush=True)
        print(f"{kind} slowest real request: {max(result['seconds'], default=0.0):.2f} s", flush=True)
        print(f"{kind} dispatches to fakes: {result['fake_dispatches']} dispatches", flush=True)
    if not whole:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
