"""The built-in policy: scale on the worst of queue depth, KV usage, active requests and p90 latencies."""

from __future__ import annotations

import math

from kvemu.autoscale.config import AutoscaleConfig
from kvemu.autoscale.policy import ScaleDecision
from kvemu.autoscale.snapshot import MetricsSnapshot

__all__ = ["LoadSlaAutoscaler"]


class LoadSlaAutoscaler:
    """Each signal with a target gives a pressure (value / target); the highest decides.

    Above 1: as many workers as the load would need at that ratio (``ceil(running x pressure)``, counting
    workers already starting, at most ``max_scale_up`` at once). Below: one worker goes when, with it gone,
    the highest pressure (scaled by running / (running - 1)) would stay under ``scale_down_below``, no worker
    is starting and more than ``min_workers`` run. Latency signals count only when a request completed in the window.
    """

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config

    def _signals(self, snap: MetricsSnapshot) -> list[tuple[float, str]]:
        """(pressure, description) of each signal with a target, for a pool with running workers."""
        cfg, pool = self.config, snap.pool
        n = pool.running
        out: list[tuple[float, str]] = []
        if cfg.target_queue_per_worker is not None:
            q = pool.queue_depth / n
            out.append((q / cfg.target_queue_per_worker, f"queue {q:.2f}/worker (target {cfg.target_queue_per_worker:g})"))
        if cfg.target_kv_usage is not None and pool.kv_usage is not None:
            out.append((pool.kv_usage / cfg.target_kv_usage,
                        f"KV usage {pool.kv_usage:.1%} (target {cfg.target_kv_usage:.0%})"))
        if cfg.target_active_per_worker is not None:
            a = pool.active_requests / n
            out.append((a / cfg.target_active_per_worker,
                        f"{a:.2f} active/worker (target {cfg.target_active_per_worker:g})"))
        for name, stats, target in (("TTFT", snap.ttft_ms, cfg.target_ttft_ms), ("ITL", snap.itl_ms, cfg.target_itl_ms)):
            if target is not None and stats is not None:
                out.append((stats.p90 / target, f"p90 {name} {stats.p90:.1f} ms (target {target:g} ms)"))
        return out

    def decide(self, snapshot: MetricsSnapshot) -> list[ScaleDecision]:
        """Add when a signal is over its target, remove one when all would stay well under it without a worker."""
        pool = snapshot.pool
        if not pool.running:  # nothing to measure load on; the governor keeps min_workers
            return []
        signals = self._signals(snapshot)
        if not signals:
            return []
        pressure, text = max(signals, key=lambda s: s[0])  # the first of equal pressures
        n, starting = pool.running, pool.starting
        if pressure > 1:
            desired = math.ceil(n * pressure)
            add = min(desired - n - starting, self.config.max_scale_up)
            if add <= 0:
                return []
            return [ScaleDecision(action="add", count=add, reason=f"{text}: {n} running + {starting} starting, "
                                                                  f"load needs {desired}")]
        if starting or n <= max(1, self.config.min_workers):
            return []
        after = pressure * n / (n - 1)
        if after < self.config.scale_down_below:
            return [ScaleDecision(action="remove", reason=f"{text}: {after:.2f} of target with {n - 1} workers "
                                                          f"(< {self.config.scale_down_below:g})")]
        return []
