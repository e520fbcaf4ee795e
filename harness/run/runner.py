"""Run a scenario: start the cluster for its mode, play the sessions, sample, apply chaos, report.

Scenario time starts at 0 in both modes (live runs subtract the start of the wall clock), so reports
of the two modes read the same way.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio

from kvemu.clock import NS_PER_MS
from kvemu.errors import KvemuError
from kvemu.hooks import HookEvent, Hooks
from kvemu.messages import Chaos

from harness.run.autoscaler import AutoscalerShell
from harness.chaos import ChaosHost, Outcome, apply_chaos, timeline
from harness.run.cluster import Cluster, cluster
from harness.run.interrupts import Terminated, held_signals
from harness.run.replica_stats import replica_stats
from harness.report.recorder import Recorder
from harness.run.pools import affinity_stats, engine_group_usage, kv_stats, pool_sizes, routing_block_size, samples, speculative_settings
from harness.report.files import prepare_outdir, save_report
from harness.report.run_data import ReplicaRun, RunData, Sample
from harness.report.summary_types import Summary
from harness.run.mode import MODES, RunMode, run_mode
from harness.scenario import ChaosEvent, RunOrigin, Scenario, ScenarioError
from harness.workload.sessions import Played, drain_deadline_s, play_workload
from harness.workload.forms import Sessions
from harness.tuning import tuned_gc
from harness.workload.build import build_sessions, count_requests

__all__ = ["run_scenario", "RunOutcome", "RunAborted", "NothingRan", "Terminated", "Progress", "drain_deadline_s", "count_requests"]

Progress = Callable[[int, int, int], None]
"""``progress(scenario_time_ns, requests_done, requests_total)``, called at most every sample."""


class RunOutcome:
    """A finished (or interrupted) run: its data and, once written, its summary."""

    def __init__(self, data: RunData, recorder: Recorder) -> None:
        self.data = data
        self.recorder = recorder
        self.summary: Summary | None = None
        self.report_dir: Path | None = None
        """Where the report was written: the run's directory, or a temporary one when that became unwritable
        (None: nowhere, and the summary was printed on stderr)."""


@dataclass
class RunState:
    """What a run gathers as it goes (its tasks write here; ``RunData`` is made of it at the end)."""

    samples: list[Sample] = field(default_factory=list)
    ranks: set[tuple[int, int]] = field(default_factory=set)
    """Every (worker_id, dp_rank) seen, so ranks that served nothing still show."""
    partial: bool = False
    stop_reason: str | None = None
    autoscaler: AutoscalerShell | None = None
    played: Played = field(default_factory=Played)
    kv_stats: dict[int, dict[str, int]] = field(default_factory=dict)
    replicas: ReplicaRun | None = None
    affinity: dict[str, int] | None = None

    def stop(self, reason: str) -> None:
        """The run ends short, for ``reason``."""
        self.partial, self.stop_reason = True, reason


def run_scenario(scenario: Scenario, outdir: Path | None = None, *, progress: Progress | None = None,
                 observers: Sequence[Callable[[HookEvent], None]] = (),
                 generated: Callable[[int], None] | None = None, origin: RunOrigin | None = None) -> RunOutcome:
    """Run ``scenario`` to the end (or until interrupted) and write its report to ``outdir``.

    ``observers`` are subscribed to every lifecycle hook of the run (traces, external tooling); ``generated``
    is told of the requests as the workload is made (a progress line); ``origin`` is what the scenario was built
    from (its file and ``--set`` overrides), for the report's "What ran". Interrupted while the workload is made,
    nothing ran: ``NothingRan``, and no report (not a 0/0 one).
    """
    if outdir is not None:
        prepare_outdir(outdir)  # a bad path fails now, not after the run
    hooks = Hooks()
    recorder = Recorder(hooks)
    for observer in observers:
        hooks.subscribe(observer)
    state = RunState()
    wall0 = time.perf_counter_ns()
    error: BaseException | None = None
    shell: AutoscalerShell | None = None
    try:
        sessions = build_sessions(scenario, generated)  # an invalid trace raises ScenarioError: nothing ran
    except KeyboardInterrupt as exc:
        raise NothingRan("generating the workload", getattr(exc, "reason", "SIGINT")) from None
    try:
        if scenario.autoscaler is not None:  # a policy that does not import raises ScenarioError: nothing ran
            shell = state.autoscaler = AutoscalerShell(scenario, hooks, recorder)
        with tuned_gc(MODES[scenario.run.mode].young_gc_threshold):
            mode = run_mode(scenario.run.mode)
            main = _main(scenario, sessions, mode, hooks, recorder, state, progress, count_requests(sessions))
            mode.run(lambda: main)
    except ScenarioError:
        raise
    except KeyboardInterrupt as exc:
        state.stop(getattr(exc, "reason", "SIGINT"))
    except Exception as exc:  # noqa: BLE001 - a chaos action or a bug: still write what the run has
        state.stop(f"error: {_describe(exc)}")
        error = exc
    except BaseExceptionGroup as group:  # an interrupt that reached a task group
        interrupt, rest = group.split(KeyboardInterrupt)
        if rest is not None or interrupt is None:
            raise
        state.stop(getattr(_leaf(interrupt), "reason", "SIGINT"))
    data = RunData(
        records=sorted(recorder.records.values(), key=lambda r: (r.arrival_ns, r.request_id)),
        scenario_name=scenario.name, mode=scenario.run.mode, seed=scenario.run.seed,
        wall_time_ns=time.perf_counter_ns() - wall0, partial=state.partial, stop_reason=state.stop_reason,
        block_size=routing_block_size(scenario.cluster), ranks=sorted(state.ranks), samples=state.samples,
        kv_stats=state.kv_stats, affinity=state.affinity, counters=dict(recorder.counters),
        failures=dict(recorder.failures), worker_events=recorder.worker_events,
        pools=pool_sizes(scenario.cluster), speculative=speculative_settings(scenario.cluster), sla=scenario.run.sla,
        concurrency=scenario.workload.concurrency,
        autoscale=shell.log if shell is not None else None,
        replicas=state.replicas, chaos=timeline(scenario.chaos), lanes=state.played.lanes,
        phases=state.played.phases,
        scenario=scenario, origin=origin,
    )
    outcome = RunOutcome(data, recorder)
    if outdir is not None:
        if data.stop_reason in ("SIGINT", "SIGTERM"):  # (it takes a few seconds: say why nothing seems to happen)
            print(f"kvemu: {data.stop_reason}: writing the partial report in {outdir}", file=sys.stderr, flush=True)
        outcome.summary, outcome.report_dir = _save_whatever_comes(data, outdir)
    if error is not None:
        raise RunAborted(f"the run stopped early: {_describe(error)}"
                         + (f"; partial report in {outcome.report_dir}" if outcome.report_dir is not None else ""),
                         outcome) from error
    return outcome


def _save_whatever_comes(data: RunData, outdir: Path) -> tuple[Summary, Path | None]:
    """``save_report``, with SIGINT and SIGTERM said and otherwise ignored meanwhile: a second Ctrl-C does not cut
    the report short (it takes seconds, its plots most)."""
    with held_signals([], say="the report is being written; kvemu stops once it is (a few seconds)"):
        return save_report(data, outdir)


class NothingRan(KvemuError, RuntimeError):
    """A signal (``reason``: SIGINT or SIGTERM) stopped a run while ``doing`` (generating its workload, waiting for
    its router): nothing ran, so there is no report."""

    def __init__(self, doing: str, reason: str) -> None:
        super().__init__(f"interrupted ({reason}) while {doing}: nothing ran; no report")
        self.doing = doing
        self.reason = reason

    @property
    def exit_code(self) -> int:
        """130 for SIGINT (Ctrl-C), 143 for SIGTERM."""
        return 143 if self.reason == "SIGTERM" else 130


class RunAborted(KvemuError, RuntimeError):
    """The run failed part way; ``outcome`` holds what it recorded (its partial report is already written)."""

    def __init__(self, message: str, outcome: RunOutcome) -> None:
        super().__init__(message)
        self.outcome = outcome


def _leaf(exc: BaseException) -> BaseException:
    """The first innermost exception of an exception group (``exc`` itself otherwise)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _describe(exc: BaseException) -> str:
    leaf = _leaf(exc)
    return f"{type(leaf).__name__}: {leaf}"


async def _main(scenario: Scenario, sessions: Sessions, mode: RunMode, hooks: Hooks, recorder: Recorder,
                state: RunState, progress: Progress | None, total: int) -> None:
    run_clock = mode.clock
    async with cluster(scenario, run_clock, hooks) as c:
        state.ranks.update(c.ranks())
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_sample, c, state, recorder, progress, total, mode)
                for ev in scenario.chaos:
                    tg.start_soon(_chaos, c, ev, state)
                if state.autoscaler is not None:
                    tg.start_soon(state.autoscaler.run, c, tg, run_clock, state.samples)

                async def in_server() -> int:  # the engines in process: read as they are now
                    return c.unsettled()

                if not await play_workload(scenario, sessions, c.submit, run_clock,
                                           cancel=lambda rid, why: c.front.cancel(rid, why), in_server=in_server,
                                           out=state.played):
                    lanes = state.played.lanes
                    state.stop("warmup_failed" if lanes is not None and lanes.failed_preparation
                               else "drain_timeout")
                _take_sample(c, state, mode)
                tg.cancel_scope.cancel()
        finally:
            routers = list(c.routers.values())
            state.kv_stats = kv_stats(routers)
            state.replicas = replica_stats(c)
            state.affinity = affinity_stats([*routers, *c.replicas[1:]])  # (every replica binds its own sessions)
            state.ranks.update(c.ranks())


def _take_sample(c: Cluster, state: RunState, mode: RunMode) -> None:
    # (hybrid engines: their blocks held per KV cache group too, where the mode reads the engines)
    taken = samples(c.routers, mode.clock.now_ns(), mode.engine_usage(lambda: engine_group_usage(c.workers)))
    state.ranks.update((x.worker_id, x.dp_rank) for x in taken)
    state.samples.extend(taken)


async def _sample(c: Cluster, state: RunState, recorder: Recorder, progress: Progress | None, total: int,
                  mode: RunMode) -> None:
    last_wall = 0.0
    while True:
        c.sync_workers()  # the samples read the routers' indexes (workers that defer KV events: virtual only)
        _take_sample(c, state, mode)
        if progress is not None and time.monotonic() - last_wall > 0.1:
            last_wall = time.monotonic()
            done = recorder.counters["completed"] + recorder.counters["failed"]
            progress(mode.clock.now_ns(), done, total)
        await anyio.sleep(mode.sample_interval_s)


async def _chaos(c: Cluster, ev: ChaosEvent, state: RunState) -> None:
    await anyio.sleep(ev.at_s)
    done = await apply_chaos(_ClusterChaos(c), ev)
    if not done.ok:
        raise ValueError(f"chaos action {ev.action!r}: {done.detail}")


class _ClusterChaos(ChaosHost):
    """The in-process cluster as a chaos host: it applies every action (the cluster refuses a router restart of a
    disaggregated cluster, raising)."""

    def __init__(self, c: Cluster) -> None:
        self.c = c

    async def add_worker(self) -> Outcome:
        await self.c.add_worker()
        return Outcome(True)

    async def remove_worker(self, worker: int | None, graceful: bool) -> Outcome:
        c = self.c
        await c.remove_worker(worker if worker is not None else min(w for w in c.workers if w not in c.leaving),
                              graceful=graceful)
        return Outcome(True)

    async def restart_router(self, replica: int) -> Outcome:
        await self.c.restart_router(replica)
        return Outcome(True)

    async def delay_kv_events(self, replica: int | None, lag_ms: float) -> Outcome:
        if replica is not None:
            self.c.feeds[replica].lag_ns = round(lag_ms * NS_PER_MS)  # that replica's feed alone
        else:
            self.c.set_kv_lag(round(lag_ms * NS_PER_MS))  # every publisher, present and future
        return Outcome(True)

    async def drop_kv_events(self, replica: int, count: int) -> Outcome:
        self.c.feeds[replica].drop_next += count
        return Outcome(True)

    async def to_worker(self, worker: int | None, msg: Chaos) -> Outcome:
        """The worker applies it to itself, as a worker process does when the router forwards it."""
        target = worker if worker is not None else min(self.c.workers)
        actor = self.c.workers.get(target)
        why = actor.apply_chaos(msg) if actor is not None else f"worker {target} is not running"
        return Outcome(why is None, why or "")
