"""The autoscaler's part of a report: its summary keys, its report.md section and the GPU time it provisioned."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvemu.autoscale.records import AutoscaleLog, DecisionRecord, WorkerCount

from harness.report.summary_types import AutoscaleDecision, Autoscaler, OutcomeCounts

__all__ = ["MAX_DECISIONS", "MAX_SERIES", "provisioned_seconds", "autoscale_summary", "autoscale_markdown"]

MAX_DECISIONS = 200
"""Decisions listed in summary.json (all are counted)."""
MAX_SERIES = 500
"""Worker-count points listed in summary.json (all are counted)."""
MAX_ROWS = 50
"""Decisions shown in report.md."""

NS_PER_S = 1_000_000_000


def provisioned_seconds(series: list[WorkerCount], pool: str, start_ns: int, end_ns: int) -> float:
    """Worker-seconds the pool held GPUs (running, starting or draining) between ``start_ns`` and ``end_ns``."""
    points = [p for p in series if p.pool == pool]
    total = 0
    for i, p in enumerate(points):
        until = points[i + 1].time_ns if i + 1 < len(points) else end_ns
        lo, hi = max(p.time_ns, start_ns), min(until, end_ns)
        if hi > lo:
            total += p.provisioned * (hi - lo)
    return total / NS_PER_S


def _decision(d: DecisionRecord) -> AutoscaleDecision:
    return AutoscaleDecision(time_s=d.time_ns / NS_PER_S, action=d.action, pool=d.pool, requested=d.requested,
                             applied=d.applied, outcome=d.outcome, detail=d.detail, reason=d.reason,
                             worker_ids=list(d.worker_ids), ready_s=[t / NS_PER_S for t in d.ready_ns])


def autoscale_summary(log: AutoscaleLog) -> Autoscaler:
    """``kvemu.autoscaler``: the config, decision counts, the first decisions and the managed pool's counts."""
    ds = log.decisions
    mine = [p for p in log.series if p.pool == log.pool]
    outcomes = Counter(d.outcome for d in ds)
    return Autoscaler(
        config=dict(sorted(log.config.items())),
        pool=log.pool,
        decisions_total=len(ds),
        decisions_by_outcome=OutcomeCounts(applied=outcomes.get("applied", 0), clamped=outcomes.get("clamped", 0),
                                           refused=outcomes.get("refused", 0)),
        workers_added=sum(d.applied for d in ds if d.action == "add"),
        workers_removed=sum(d.applied for d in ds if d.action == "remove"),
        min_running_workers=min((p.running for p in mine), default=None),
        max_running_workers=max((p.running for p in mine), default=None),
        max_provisioned_workers=max((p.provisioned for p in mine), default=None),
        decisions=[_decision(d) for d in ds[:MAX_DECISIONS]],
        workers_over_time_total=len(mine),
        workers_over_time=[[p.time_ns / NS_PER_S, p.running, p.starting, p.draining] for p in mine[:MAX_SERIES]],
    )


def autoscale_markdown(section: Autoscaler, fmt: Callable[..., str], table: Callable[..., list[str]]) -> list[str]:
    """report.md's "Autoscaler" section from ``kvemu.autoscaler`` (``fmt``/``table``: the report's helpers)."""
    cfg = section.config
    by = section.decisions_by_outcome
    out = ["", "## Autoscaler", "",
           f"Policy `{cfg['policy']}` on the {section.pool} pool: every {fmt(cfg['interval_s'])} s, "
           f"{cfg['min_workers']}..{cfg['max_workers']} workers, startup delay {fmt(cfg['startup_delay_s'])} s, "
           f"cooldown {fmt(cfg['cooldown_s'])} s. {fmt(section.decisions_total)} decisions "
           f"({by.applied} applied, {by.clamped} clamped, {by.refused} refused): "
           f"{fmt(section.workers_added)} worker{'' if section.workers_added == 1 else 's'} added, "
           f"{fmt(section.workers_removed)} removed; running "
           f"workers between {fmt(section.min_running_workers)} and {fmt(section.max_running_workers)}.", ""]
    shown = section.decisions[:MAX_ROWS]
    if not shown:
        return out + ["The policy decided nothing."]
    out += table(["time (s)", "action", "workers", "outcome", "reason"],
                 [(f"{d.time_s:.3f}", f"{d.action} {d.applied}/{d.requested}",
                   ", ".join(map(str, d.worker_ids)) or "—",
                   d.outcome + (f" ({d.detail})" if d.detail else ""), d.reason) for d in shown])
    if section.decisions_total > len(shown):
        out += ["", f"… and {section.decisions_total - len(shown)} more."]
    return out
