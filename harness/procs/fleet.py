"""``kvemu fleet``: the scenario's workers with no kvemu router in front, for any router to sit there.

Every worker of every pool serves the vLLM routes and metrics over HTTP, publishes its KV events (and
replays them) per rank, and serves what its engines did per request and per rank (``harness.procs.
engine_truth``). The workers share this process (dozens fit on 2 cores) or run as ``kvemu worker``
processes (``processes=True``). The fleet says where everything is in one JSON line (``FleetInfo``), from
which ``harness.external_routers`` writes the flags a router takes. The scenario's chaos timeline applies
to the fleet, counted from the first request any worker receives (the load's start).
"""

from __future__ import annotations

import http.client
import json
import secrets
import signal
import sys
import time
import urllib.request
from typing import Annotated, Any

import anyio
import anyio.abc
import msgspec

from kvemu.limits import MAX_LIST_ITEMS, Endpoint, Id, Name, Rank, WorkerId
from kvemu.messages import WORKER_CHAOS, Chaos
from kvemu.runtime.transport import NoRouterEnd
from kvemu.wire import security
from kvemu.wire.publisher import KvEventPublisher
from workers.actor.actor import WorkerActor

from harness.chaos import SUPERVISOR_CHAOS, Outcome, RouterlessHost, apply_chaos, at_ns, chaos_problems
from harness.run.pools import AGGREGATED
from harness.procs.engine_truth import EngineTruth, TruthPage
from harness.procs.protocol import HttpOptions
from harness.procs.worker import LOAD_SAMPLE_S, build_worker, sample_load
from harness.scenario import Scenario
from harness.text import counted

__all__ = ["FleetWorker", "FleetInfo", "Fleet", "IN_PROCESS_CHAOS", "PROCESS_CHAOS", "fleet_chaos_problems"]

IN_PROCESS_CHAOS = frozenset({*SUPERVISOR_CHAOS, *WORKER_CHAOS})
"""What a fleet in one process applies (the router's own faults, ``restart_router``, have no router here)."""
PROCESS_CHAOS = SUPERVISOR_CHAOS
"""What a fleet of processes applies: it starts and stops them (a worker process takes no other fault)."""


class FleetWorker(msgspec.Struct, kw_only=True):
    """Where one worker of a fleet is: what a router needs to put it behind itself."""

    worker_id: WorkerId
    pool: Name
    """``aggregated``, or ``prefill`` / ``decode`` of a disaggregated fleet."""
    url: Endpoint
    dp_size: Rank
    block_size: Rank
    kv_events: Annotated[list[Endpoint], msgspec.Meta(max_length=MAX_LIST_ITEMS)]
    """One ZeroMQ PUB endpoint per rank (vLLM's KV-event wire format)."""
    kv_replay: Annotated[list[Endpoint], msgspec.Meta(max_length=MAX_LIST_ITEMS)]
    """One replay ROUTER endpoint per rank ('' where there is none)."""


class FleetInfo(msgspec.Struct, kw_only=True, tag="fleet", tag_field="event"):
    """The fleet's start line."""

    model: Id
    workers: Annotated[list[FleetWorker], msgspec.Meta(max_length=MAX_LIST_ITEMS)]
    kv_events_version: Name
    processes: bool = False

    def pool(self, name: str) -> list[FleetWorker]:
        """The workers of one pool, in id order."""
        return [w for w in self.workers if w.pool == name]


def fleet_chaos_problems(scenario: Scenario, processes: bool) -> list[str]:
    """One line per chaos event a fleet cannot apply (empty: it applies the whole timeline)."""
    who = "kvemu fleet --processes" if processes else "kvemu fleet (it has no router: restart_router)"
    return chaos_problems(list(scenario.chaos), PROCESS_CHAOS if processes else IN_PROCESS_CHAOS, who)


class _Member:
    """One worker of a fleet in this process."""

    def __init__(self, info: FleetWorker, actor: WorkerActor, pubs: list[KvEventPublisher], truth: EngineTruth,
                 end: NoRouterEnd) -> None:
        self.info = info
        self.actor = actor
        self.pubs = pubs
        self.truth = truth
        self.end = end
        self.scope: anyio.CancelScope | None = None


class Fleet:
    """The scenario's workers serving HTTP and KV events with no kvemu router (``run`` until cancelled)."""

    def __init__(self, scenario: Scenario, *, http: HttpOptions | None = None, processes: bool = False,
                 config_args: list[str] | None = None) -> None:
        self.scenario = scenario
        self.http = http or HttpOptions(listen="127.0.0.1:0")
        self.processes = processes
        self.config_args = config_args or []
        """``--config PATH --set ...``: what a worker process reads the scenario from (``processes``)."""
        self._handoff_secret = security.secret(security.HANDOFF_SECRET_ENV) or secrets.token_urlsafe(32)
        """What its prefill and decode workers prove their KV handoff with (the user's, or one for this fleet):
        handed to its workers only, directly or in a process's environment, never to the KV-event sockets."""
        self._members: dict[int, _Member] = {}
        self._kids: Any = None  # harness.procs.up.Children, for processes
        self._infos: dict[int, FleetWorker] = {}
        self._next_id = 0
        self._kv_lag: Chaos | None = None
        """The last ``delay_kv_events`` (every worker's publishers; a worker started later applies it too)."""
        self._tg: anyio.abc.TaskGroup | None = None
        self.events: list[dict[str, Any]] = []
        """What the chaos timeline did (``{"event": "chaos", ...}``), as printed."""

    # ------------------------------------------------------------------ the fleet's view

    def info(self) -> FleetInfo:
        """Where every live worker is."""
        return FleetInfo(model=self.http.model, workers=[self._infos[w] for w in sorted(self._infos)],
                         kv_events_version=self.scenario.cluster.kv_events_version, processes=self.processes)

    def truth(self, worker_id: int) -> EngineTruth | None:
        """An in-process worker's engine truth (None for a process, or a removed worker)."""
        m = self._members.get(worker_id)
        return m.truth if m is not None else None

    def first_arrival_ns(self) -> int | None:
        """When the first request reached any worker (None: none yet)."""
        if not self.processes:
            times = [m.truth.first_arrival_ns for m in self._members.values() if m.truth.first_arrival_ns]
        else:
            times = [t for w in self._infos.values() if (t := _first_arrival(w.url)) is not None]
        return min(times, default=None)

    # ------------------------------------------------------------------ running

    async def run(self, *, task_status: anyio.abc.TaskStatus[FleetInfo] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start every pool's workers, report where they are, then apply the chaos timeline until cancelled."""
        if self.processes:
            from harness.procs.up import Children

            self._kids = Children()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for pool, (n, _, _) in self.scenario.cluster.pools().items():
                    for _ in range(n):
                        await self.add_worker(pool)
                task_status.started(self.info())
                await self._chaos_timeline()
                await anyio.sleep_forever()
        finally:
            if self._kids is not None:
                self._kids.stop_all()

    async def add_worker(self, pool: str) -> FleetWorker:
        """One more worker of ``pool``, serving once this returns."""
        wid = self._next_id
        self._next_id += 1
        if self.processes:
            info = await anyio.to_thread.run_sync(self._start_process, wid, pool)
        else:
            assert self._tg is not None, "add_worker runs inside Fleet.run"
            info = await self._tg.start(self._serve_member, wid, pool)
        self._infos[wid] = info
        return info

    def remove_worker(self, worker_id: int, graceful: bool = True) -> bool:
        """Stop one worker: a graceful stop lets its requests finish (``run.drain_s``-like grace of 10 s), a kill
        drops them and its connections. Returns whether it was running."""
        if self._infos.pop(worker_id, None) is None:
            return False
        if self.processes:
            self._kids.retire(f"worker-{worker_id}", signal.SIGTERM if graceful else signal.SIGKILL)
            return True
        m = self._members.pop(worker_id)
        if graceful and self._tg is not None:
            self._tg.start_soon(self._drain, m)
        elif m.scope is not None:
            m.scope.cancel()
        return True

    def delay_kv_events(self, lag_ms: float) -> list[int]:
        """Every in-process worker's KV events ``lag_ms`` late from now on, and every later one's; returns the
        workers it reached now."""
        self._kv_lag = Chaos(action="delay_kv_events", lag_ms=lag_ms)
        return [wid for wid, m in sorted(self._members.items()) if m.actor.apply_chaos(self._kv_lag) is None]

    async def _drain(self, m: _Member) -> None:
        await m.actor.shutdown(10.0)
        if m.scope is not None:
            m.scope.cancel()

    async def _serve_member(self, wid: int, pool: str, *,
                            task_status: anyio.abc.TaskStatus[FleetWorker] = anyio.TASK_STATUS_IGNORED) -> None:
        from kvemu.http.server import HttpServer

        from harness.procs.frontdoor import worker_closing, worker_door, worker_listening

        end = NoRouterEnd()
        dp_size = self.scenario.cluster.pools()[pool][1]
        actor, pubs = build_worker(self.scenario, wid, pool, dp_size, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", end)
        truth = EngineTruth(wid)
        m = _Member(FleetWorker(worker_id=wid, pool=pool, url="", dp_size=dp_size,
                                block_size=actor.register_msg.block_size,
                                kv_events=list(actor.register_msg.kv_endpoints),
                                kv_replay=list(actor.register_msg.kv_replay_endpoints)), actor, pubs, truth, end)
        http = self.http
        app = worker_door(self.scenario, actor, tokenizer=http.tokenizer, model=http.model, truth=truth,
                          limits=http.admission, handoff_secret=self._handoff_secret)
        server = HttpServer(app, http.listen, http.server)
        try:
            with anyio.CancelScope() as scope:
                m.scope = scope
                async with anyio.create_task_group() as tg:
                    tg.start_soon(actor.run)
                    await tg.start(server.serve)
                    worker_listening(app, server.url)
                    tg.start_soon(sample_load, truth, actor, LOAD_SAMPLE_S)
                    m.info.url = server.url
                    self._members[wid] = m
                    if self._kv_lag is not None:  # (before its first request: it serves from here on)
                        m.actor.apply_chaos(self._kv_lag)
                    task_status.started(m.info)
        finally:
            with anyio.move_on_after(5.0, shield=True):
                await worker_closing(app)
            for p in pubs:
                p.close(drain_timeout_s=0.0)
            await end.aclose()

    def _start_process(self, wid: int, pool: str) -> FleetWorker:
        kind = [] if pool == AGGREGATED else ["--worker-type", pool]
        http = self.http
        flags = ["--http", "127.0.0.1:0", "--model", http.model, "--http-server", http.server,
                 *(["--tokenizer", http.tokenizer] if http.tokenizer else []),
                 "--max-running", str(http.admission.max_running), "--max-waiting", str(http.admission.max_waiting)]
        started = self._kids.start(f"worker-{wid}", ["worker", "--worker-id", str(wid), *kind, "--kv-events",
                                                     "tcp://127.0.0.1:0", "--kv-replay", "tcp://127.0.0.1:0",
                                                     *flags, *self.config_args],
                                 env={security.HANDOFF_SECRET_ENV: self._handoff_secret})
        return FleetWorker(worker_id=wid, pool=pool, url=started["http"], dp_size=started["dp_size"],
                           block_size=started["block_size"], kv_events=list(started["kv_events"]),
                           kv_replay=[e or "" for e in started["kv_replay"]])

    async def _chaos_timeline(self) -> None:
        """Apply the scenario's chaos events, timed from the first request any worker receives."""
        events = sorted(self.scenario.chaos, key=at_ns)
        if not events:
            return
        while (t0 := await anyio.to_thread.run_sync(self.first_arrival_ns) if self.processes
               else self.first_arrival_ns()) is None:
            await anyio.sleep(0.05)
        for ev in events:
            await anyio.sleep(max(0.0, (t0 + at_ns(ev) - time.monotonic_ns()) / 1e9))
            ok, detail = await apply_chaos(_FleetChaos(self), ev)
            line = {"event": "chaos", "action": ev.action, "at_s": ev.at_s, "ok": ok, "detail": detail}
            self.events.append(line)
            print(json.dumps(line), file=sys.stderr, flush=True)


class _FleetChaos(RouterlessHost):
    """A fleet as a chaos host: it starts and stops its workers and hands a worker its own faults (``delay_kv_events``
    every worker's, present and future); it has no router (``fleet_chaos_problems`` refuses what it cannot apply
    before it starts)."""

    who = "kvemu fleet"

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def _running(self, worker: int | None) -> int | str:
        """The worker aimed at (None: the first running one), or why there is none."""
        target = worker if worker is not None else min(self.fleet._infos, default=None)
        return target if target is not None and target in self.fleet._infos else f"worker {target} is not running"

    async def add_worker(self) -> Outcome:
        pools = list(self.fleet.scenario.cluster.pools())
        info = await self.fleet.add_worker(pools[-1])  # a disaggregated fleet grows its decode pool
        return Outcome(True, f"worker {info.worker_id} at {info.url}")

    async def remove_worker(self, worker: int | None, graceful: bool) -> Outcome:
        target = self._running(worker)
        if isinstance(target, str):
            return Outcome(False, target)
        self.fleet.remove_worker(target, graceful)
        return Outcome(True, f"worker {target} {'drained' if graceful else 'killed'}")

    async def delay_workers(self, lag_ms: float) -> Outcome:
        reached = self.fleet.delay_kv_events(lag_ms)
        return Outcome(True, f"KV events {lag_ms:g} ms late on {counted(len(reached), 'worker')} and every later "
                             "one")

    async def to_worker(self, worker: int | None, msg: Chaos) -> Outcome:
        target = self._running(worker)
        if isinstance(target, str):
            return Outcome(False, target)
        member = self.fleet._members.get(target)
        if member is None:  # (a worker process: fleet_chaos_problems refused this before the fleet started)
            return Outcome(False, f"worker {target} is a process: kvemu fleet --processes only starts and stops them")
        why = member.actor.apply_chaos(msg)
        return Outcome(why is None, why or f"worker {target}")


def _first_arrival(url: str) -> int | None:
    """A worker process's first arrival, from its ``/kvemu/requests`` (None: none yet, or it did not answer)."""
    try:
        with urllib.request.urlopen(f"{url}/kvemu/requests?after=999999999999&limit=1", timeout=2) as resp:  # noqa: S310
            return msgspec.json.decode(resp.read(1 << 20), type=TruthPage).first_arrival_ns
    except (OSError, http.client.HTTPException, msgspec.DecodeError):
        return None
