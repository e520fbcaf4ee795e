"""The autoscaler's async shell: every ``interval_s`` it builds a ``MetricsSnapshot``, asks the policy, lets the
``Governor`` hold the decisions to the rules and starts (after the startup delay) or retires workers through the
same ``Cluster`` calls as chaos. Virtual and live runs share this code; only the clock differs.

Building a snapshot reads state only (router load views, queues, engine queue lengths, the runner's last KV
samples, the hook-fed request window): it syncs no engine and changes no decision of the run.
"""

from __future__ import annotations

import anyio
import msgspec

from kvemu.autoscale import (
    Autoscaler,
    AutoscaleLog,
    DecisionRecord,
    Governor,
    LoadSlaAutoscaler,
    MetricsSnapshot,
    PoolMetrics,
    RankKv,
    ScaleDecision,
    WorkerCount,
)
from kvemu.clock import NS_PER_S, Clock
from kvemu.lifecycle import AFFINITY, QUEUED, WAITING
from kvemu.hooks import Hooks

from harness.run.cluster import Cluster
from harness.plugins import import_callable
from harness.report.recorder import Recorder
from harness.report.run_data import Sample
from harness.report.request_window import RequestWindow, percentiles
from harness.scenario import AutoscalerSpec, Scenario, ScenarioError

__all__ = ["make_autoscaler", "AutoscalerShell"]

_HELD = (WAITING, QUEUED, AFFINITY)
"""Lifecycle stages of a request its router holds before any dispatch."""


def make_autoscaler(spec: AutoscalerSpec) -> Autoscaler:
    """The policy ``autoscaler.policy`` names, built with the section; a ``ScenarioError`` naming
    ``autoscaler.policy`` if it cannot be imported or built, or has no ``decide`` (``kvemu validate`` calls this)."""
    if spec.policy == "builtin":
        return LoadSlaAutoscaler(spec)
    factory = import_callable(spec.policy, "autoscaler.policy")
    try:
        policy = factory(spec)
    except Exception as exc:  # noqa: BLE001 - the scenario's code: report it as the scenario's error
        raise ScenarioError(f"autoscaler.policy: {spec.policy} raised {type(exc).__name__}: {exc}") from None
    if not callable(getattr(policy, "decide", None)):
        raise ScenarioError(f"autoscaler.policy: {spec.policy!r} returned {type(policy).__name__}, which has no "
                            "decide(snapshot) method (see kvemu.autoscale.Autoscaler)")
    return policy


class AutoscalerShell:
    """Runs one autoscaler over a run and keeps its ``AutoscaleLog`` (decisions, worker counts over time)."""

    def __init__(self, scenario: Scenario, hooks: Hooks, recorder: Recorder) -> None:
        spec = scenario.autoscaler
        assert spec is not None
        self.spec = spec
        self.scenario = scenario
        self.policy = make_autoscaler(spec)
        self.pool = spec.managed_pool(scenario.cluster)
        self.governor = Governor(spec, self.pool)
        self.window = RequestWindow(hooks, recorder.records)
        self.window_ns = round(spec.window * NS_PER_S)
        self.log = AutoscaleLog(config=msgspec.to_builtins(spec), pool=self.pool)
        self.pending: dict[str, int] = dict.fromkeys(scenario.cluster.pools(), 0)
        """Per pool, add decisions still in their startup delay."""
        self._counts: dict[str, tuple[int, int, int]] = {}
        self._kv_seen = 0
        self._kv_blocks: dict[tuple[int, int], int] = {}
        self._protect = sorted((round(ev.at_s * NS_PER_S), ev.worker) for ev in scenario.chaos if ev.worker is not None)

    # ------------------------------------------------------------------ counts

    def _states(self, c: Cluster, pool: str) -> tuple[list[int], int, int]:
        """(running ids ascending, starting, leaving) of one pool."""
        ids = [w for w in c.workers if c.worker_pool.get(w) == pool]
        running = sorted(w for w in ids if w not in c.starting and w not in c.leaving)
        starting = sum(w in c.starting for w in ids) + self.pending[pool]
        return running, starting, sum(w in c.leaving for w in ids)

    def record_counts(self, c: Cluster, now_ns: int) -> None:
        """Append a point to the worker-count series of each pool whose counts changed."""
        for pool in self.pending:
            running, starting, leaving = self._states(c, pool)
            counts = (len(running), starting, leaving)
            if self._counts.get(pool) == counts:
                continue
            self._counts[pool] = counts
            series = self.log.series
            last = next((i for i in range(len(series) - 1, -1, -1) if series[i].pool == pool), None)
            if last is not None and series[last].time_ns == now_ns:  # several changes at one instant: the last counts
                del series[last]
            series.append(WorkerCount(now_ns, pool, *counts))

    # ------------------------------------------------------------------ snapshot

    def _latest_kv(self, samples: list[Sample]) -> None:
        for s in samples[self._kv_seen:]:
            self._kv_blocks[(s.worker_id, s.dp_rank)] = s.kv_blocks
        self._kv_seen = len(samples)

    def _pool_metrics(self, c: Cluster, pool: str) -> PoolMetrics:
        router = c.routers[pool]
        running, starting, leaving = self._states(c, pool)
        load = router.load
        members = set(running)
        active_by_worker = dict.fromkeys(running, 0)
        active = 0
        kv = []
        total_blocks = self.scenario.cluster.pools()[pool][2].num_gpu_blocks
        for key in router.rank_keys():
            rl = load.rank(key)
            n = rl.active_requests if rl else 0
            active += n
            if key[0] in members:
                active_by_worker[key[0]] += n
                kv.append(RankKv(worker_id=key[0], dp_rank=key[1], active_blocks=rl.active_decode_blocks if rl else 0.0,
                                 cached_blocks=self._kv_blocks.get(key, 0), total_blocks=total_blocks))
        waiting = sum(core.num_waiting for w, actor in c.workers.items() if c.worker_pool.get(w) == pool
                      for core in actor.worker.cores)
        held = router.requests_at(_HELD)
        return PoolMetrics(pool=pool, dp_size=self.scenario.cluster.pools()[pool][1], running=len(running),
                           starting=starting, draining=leaving, running_ids=tuple(running), router_queue=held,
                           engine_waiting=waiting, active_requests=active, active_by_worker=active_by_worker,
                           kv=tuple(kv))

    def snapshot(self, c: Cluster, now_ns: int, samples: list[Sample]) -> MetricsSnapshot:
        """The cluster and its requests' recent latencies at ``now_ns``."""
        self._latest_kv(samples)
        w = self.window
        w.prune(now_ns, self.window_ns)
        ttft, itl, e2e = w.latencies()
        return MetricsSnapshot(now_ns=now_ns, window_ns=self.window_ns, managed_pool=self.pool,
                               pools={pool: self._pool_metrics(c, pool) for pool in c.routers},
                               in_flight=w.in_flight, arrivals=len(w.arrivals), completed=len(w.completions),
                               failed=len(w.failures), ttft_ms=percentiles(ttft), itl_ms=percentiles(itl),
                               e2e_ms=percentiles(e2e))

    # ------------------------------------------------------------------ the loop

    def _protected(self, now_ns: int) -> set[int]:
        """Workers a later chaos event names: the autoscaler leaves them for it."""
        return {w for t, w in self._protect if t > now_ns}

    async def run(self, c: Cluster, tg: anyio.abc.TaskGroup, clock: Clock, samples: list[Sample]) -> None:
        """Tick every ``interval_s`` (first at ``interval_s``) until cancelled."""
        c.on_change = lambda: self.record_counts(c, clock.now_ns())
        self.record_counts(c, clock.now_ns())
        interval = round(self.spec.interval_s * NS_PER_S)
        tick = 0
        while True:
            tick += 1
            await anyio.sleep(max(0, tick * interval - clock.now_ns()) / NS_PER_S)
            now = clock.now_ns()
            snap = self.snapshot(c, now, samples)
            decisions = self.policy.decide(snap)
            if not isinstance(decisions, list) or not all(isinstance(d, ScaleDecision) for d in decisions):
                raise TypeError(f"autoscaler.policy {self.spec.policy}: decide() must return a list of ScaleDecision, "
                                f"got {decisions!r:.200}")
            for rec in self.governor.review(now, snap.pool, decisions, self._protected(now)):
                self.log.decisions.append(rec)
                if rec.action == "add":
                    for _ in range(rec.applied):
                        self.pending[rec.pool] += 1
                        tg.start_soon(self._start, c, rec, clock)
                else:
                    for wid in rec.worker_ids:
                        c.retire(wid, graceful=self.spec.graceful)
            self.record_counts(c, now)

    async def _start(self, c: Cluster, rec: DecisionRecord, clock: Clock) -> None:
        await anyio.sleep(self.spec.startup_delay_s)
        self.pending[rec.pool] -= 1  # from here the cluster counts it as starting
        wid = await c.add_worker(rec.pool)
        rec.worker_ids.append(wid)
        rec.ready_ns.append(clock.now_ns())
