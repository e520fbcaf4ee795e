"""The whole scenario: its sections, its name, and the checks that span sections (the chaos timeline against the
cluster, the autoscaler's bounds, what a synthetic workload would build)."""

from __future__ import annotations

import re
from typing import Annotated

import msgspec
from msgspec import Meta

from kvemu.errors import InvalidArgument
from kvemu.limits import MAX_LIST_ITEMS, FilePath, Name
from kvemu.limits import MAX_PROMPT_TOKENS

from harness.scenario.sections import (
    MAX_RANKS,
    MAX_REQUESTS,
    MAX_WORKERS,
    CHAOS_TARGETS,
    AutoscalerSpec,
    ChaosEvent,
    ClusterSpec,
    RouterSpec,
    RunSpec,
    SyntheticWorkload,
    TraceWorkload,
)
from harness.text import counted

__all__ = ["Scenario", "MAX_SYNTHETIC_TOKENS"]


class Scenario(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """A whole scenario file."""

    name: Name = "scenario"
    """Names the report and the default output directory ``out/<name>``: letters, digits, ``.``, ``_``, ``-``."""
    cluster: ClusterSpec = ClusterSpec()
    router: RouterSpec = RouterSpec()
    workload: SyntheticWorkload | TraceWorkload = SyntheticWorkload()
    run: RunSpec = RunSpec()
    chaos: Annotated[list[ChaosEvent], Meta(max_length=MAX_LIST_ITEMS)] = []
    autoscaler: AutoscalerSpec | None = None
    """Scale one pool on a policy's decisions (optional; see README "Autoscaling")."""
    base_dir: FilePath = "."
    """Directory relative paths resolve against (set by the loader)."""

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise InvalidArgument(f"{self.name!r} is not a plain name: up to 100 letters, digits, '.', '_' or '-', "
                                  "starting with a letter or digit (it names the output directory)", field="name")
        if self.router.replicas > 1 and self.cluster.disaggregated:
            raise InvalidArgument("router.replicas > 1 with a disaggregated cluster is not supported yet: run the "
                                  "replicas in front of an aggregated cluster", field="router.replicas")
        if self.run.event_truth and self.cluster.disaggregated:
            raise InvalidArgument("run.event_truth with a disaggregated cluster is not supported yet (the load "
                                  "generator judges one pool's routing): drop run.event_truth", field="run.event_truth")
        if self.router.replicas > 1 and self.autoscaler is not None:
            raise InvalidArgument("router.replicas > 1 with an autoscaler is not supported yet (it reads one router's "
                                  "load view)", field="router.replicas")
        _check_chaos(self)
        if self.autoscaler is not None:
            _check_autoscaler(self, self.autoscaler)
        if isinstance(self.workload, SyntheticWorkload):
            _check_synthetic(self.workload, self.run)


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
MAX_SYNTHETIC_TOKENS = 250_000_000
"""Most prompt token slots a synthetic workload may generate up front (about 2 GB of lists)."""


def _check_chaos(s: Scenario) -> None:
    """Play the chaos timeline on worker ids (initial ``0..workers-1``, each ``add_worker`` the next id): every
    action must name a running worker and an existing rank, as the run will need them."""
    pools = list(s.cluster.pools().values())  # worker ids run pool by pool: prefill first, then decode
    dp_of: dict[int, int] = {}
    for n, dp, _ in pools:
        base = len(dp_of)
        dp_of.update((base + k, dp) for k in range(n))
    live = list(dp_of)
    next_id = len(dp_of)
    added_dp = pools[-1][1]  # add_worker adds to the last pool: the aggregated one, or the decode pool
    for i in sorted(range(len(s.chaos)), key=lambda k: s.chaos[k].at_s):  # same-instant events keep file order
        ev = s.chaos[i]
        aims = CHAOS_TARGETS[ev.action]
        at = f"chaos[{i}] ({ev.action} at {ev.at_s:g} s)"
        if ev.action == "restart_router" and s.cluster.disaggregated:
            raise InvalidArgument(f"{at}: restarting the routers of a disaggregated cluster is not supported yet",
                                  field=f"chaos[{i}].action")
        if ev.replica is not None:
            _check_replica_target(s, ev, at, f"chaos[{i}].replica")
            if ev.worker is None:
                continue  # (a replica: no worker)
        if aims.worker == "none":
            if ev.worker is not None:
                raise InvalidArgument(f"{at} takes no worker" + (f" (the new worker will be {next_id})"
                                      if ev.action == "add_worker" else ""), field=f"chaos[{i}].worker")
            if ev.action == "add_worker":
                if sum(dp_of[w] for w in live) + added_dp > MAX_RANKS:
                    raise InvalidArgument(f"{at}: the cluster would exceed {MAX_RANKS} ranks", field=f"chaos[{i}]")
                live.append(next_id)
                dp_of[next_id] = added_dp
                next_id += 1
            continue
        target = ev.worker
        if target is None:
            if aims.worker == "required":
                raise InvalidArgument(f"{at} needs a worker id", field=f"chaos[{i}].worker")
            if not live:
                raise InvalidArgument(f"{at}: no worker is running then", field=f"chaos[{i}]")
            target = min(live)
        if target not in live:
            running = ", ".join(map(str, live[:12])) + (" ..." if len(live) > 12 else "") if live else "none"
            raise InvalidArgument(f"{at}: worker {target} is not running then (running: {running})",
                                  field=f"chaos[{i}].worker")
        if aims.rank and ev.dp_rank >= dp_of[target]:
            raise InvalidArgument(f"{at}: dp_rank {ev.dp_rank} does not exist (worker {target} has {dp_of[target]} "
                                  "DP ranks)", field=f"chaos[{i}].dp_rank")
        if ev.action == "remove_worker":
            live.remove(target)


def _check_replica_target(s: Scenario, ev: ChaosEvent, at: str, field: str) -> None:
    """A chaos event aimed at one router replica: the replica exists, the action hits a replica, and a replica's
    KV feed can be faulted (its batches pass through this process only in virtual mode)."""
    if not CHAOS_TARGETS[ev.action].replica:
        targets = ", ".join(a for a, aims in CHAOS_TARGETS.items() if aims.replica)
        raise InvalidArgument(f"{at} takes no replica (replica targets: {targets})", field=field)
    if ev.replica is not None and ev.replica >= s.router.replicas:
        raise InvalidArgument(f"{at}: replica {ev.replica} does not exist (router.replicas is {s.router.replicas})",
                              field=field)
    if ev.action != "restart_router" and ev.worker is not None:
        raise InvalidArgument(f"{at}: give a worker or a replica, not both", field=field)


def _check_autoscaler(s: Scenario, a: AutoscalerSpec) -> None:
    """The autoscaler's pool exists and starts within its bounds, its largest cluster stays within the rank limit,
    and chaos names only workers whose ids are known before the run (the autoscaler's workers take ids as they
    start)."""
    pools = s.cluster.pools()
    pool = a.managed_pool(s.cluster)
    if pool not in pools:
        raise InvalidArgument(f"autoscaler.pool {pool} is not a pool of this cluster (pools: {', '.join(pools)})",
                              field="autoscaler.pool")
    n, dp, _ = pools[pool]
    if not a.min_workers <= n <= a.max_workers:
        raise InvalidArgument(f"the {pool} pool starts with {counted(n, 'worker')}, outside autoscaler.min_workers.."
                              f"max_workers ({a.min_workers}..{a.max_workers})", field="autoscaler.min_workers"
                              if n < a.min_workers else "autoscaler.max_workers")
    adds = sum(ev.action == "add_worker" for ev in s.chaos)
    last = list(pools)[-1]  # where chaos adds workers
    ranks = sum(w * d for p, (w, d, _) in pools.items() if p != pool) + a.max_workers * dp
    ranks += adds * pools[last][1]
    workers = sum(w for p, (w, _, _) in pools.items() if p != pool) + a.max_workers + adds
    if workers > MAX_WORKERS:
        raise InvalidArgument(f"with autoscaler.max_workers {a.max_workers} and the chaos timeline's {adds} added "
                              f"workers, the cluster could reach {workers} workers, more than the {MAX_WORKERS} a "
                              "router registers", field="autoscaler.max_workers")
    if ranks > MAX_RANKS:
        raise InvalidArgument(f"with autoscaler.max_workers {a.max_workers} ({dp} DP ranks each) and the chaos "
                              f"timeline's {adds} added workers, the cluster could reach {ranks} ranks, more than "
                              f"the {MAX_RANKS} a scenario may start", field="autoscaler.max_workers")
    initial = sum(w for w, _, _ in pools.values())
    for i, ev in enumerate(s.chaos):
        if ev.worker is not None and ev.worker >= initial:
            raise InvalidArgument(f"chaos[{i}] ({ev.action} at {ev.at_s:g} s) names worker {ev.worker}: with an "
                                  f"autoscaler, only the {initial} initial workers (0..{initial - 1}) have ids known "
                                  "before the run", field=f"chaos[{i}].worker")


def _check_synthetic(w: SyntheticWorkload, run: RunSpec) -> None:
    """Bound what synthesis builds up front: requests, the longest prompt and the token lists, on average."""
    duration = run.duration_s if run.duration_s is not None else 60.0
    sessions = w.rate_rps * duration
    per_session = w.turns * (1 + w.sub_agents)
    if run.max_requests is not None:
        sessions = min(sessions, run.max_requests / per_session + 1)
    isl, osl = (min(max(d.mean, d.low), d.high) for d in (w.isl, w.osl))
    last_prompt = w.system_prefix_tokens + w.turns * isl + (w.turns - 1) * osl
    if last_prompt > MAX_PROMPT_TOKENS:
        raise InvalidArgument(f"a session's last prompt would average {last_prompt:,.0f} tokens (system prefix + turns x "
                              f"(isl + osl)), more than the {MAX_PROMPT_TOKENS:,} kvemu simulates", field="workload.turns")
    if sessions * per_session > MAX_REQUESTS:
        raise InvalidArgument(f"about {sessions * per_session:,.0f} requests (rate_rps x duration_s x turns x "
                              f"(1 + sub_agents)), more than the {MAX_REQUESTS:,} a scenario may send; lower the rate "
                              "or the duration, or set run.max_requests", field="workload.rate_rps")
    slots = sessions * (1 + w.sub_agents) * w.turns * (w.system_prefix_tokens + (w.turns + 1) * (isl + osl) / 2)
    if slots > MAX_SYNTHETIC_TOKENS:
        raise InvalidArgument(f"the workload would generate about {slots:,.0f} prompt tokens up front, more than "
                              f"{MAX_SYNTHETIC_TOKENS:,}; lower the rate, duration, turns or lengths, or set "
                              "run.max_requests", field="workload.rate_rps")
