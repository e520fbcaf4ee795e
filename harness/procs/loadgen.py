"""The load generator process (``kvemu loadgen``): plays a scenario's workload against a router process.

A DEALER to the router (``_RouterClient``) submits the requests and awaits their records; the run's
report is written from what came back, partial when the run stops early (``loadgen_report``).
"""

from __future__ import annotations

import json
import os
from array import array
import signal
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
import zmq

from kvemu.clock import NS_PER_S
from kvemu.records import RequestRecord
from kvemu.runtime.loop import run_live
from kvemu.messages import ClientRequest, encode
from kvemu.runtime.transport import message_socket
from kvemu.wire import security

from harness.chaos import CONTROL_TOKEN_ENV, Control, ControlReply, at_ns, timeline
from harness.run.factories import replica_front
from harness.run.interrupts import terminate_as_interrupt
from harness.run.progress import PROGRESS_EVERY_S, RunProgress, for_scenario, print_progress
from harness.run.pools import pool_sizes, speculative_settings, routing_block_size
from harness.report.files import save_report
from harness.report.recorder import WorkerEvent
from harness.report.run_data import RunData, Sample
from harness.report.summary_types import Summary
from harness.run.runner import NothingRan, count_requests
from harness.workload.sessions import Played, awaiting, play_workload
from harness.scenario import RunOrigin, Scenario
from harness.text import counted
from harness.workload.forms import Sessions
from harness.workload.build import build_sessions
from harness.procs.protocol import (CLIENT, CancelRequest, RecordReply, Stats, StatsQuery, log_start, never_ran_record,
                                     reply_decoder)
from harness.workload.lanes import CANCEL_DRAIN_S
from harness.procs.truth_oracle import TRUTH_SOURCE, TruthOracle
from harness.procs.replica_clients import ReplicaClients, merged_affinity, merged_counters, replica_report


_A = TypeVar("_A")


def _answer(waiters: deque[tuple[anyio.Event, list[_A]]], answer: _A) -> None:
    """Hand ``answer`` to the oldest query waiting for one of its kind (none: a late answer, dropped)."""
    if waiters:
        event, box = waiters.popleft()
        box.append(answer)
        event.set()


class _RouterClient:
    """A DEALER to the router: submit requests, await their records, query stats."""

    def __init__(self, router: str) -> None:
        sock = message_socket(zmq.DEALER)
        security.connect_securely(sock)
        sock.connect(router)
        self.sock = sock
        self.records: dict[str, RequestRecord] = {}
        self._waiting: dict[str, anyio.Event] = {}
        self._stats_waiters: deque[tuple[anyio.Event, list[Stats]]] = deque()  # replies come back in order
        self._control_waiters: deque[tuple[anyio.Event, list[ControlReply]]] = deque()
        self.replies: list[RequestRecord] | None = None
        """Every record received, in arrival order, when set to a list (tests)."""
        self.heard_ns = time.monotonic_ns()
        """When the router last said anything (any reply)."""
        self.lost: str | None = None
        """Why the router is considered gone (``router_lost``); every open and later request then fails."""
        self.router_now: Callable[[], int] = time.monotonic_ns
        """The router's clock, for the records of requests it never answered."""
        self._sent: dict[str, tuple[ClientRequest, int]] = {}  # awaiting a reply: the request, when it was sent
        self.oracle: TruthOracle | None = None
        """With ``run.event_truth``: reads the ranks' caches as each request leaves and judges its record."""
    async def listen(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2 or frames[0] != CLIENT:
                continue
            self.heard_ns = time.monotonic_ns()
            try:
                msg = reply_decoder.decode(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                print(json.dumps({"event": "bad_router_message", "error": str(exc)[:200]}), file=sys.stderr)
                continue
            if type(msg) is RecordReply:
                if self.oracle is not None:
                    self.oracle.judge(msg.record)
                if self.replies is not None:
                    self.replies.append(msg.record)
                rid = msg.record.request_id
                # kept to the report: 8 bytes a token time, not an int object and a list slot (~40)
                msg.record.token_times_ns = array("q", msg.record.token_times_ns)  # type: ignore[assignment]
                self.records[rid] = msg.record
                ev = self._waiting.pop(rid, None)
                if ev is not None:
                    ev.set()
            elif type(msg) is ControlReply:  # answers come back in the order their queries went
                _answer(self._control_waiters, msg)
            elif type(msg) is Stats:
                _answer(self._stats_waiters, msg)

    async def submit(self, req: ClientRequest) -> RequestRecord | None:
        if self.lost is not None:
            return self._failed(req, self.lost)
        ev = self._waiting[req.request_id] = anyio.Event()
        self._sent[req.request_id] = (req, self.router_now())
        if self.oracle is not None:
            self.oracle.sent(req)
        await self.sock.send_multipart([CLIENT, encode(req)])
        await ev.wait()
        self._sent.pop(req.request_id, None)
        return self.records.get(req.request_id)

    async def cancel(self, request_id: str, reason: str) -> None:
        """Ask the router to end a request still awaiting its answer now (its worker aborts it); the record comes
        back as usual, failed with ``reason``."""
        if request_id in self._sent and request_id not in self.records and self.lost is None:
            await self.sock.send_multipart([CLIENT, encode(CancelRequest(request_id=request_id, reason=reason))])

    @property
    def awaiting(self) -> int:
        """Requests sent and not answered yet."""
        return len(self._sent)

    def open_records(self) -> list[RequestRecord]:
        """Records for the requests sent and not answered (a stopped run reports them unfinished)."""
        return [never_ran_record(req, sent_ns) for rid, (req, sent_ns) in self._sent.items() if rid not in self.records]

    def lose(self, reason: str = "router_lost") -> None:
        """The router is gone: fail every request still waiting for it (and every later one) with ``reason``."""
        self.lost = reason
        self._fail_waiting(reason)

    def restarted(self, before_ns: int, why: str) -> list[str]:
        """The router restarted at ``before_ns`` (its clock): requests sent before then and not answered were
        lost with it; fail them with ``why`` (a late answer still replaces the record). Returns their ids."""
        return self._fail_waiting(why, before_ns)

    def _fail_waiting(self, reason: str, before_ns: int | None = None) -> list[str]:
        """Fail the requests still awaiting an answer (those sent before ``before_ns``, when given) and wake
        their senders; returns their ids."""
        ids = [rid for rid, (_, sent) in self._sent.items()
               if rid not in self.records and (before_ns is None or sent < before_ns)]
        for rid in ids:
            self._failed(self._sent[rid][0], reason)
            if self.oracle is not None:
                self.oracle.forget(rid)
            ev = self._waiting.pop(rid, None)
            if ev is not None:
                ev.set()
        return ids

    def _failed(self, req: ClientRequest, reason: str) -> RequestRecord:
        rec = self.records[req.request_id] = never_ran_record(req, self.router_now(), reason)
        return rec

    async def stats(self, timeout_s: float = 30.0, *, settle: bool = False) -> Stats:
        """The router's current view (``TimeoutError`` if it does not answer in time); with an oracle, the KV-event
        publishers too, which it learns. ``settle``: the final view, with the KV batches already sent taken in."""
        answer = await self._ask(StatsQuery(publishers=self.oracle is not None, settle=settle), self._stats_waiters,
                                 timeout_s)
        if answer is None:
            raise TimeoutError(f"no answer from the router within {timeout_s:g} s")
        if self.oracle is not None:
            self.oracle.learn(answer.publishers, answer.replica)
        return answer

    async def control(self, msg: Control, timeout_s: float = 10.0) -> ControlReply:
        """Send a control message and wait for the router's answer."""
        answer = await self._ask(msg, self._control_waiters, timeout_s)
        return answer or ControlReply(ok=False, detail=f"no answer from the router within {timeout_s:g} s")

    async def _ask(self, msg: msgspec.Struct, waiters: deque[tuple[anyio.Event, list[_A]]],
                   timeout_s: float) -> _A | None:
        """Send a query and wait for its answer (None after ``timeout_s``: a late answer then goes to the next
        query of its kind, which any view of the router will do for)."""
        waiter: tuple[anyio.Event, list[_A]] = (anyio.Event(), [])
        waiters.append(waiter)
        await self.sock.send_multipart([CLIENT, encode(msg)])
        with anyio.move_on_after(timeout_s):
            await waiter[0].wait()
        if not waiter[1]:
            waiters.remove(waiter)
            return None
        return waiter[1][0]


def router_silence_s(scenario: Scenario) -> float:
    """How long a router may stay silent before a load generator that cannot see its process declares it lost
    (``run.router_silence_s``; default five heartbeat intervals, at least 5 s)."""
    if scenario.run.router_silence_s is not None:
        return scenario.run.router_silence_s
    return max(5.0, 5 * scenario.cluster.heartbeat_interval_s)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a stopped process is alive; a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # no /proc: existing is all we can tell
    return "State:\tZ" not in status and "State:\tX" not in status


async def _loadgen(scenario: Scenario, router: str | list[str], outdir: Path, expect_workers: int | None,
                   apply_chaos: bool = False, router_pid: int | list[int] | None = None,
                   sessions: Sessions | None = None, progress: RunProgress | None = None,
                   origin: RunOrigin | None = None, command: str = "kvemu loadgen") -> tuple[Summary, Path | None]:
    """Play the workload (``sessions``, built here if not given) and write the report. SIGINT and SIGTERM are
    this function's from its first line to its report's last byte: the first stops the run, the next ones are
    said and ignored, so no signal cuts the report short (asyncio puts the default handlers back, which kill,
    when a signal receiver closes: it closes only once the report is written)."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) as signals:
        return await _loadgen_run(scenario, router, outdir, expect_workers, apply_chaos, router_pid,
                                  build_sessions(scenario) if sessions is None else sessions, signals, progress,
                                  origin, command)


async def _loadgen_run(scenario: Scenario, router: str | list[str], outdir: Path, expect_workers: int | None,
                       apply_chaos: bool, router_pid: int | list[int] | None, sessions: Sessions,
                       signals: AsyncIterator[int], progress: RunProgress | None, origin: RunOrigin | None,
                       command: str) -> tuple[Summary, Path | None]:
    routers = [router] if isinstance(router, str) else list(router)
    pids = [router_pid] if isinstance(router_pid, int) else list(router_pid or [])
    clients = [_RouterClient(r) for r in routers]
    spread = None  # several router replicas: requests spread over them as ReplicaFront picks
    if len(clients) > 1:
        spread = ReplicaClients(clients, replica_front(scenario))
    client: Any = spread or clients[0]
    oracle = None  # run.event_truth: the routing truth from the workers' KV events
    if scenario.run.event_truth and not scenario.cluster.disaggregated:
        oracle = TruthOracle(routing_block_size(scenario.cluster))
        for c in clients:
            c.oracle = oracle
    router = routers[0]
    wall0 = time.perf_counter_ns()
    samples: list[Sample] = []
    token = os.environ.get(CONTROL_TOKEN_ENV, "")
    runs = [_LoadgenRun() for _ in clients]
    run = runs[0]
    played = Played()
    t0 = 0
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.listen)
            if oracle is not None:
                tg.start_soon(oracle.run)
            play_scope, wait_scope = anyio.CancelScope(), anyio.CancelScope()

            def lose(**details: Any) -> None:
                print(json.dumps({"event": "router_lost", **details}), file=sys.stderr)
                client.lose("router_lost")
                play_scope.cancel()  # sessions stop: nothing more is sent to a router that is gone
                wait_scope.cancel()

            async def on_signal() -> None:
                # SIGTERM or Ctrl-C: stop sending, report what happened so far; SIGUSR1: the router died
                async for signum in signals:
                    if signum == signal.SIGUSR1:  # kvemu up saw the router process die
                        lose(why="the router process exited")
                    elif run.stopped is None:
                        run.stopped = signal.Signals(signum).name
                        play_scope.cancel()
                        wait_scope.cancel()
                    else:
                        print(f"kvemu loadgen: {signal.Signals(signum).name} again: writing what ran, then "
                              "stopping", file=sys.stderr, flush=True)

            tg.start_soon(on_signal)  # from the start: a signal while waiting for the router is not fatal
            with wait_scope:
                firsts = [await _await_router(c, r, expect_workers, CONNECT_WAIT_S) for c, r in zip(clients, routers)]
            if wait_scope.cancelled_caught:
                if client.lost:
                    raise NotStarted(f"the router process exited before the run started ({router})")
                raise NothingRan("waiting for the router", run.stopped or "SIGINT")
            st = firsts[0]
            t0 = st.now_ns
            total = count_requests(sessions)
            log_start("loadgen", router=router, **({"routers": routers} if spread else {}), workers=st.workers,
                      requests=total)
            for r, first in zip(runs, firsts):
                r.last = first
            lost_after_ns = round(router_silence_s(scenario) * NS_PER_S)
            stall_ns = round(max(scenario.run.router_stall_s, lost_after_ns / NS_PER_S) * NS_PER_S)

            async def sampler(i: int) -> None:  # of router replica i (the report's samples are the first's view)
                waiting = False  # for a silent router whose process is alive
                client, run, router_pid = clients[i], runs[i], pids[i] if i < len(pids) else None
                while True:
                    try:
                        s = await client.stats(timeout_s=1.0)
                    except TimeoutError:  # a saturated router skips a sample; a silent one is gone
                        silent_ns = time.monotonic_ns() - client.heard_ns
                        if silent_ns <= lost_after_ns:
                            continue
                        alive = process_alive(router_pid) if router_pid is not None else None
                        if alive is False:
                            return lose(why="the router process exited")
                        if alive is None or silent_ns > stall_ns:
                            return lose(silent_s=round(silent_ns / NS_PER_S, 1))
                        if not waiting:
                            waiting = True
                            print(json.dumps({"event": "router_silent", "silent_s": round(silent_ns / NS_PER_S, 1),
                                              "process": "alive", "waiting_up_to_s": stall_ns / NS_PER_S}),
                                  file=sys.stderr, flush=True)
                        continue
                    if waiting:
                        waiting = False
                        print(json.dumps({"event": "router_answering"}), file=sys.stderr, flush=True)
                    run.observe(s, client)
                    if i == 0:
                        samples.extend(msgspec.structs.replace(x, time_ns=x.time_ns - t0) for x in s.samples)
                        if progress is not None:
                            progress.running(clock.now_ns(), sum(len(c.records) for c in clients), total)
                    await anyio.sleep(0.25)

            clock = _Since(t0, st.now_ns)
            client.router_now = lambda: clock.now_ns() + t0

            async def chaos() -> None:  # docker-compose: the load generator carries the timeline
                ids = sorted(st.workers)  # worker N of the timeline: the N-th registered at the start, by id
                for ev in sorted(scenario.chaos, key=lambda e: e.at_s):
                    await anyio.sleep(max(0, at_ns(ev) - clock.now_ns()) / NS_PER_S)
                    if ev.worker is not None and ev.worker < len(ids):
                        ev = msgspec.structs.replace(ev, worker=ids[ev.worker])
                    reply = await clients[ev.replica or 0].control(Control(token=token, event=ev))
                    print(json.dumps({"event": "chaos", "action": ev.action, "at_s": ev.at_s, "ok": reply.ok,
                                      "detail": reply.detail}), file=sys.stderr)

            for i in range(len(clients)):
                tg.start_soon(sampler, i)
            if apply_chaos:
                tg.start_soon(chaos)
            finished = True
            with play_scope:
                async with anyio.create_task_group() as play:
                    def cancel(request_id: str, reason: str) -> None:  # (lanes: at the deadline)
                        play.start_soon(client.cancel, request_id, reason)

                    finished = await play_workload(scenario, sessions, awaiting(play, client.submit), clock,
                                                   cancel=cancel, out=played)
                    if played.requests_cancelled:  # their records come back, failed
                        with anyio.move_on_after(CANCEL_DRAIN_S):
                            while client.awaiting:
                                await anyio.sleep(0.01)
                    play.cancel_scope.cancel()  # cut short: the requests still out are abandoned
            run.partial = not finished or client.lost is not None or run.stopped is not None
            if client.lost is None and run.stopped is None:
                for c, r in zip(clients, runs):
                    try:
                        r.observe(await c.stats(timeout_s=5.0, settle=True), c)
                    except TimeoutError:
                        pass
            tg.cancel_scope.cancel()
    except Exception as exc:  # noqa: BLE001 - a bug or a broken router: still report what ran, marked partial
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # the task group's: name the cause
            exc = exc.exceptions[0]  # type: ignore[assignment]
        if not t0:
            raise exc from None  # nothing ran yet
        run.partial = True
        run.stopped = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        print(json.dumps({"event": "loadgen_error", "error": run.stopped}), file=sys.stderr)
    records = [_shift(r, t0) for r in [*client.records.values(), *client.open_records()]]
    final = run.last
    counters, affinity, replicas = run.counters(), final.affinity, None
    if spread is not None:
        counters = merged_counters([r.counters() for r in runs])
        affinity = merged_affinity([r.last.affinity for r in runs])
        replicas = replica_report(scenario, [r.last for r in runs], [r.restarts for r in runs],
                                  [r.kv_stats() for r in runs], spread.replica_of)
    data = RunData(records=sorted(records, key=lambda r: (r.arrival_ns, r.request_id)), scenario_name=scenario.name,
                   command=command, mode="live", seed=scenario.run.seed, wall_time_ns=time.perf_counter_ns() - wall0,
                   partial=run.partial,
                   stop_reason=client.lost or run.stopped or ("drain_timeout" if run.partial else None),
                   block_size=routing_block_size(scenario.cluster), ranks=final.ranks, samples=samples,
                   kv_stats=run.kv_stats(), affinity=affinity, counters=counters,
                   failures=_failures(records), worker_events=run.worker_events(), pools=pool_sizes(scenario.cluster),
                   speculative=speculative_settings(scenario.cluster),
                   sla=scenario.run.sla, concurrency=scenario.workload.concurrency,
                   lanes=played.lanes, phases=played.phases, replicas=replicas,
                   chaos=timeline(scenario.chaos), truth_source=TRUTH_SOURCE if oracle is not None else None,
                   truth_feed=oracle.feed() if oracle is not None else None, scenario=scenario, origin=origin)
    if progress is not None:
        progress.enter("writing the report")
    return save_report(data, outdir)


CONNECT_WAIT_S = 60.0
"""How long the load generator waits for the router (and the workers it expects) before giving up."""


class NotStarted(RuntimeError):
    """The load generator stopped before its run started: nothing ran, so there is nothing to report."""


class RouterUnreachable(NotStarted):
    """The load generator never heard from the router, or the workers it expects never registered."""


async def _await_router(client: _RouterClient, router: str, expect_workers: int | None, wait_s: float) -> Stats:
    """The router's first view once it answers and has the expected workers; ``RouterUnreachable`` after
    ``wait_s`` (it is starting, or unreachable: a wrong address, or a different ``KVEMU_SECRET``)."""
    deadline = time.monotonic() + wait_s
    st: Stats | None = None
    while time.monotonic() < deadline:
        try:
            st = await client.stats(timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
        except TimeoutError:
            continue
        if expect_workers is None or len(st.workers) >= expect_workers:
            return st
        await anyio.sleep(0.1)
    if st is None:
        raise RouterUnreachable(f"no answer from the router at {router} within {wait_s:g} s: is it running, and "
                                f"does it have the same {security.SECRET_ENV} as this process?")
    raise RouterUnreachable(f"the router at {router} has {counted(len(st.workers), 'worker')}, not the "
                            f"{expect_workers} expected, after {wait_s:g} s")


class _LoadgenRun:
    """What the load generator learns of the router over a run, across router restarts."""

    def __init__(self) -> None:
        self.last: Stats = None  # type: ignore[assignment]
        self.gone: list[Stats] = []
        """The last view of each router process that was replaced (its counters still count)."""
        self.restarts = 0
        self.partial = False
        self.stopped: str | None = None

    def observe(self, s: Stats, client: _RouterClient) -> None:
        """A new view; a new router id means the router restarted: what was sent before it started and is not
        answered is failed with ``router_lost`` (a request queued while no router listened may still be
        answered by the new one, and its record then replaces the failure)."""
        last = self.last
        if s.router_id != last.router_id:
            self.restarts += 1
            lost = client.restarted(s.router_started_ns, "router_lost: the router restarted without answering")
            print(json.dumps({"event": "router_restarted", "router": s.router_id, "unanswered": len(lost)}),
                  file=sys.stderr)
            if s.process_id != last.process_id:  # a new process: the old one's counters are not in the new view
                self.gone.append(last)
        self.last = s

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in [*self.gone, self.last]:
            for k, v in s.counters.items():
                out[k] = out.get(k, 0) + v
        if self.restarts:
            out["router_restarts"] = self.restarts
        return out

    def kv_stats(self) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        for s in [*self.gone, self.last]:
            for wid, counts in s.kv_stats.items():
                mine = out.setdefault(wid, {})
                for k, v in counts.items():
                    mine[k] = mine.get(k, 0) + v
        return out

    def worker_events(self) -> list[WorkerEvent]:
        return [e for s in [*self.gone, self.last] for e in s.worker_events]


class _Since:
    """The router's clock as seen from the load generator: ns since the run started (t0)."""

    is_virtual = False

    def __init__(self, t0: int, router_now: int) -> None:
        self._offset = time.monotonic_ns() - (router_now - t0)

    def now_ns(self) -> int:
        return time.monotonic_ns() - self._offset


def _shift(rec: RequestRecord, t0: int) -> RequestRecord:
    def s(v: int | None) -> int | None:
        return None if v is None else v - t0

    return msgspec.structs.replace(
        rec, arrival_ns=rec.arrival_ns - t0, queued_ns=s(rec.queued_ns), routed_ns=s(rec.routed_ns),
        dispatch_ns=s(rec.dispatch_ns),
        engine=msgspec.structs.replace(rec.engine, admitted_ns=s(rec.engine.admitted_ns)),
        first_token_ns=s(rec.first_token_ns),
        token_times_ns=array("q", [t - t0 for t in rec.token_times_ns]),
        completion_ns=s(rec.completion_ns),
    )


def _failures(records: list[RequestRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if r.failure:
            key = r.failure.split(":")[0]
            out[key] = out.get(key, 0) + 1
    return out


def loadgen_main(scenario: Scenario, router: str | list[str], outdir: Path, expect_workers: int | None = None,
                 apply_chaos: bool = False, router_pid: int | list[int] | None = None) -> Summary:
    """``loadgen_report``'s summary."""
    return loadgen_report(scenario, router, outdir, expect_workers, apply_chaos, router_pid)[0]


def loadgen_report(scenario: Scenario, router: str | list[str], outdir: Path, expect_workers: int | None = None,
                   apply_chaos: bool = False, router_pid: int | list[int] | None = None,
                   origin: RunOrigin | None = None, command: str = "kvemu loadgen") -> tuple[Summary, Path | None]:
    """``kvemu loadgen``: play the scenario's workload against a router process and write the report
    (``apply_chaos``: also play the chaos timeline through the router's control channel; ``router_pid``: the
    router's process on this machine, so that a silent router is told from a gone one). Returns the summary and
    where the report went (``harness.report.files.save_report``). Several routers: the replicas of one router
    (``router.replicas``), in replica order, each ``router_pid`` that of the same replica. ``origin``: what the
    scenario was built from, for the report's "What ran"; ``command``: what the report is titled after (``kvemu up``
    runs a load generator too)."""
    doing = "generating the workload"
    meter = for_scenario(scenario)
    # on a terminal, a line every few seconds: what it does, how far, and the ETA (never silent for long)
    ticker = print_progress(meter, "kvemu loadgen", PROGRESS_EVERY_S) if sys.stderr.isatty() else None
    try:
        with terminate_as_interrupt():  # until the run's signal receiver opens, a signal stops the load generator
            sessions = build_sessions(scenario, meter.generated)
            doing = "waiting for the router"
            meter.enter(f"{doing} ({count_requests(sessions):,} requests made)")
            return run_live(lambda: _loadgen(scenario, router, outdir, expect_workers, apply_chaos, router_pid,
                                             sessions, meter, origin, command))
    except KeyboardInterrupt as exc:
        raise NothingRan(doing, getattr(exc, "reason", "SIGINT")) from None
    finally:
        if ticker is not None:
            ticker.set()
