"""A real router process against hostile peers on 127.0.0.1: KV replays that never end and floods of
registrations must not stop it serving real requests (each test bounded in time)."""

import threading
import time

import anyio
import msgspec
import pytest
import zmq

from kvemu.messages import (
    ClientRequest,
    Dispatch,
    DispatchAck,
    Heartbeat,
    Register,
    RegisterAck,
    decode_router_message,
    encode,
)
from kvemu.wire.codec import encode_batch
from kvemu.kv_events import KVEventBatch
from kvemu.wire.subscriber import sized_context

from harness.procs.loadgen import _RouterClient
from harness.procs.up import Children

HOST = "tcp://127.0.0.1:0"


def scenario(tmp_path, router_extra: str = ""):
    path = tmp_path / "s.yaml"
    path.write_text(f"""
name: hostile
cluster: {{workers: 1, engine: {{block_size: 16, speedup_ratio: 50, decode_speedup_ratio: 50}}}}
router: {{policy: kv, heartbeat_timeout_s: 30{router_extra}}}
workload: {{kind: synthetic, rate_rps: 1, isl: {{kind: constant, mean: 64}}, osl: {{kind: constant, mean: 4}}}}
run: {{mode: live, duration_s: 1}}
""")
    return path


class Stack:
    """A router process and one real worker (id 0)."""

    def __init__(self, tmp_path, router_extra: str = "") -> None:
        path = scenario(tmp_path, router_extra)
        self.kids = Children()
        self.router = self.kids.start("router", ["router", "--listen", HOST, "--config", str(path)])["listen"]
        self.kids.start("w0", ["worker", "--router", self.router, "--worker-id", "0", "--config", str(path)])

    def close(self) -> None:
        self.kids.stop_all()


async def until_listed(client: _RouterClient, worker_id: int = 0) -> None:
    """Return once the router lists ``worker_id`` (the real worker registers at its own pace)."""
    with anyio.fail_after(30):
        while worker_id not in (await client.stats(timeout_s=10)).workers:
            await anyio.sleep(0.05)


def wait_for_real_worker(router: str) -> None:
    """Block until the real worker (id 0) is registered."""
    async def wait() -> None:
        client = _RouterClient(router)
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.listen)
            await until_listed(client)
            tg.cancel_scope.cancel()

    anyio.run(wait)


async def timed_requests(router: str, n: int, during=None, pin: int | None = None) -> list[float]:
    """Seconds each of ``n`` real requests took, sent one after another after ``during()`` (``pin``: all go to
    that worker)."""
    client = _RouterClient(router)
    took: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(client.listen)
        await until_listed(client)
        if during is not None:
            await during()
        for i in range(n):
            t0 = time.monotonic()
            with anyio.fail_after(60):
                rec = await client.submit(ClientRequest(request_id=f"r{i}", tokens=list(range(1 + i, 65 + i)),
                                                        max_tokens=4, worker_id=pin))
            assert rec is not None and rec.failure is None, rec
            took.append(time.monotonic() - t0)
        tg.cancel_scope.cancel()
    return took


def fake_worker(ctx: zmq.Context, router: str, worker_id: int, **fields) -> zmq.Socket:
    """A DEALER that registers as ``worker_id``; returns it once the router accepted."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"fake-{worker_id}".encode())
    sock.connect(router)
    sock.send(encode(Register(worker_id=worker_id, block_size=16, **fields)))
    assert sock.poll(10_000), "the router did not answer the registration"
    ack = msgspec.msgpack.decode(sock.recv(), type=RegisterAck)
    assert ack.accepted, ack.reason
    return sock


@pytest.mark.parametrize("replier", ["mute", "endless"])
def test_a_kv_replay_that_never_ends_does_not_stop_the_router_serving(tmp_path, replier):
    """A peer announces a KV publisher whose sequence starts past 0 (so the router asks for a replay) and a
    replay socket that never answers, or streams batches without the end marker. With a 20 s replay limit
    the router used to be frozen for those 20 s; now real requests keep completing meanwhile."""
    stack = Stack(tmp_path, "")
    ctx = zmq.Context()
    stop = threading.Event()
    asked = []
    try:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(HOST)
        replay = ctx.socket(zmq.ROUTER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.bind(HOST)
        payload = encode_batch(KVEventBatch(ts=0.0, events=[], data_parallel_rank=0))

        fakes: list[zmq.Socket] = []

        def serve_replays():  # the hostile replay endpoint and a publisher that skips sequence numbers
            seq = 1000
            while not stop.is_set():
                while fakes[0].poll(0):  # refuse dispatches at once: only the replay is under test here
                    msg = decode_router_message(fakes[0].recv())
                    if isinstance(msg, Dispatch):
                        fakes[0].send(encode(DispatchAck(request_id=msg.request_id, accepted=False, reason="busy")))
                pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
                seq += 7
                if replay.poll(20):
                    ident, _, start = replay.recv_multipart()
                    asked.append(int.from_bytes(start, "big"))
                for _ in range(200 if replier == "endless" and asked else 0):  # batches, never the end marker
                    replay.send_multipart([ident, b"", (5).to_bytes(8, "big"), payload])

        thread = threading.Thread(target=serve_replays, daemon=True)

        async def attack():
            fake = fake_worker(ctx, stack.router, 77, kv_endpoints=[pub.getsockopt_string(zmq.LAST_ENDPOINT)],
                               kv_replay_endpoints=[replay.getsockopt_string(zmq.LAST_ENDPOINT)])
            fake.send(encode(Heartbeat(worker_id=77)))
            fakes.append(fake)
            thread.start()
            with anyio.fail_after(10):
                while not asked:  # the router asked for the replay: from here it would have been frozen
                    await anyio.sleep(0.02)

        took = anyio.run(timed_requests, stack.router, 10, attack)
    finally:
        stop.set()
        stack.close()
        ctx.destroy(linger=0)
    assert asked[0] == 0
    assert sum(took) < 10.0 and max(took) < 5.0, took  # not one 20 s freeze; typically tens of ms each


@pytest.mark.process_supervision
def test_a_registration_flood_does_not_delay_real_requests(tmp_path):
    """2,000 fake registrations of 4 ranks each, every rank announcing a KV endpoint, used to hold real requests
    back for seconds and then crash the router (out of open files). The requests are pinned to the real worker:
    what is measured is the router's delay, not where it routes."""
    stack = Stack(tmp_path)
    ctx = sized_context(2000)  # past ZeroMQ's default 1,023 sockets
    try:
        socks = []  # one connection per fake worker: the router refuses a second registration on one

        async def attack():
            for i in range(2000):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(stack.router)
                s.send(encode(Register(worker_id=1000 + i, block_size=16, dp_size=4,
                                       kv_endpoints=[f"tcp://127.0.0.1:{20000 + 4 * i + r}" for r in range(4)])))
                socks.append(s)

        took = anyio.run(timed_requests, stack.router, 10, attack, 0)
        time.sleep(3.0)  # every stream that fits the open-file limit is open by now: still serving
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        answers = len(poller.poll(10_000))  # the refusals past the limit (a loaded machine delivers them late)
        took += anyio.run(timed_requests, stack.router, 3, None, 0)
        assert stack.kids.procs["router"].poll() is None
    finally:
        stack.close()
        ctx.destroy(linger=0)
    assert answers > 0
    assert max(took) < 1.0, took  # typically 0.01-0.2 s; minutes (or a crash) before


def test_registrations_past_the_rate_are_refused_with_a_retry_time(tmp_path):
    # a token every 20 s: a slow start (a busy machine) cannot refill one between the registrations
    stack = Stack(tmp_path, ", registration_burst: 3, registrations_per_s: 0.05")
    ctx = zmq.Context()
    try:
        wait_for_real_worker(stack.router)  # its registration takes the first token, not a fake's (a slow start)
        acks = []
        for i in range(4):  # the real worker took one token of three: two more pass, then none
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(stack.router)
            s.send(encode(Register(worker_id=10 + i, block_size=16)))
            assert s.poll(10_000)
            acks.append(msgspec.msgpack.decode(s.recv(), type=RegisterAck))
    finally:
        stack.close()
        ctx.destroy(linger=0)
    assert [a.accepted for a in acks] == [True, True, False, False]
    assert acks[2].reason.startswith("rate_limited: worker 12") and 0 < acks[2].retry_after_s <= 20.0


# ---------------------------------------------------------------------------------- #43: fakes with no secret

def test_a_flood_of_silent_registrations_fails_no_real_request():
    """2,000 registrations that never speak again failed every one of 10 real requests at once (0/10,
    ``retries_exhausted: worker_lost`` after 5.4 s): the router routed to them. A registration now waits, unrouted,
    for its worker's next word (``max_pending_workers`` at once, refused with a retry time beyond)."""
    from bench.hostile_peers import attack

    result = attack("flood", [], cap_s=30)
    assert result["completed"] == 10, result
    assert max(result["seconds"]) < 5.0, result
    assert result["fake_dispatches"] == 0 and result["fakes_accepted"] <= 64, result
    assert result["workers_after"] == [0], result


def test_fakes_that_heartbeat_and_never_acknowledge_fail_no_real_request():
    """8 fakes that heartbeat and never acknowledge failed 4 of 10 real requests (a retry and 10 s each). On
    probation (no dispatch acknowledged yet) a worker has ``probation_ack_timeout_s`` (2 s) and is removed at its
    first miss, and a request's retries are not spent on it."""
    from bench.hostile_peers import attack

    result = attack("mute", [], cap_s=60)
    assert result["completed"] == 10, result
    assert max(result["seconds"]) < 20.0, result  # at most a few fakes missed in a row, 2 s each
    assert result["workers_after"] == [0], result


def test_a_worker_that_accepts_and_never_produces_a_token_holds_requests_only_to_the_first_token_bound():
    """A fake that acknowledges every dispatch and never produces a token held its requests for the 3,600 s
    request deadline. After ``first_token_timeout_s`` (2 s here, 60 s by default) each runs on the real worker, the
    fake is told to abort it and, having never produced a first token, is removed."""
    from bench.hostile_peers import attack

    result = attack("acker", ["router.first_token_timeout_s=2"], cap_s=30)
    assert result["completed"] == 10, result
    assert result["fake_dispatches"] >= 1 and result["aborts"] == ["first_token_timeout"], result
    assert max(result["seconds"]) < 10.0, result
    assert result["workers_after"] == [0], result


def test_an_accepted_registration_left_silent_is_forgotten_and_asked_again_then_admitted_when_it_speaks(tmp_path):
    """A live router routes to a worker only once it speaks after its acceptance; one that stays silent past
    ``heartbeat_timeout_s`` (a starved process) is forgotten and asked to register again, and is admitted at its
    next word after that (before, a worker whose heartbeats reached another pool's router was never asked again)."""
    from kvemu.messages import Reregister

    path = tmp_path / "s.yaml"
    path.write_text(scenario(tmp_path).read_text().replace("heartbeat_timeout_s: 30", "heartbeat_timeout_s: 1"))
    kids = Children()
    ctx = zmq.Context()
    try:
        router = kids.start("router", ["router", "--listen", HOST, "--config", str(path)])["listen"]
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(router)
        sock.send(encode(Register(worker_id=5, block_size=16)))
        assert sock.poll(10_000) and msgspec.msgpack.decode(sock.recv(), type=RegisterAck).accepted

        async def listed() -> list[int]:
            client = _RouterClient(router)
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.listen)
                workers = (await client.stats(timeout_s=10)).workers
                tg.cancel_scope.cancel()
            return workers

        assert anyio.run(listed) == []  # accepted, not routed to: it has not spoken since
        assert sock.poll(10_000), "no Reregister after the heartbeat timeout"
        assert isinstance(decode_router_message(sock.recv()), Reregister)
        sock.send(encode(Register(worker_id=5, block_size=16)))
        assert sock.poll(10_000) and msgspec.msgpack.decode(sock.recv(), type=RegisterAck).accepted
        seen: list[int] = []
        deadline = time.monotonic() + 10
        while seen != [5] and time.monotonic() < deadline:
            sock.send(encode(Heartbeat(worker_id=5)))  # (a 1 s heartbeat timeout: keep speaking)
            seen = anyio.run(listed)
        assert seen == [5]
    finally:
        kids.stop_all()
        ctx.destroy(linger=0)
