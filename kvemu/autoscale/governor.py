"""Holds a policy's decisions to the autoscaler's rules: one pool, min/max workers, cooldown, who is removed."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TypeGuard

from kvemu.autoscale.config import AutoscaleConfig
from kvemu.autoscale.policy import ScaleDecision
from kvemu.autoscale.records import DecisionRecord
from kvemu.autoscale.snapshot import PoolMetrics
from kvemu.clock import NS_PER_S

__all__ = ["Governor"]

FLOOR = "min_workers floor"


class Governor:
    """Turns decisions into what is applied, in order, and remembers the last add and removal for the cooldown.

    A pool's size is its running plus starting workers. An add beyond ``max_workers`` or a removal below
    ``min_workers`` is clamped; a decision against the last opposite one within ``cooldown_s`` is refused. A
    removal takes the running workers with the fewest active requests (lowest id on ties), never one in
    ``protected``. After the decisions, a pool below ``min_workers`` gets workers added whatever the cooldown.
    """

    def __init__(self, config: AutoscaleConfig, pool: str) -> None:
        self.config = config
        self.pool = pool
        self.cooldown_ns = round(config.cooldown_s * NS_PER_S)
        self.last_add_ns: int | None = None
        self.last_remove_ns: int | None = None

    def _cooling(self, last_ns: int | None, now_ns: int) -> TypeGuard[int]:
        """Within the cooldown of ``last_ns`` (so it is set)."""
        return last_ns is not None and now_ns - last_ns < self.cooldown_ns

    def review(self, now_ns: int, pool: PoolMetrics, decisions: Sequence[ScaleDecision],
               protected: Collection[int] = ()) -> list[DecisionRecord]:
        """One record per decision (and one for a floor restore): adds to start (``applied``) and the workers to
        remove (``worker_ids``)."""
        cfg = self.config
        size = pool.running + pool.starting
        removable = sorted((w for w in pool.running_ids if w not in protected),
                           key=lambda w: (pool.active_by_worker.get(w, 0), w))
        out: list[DecisionRecord] = []
        for d in decisions:
            rec = DecisionRecord(time_ns=now_ns, action=d.action, pool=d.pool or self.pool, requested=d.count,
                                 applied=0, outcome="refused", reason=d.reason)
            out.append(rec)
            if rec.pool != self.pool:
                rec.detail = f"pool {rec.pool} is not scaled by this autoscaler (its pool: {self.pool})"
                continue
            if d.action == "add":
                if self._cooling(self.last_remove_ns, now_ns):
                    rec.detail = f"cooldown: a worker was removed at {self.last_remove_ns / NS_PER_S:g} s"
                    continue
                n = min(d.count, max(0, cfg.max_workers - size))
                if n < d.count:
                    rec.detail = f"max_workers {cfg.max_workers}"
                size += n
                if n:
                    self.last_add_ns = now_ns
            else:
                if self._cooling(self.last_add_ns, now_ns):
                    rec.detail = f"cooldown: a worker was added at {self.last_add_ns / NS_PER_S:g} s"
                    continue
                if d.worker_id is not None and d.worker_id not in removable:
                    rec.detail = (f"worker {d.worker_id} is named by a later chaos event" if d.worker_id in protected
                                  and d.worker_id in pool.running_ids else
                                  f"worker {d.worker_id} is not running in pool {self.pool}")
                    continue
                pick = [d.worker_id] if d.worker_id is not None else removable
                n = min(d.count, max(0, size - cfg.min_workers), len(pick))
                if n < d.count:
                    rec.detail = (f"min_workers {cfg.min_workers}" if size - cfg.min_workers < d.count
                                  else f"only {len(pick)} running workers may be removed")
                rec.worker_ids = pick[:n]
                removable = [w for w in removable if w not in rec.worker_ids]
                size -= n
                if n:
                    self.last_remove_ns = now_ns
            rec.applied = n
            rec.outcome = "applied" if n == d.count else "clamped" if n else "refused"
        if size < cfg.min_workers:
            n = cfg.min_workers - size
            out.append(DecisionRecord(time_ns=now_ns, action="add", pool=self.pool, requested=n, applied=n,
                                      outcome="applied", detail=FLOOR,
                                      reason=f"{pool.running} running + {pool.starting} starting < min_workers "
                                             f"{cfg.min_workers}"))
            self.last_add_ns = now_ns
        return out
