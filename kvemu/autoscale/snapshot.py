"""What an autoscaling policy sees at a tick: plain frozen data, times in integer nanoseconds."""

from __future__ import annotations

import msgspec

from kvemu.clock import NS_PER_S

__all__ = ["Percentiles", "RankKv", "PoolMetrics", "MetricsSnapshot"]


class Percentiles(msgspec.Struct, frozen=True, kw_only=True):
    """p50/p90/p99 in ms (the report's rounded-rank definition) and how many values they were taken from."""

    p50: float
    p90: float
    p99: float
    count: int


class RankKv(msgspec.Struct, frozen=True, kw_only=True):
    """The router's view of one rank's KV cache."""

    worker_id: int
    dp_rank: int
    active_blocks: float
    """Blocks of the requests routed to the rank and not ended (the router's load tracker)."""
    cached_blocks: int
    """Blocks the router's prefix index holds for the rank, at the runner's last sample."""
    total_blocks: int
    """The rank's ``num_gpu_blocks``."""

    @property
    def usage(self) -> float:
        """Share of the rank's blocks its active requests hold."""
        return self.active_blocks / self.total_blocks if self.total_blocks else 0.0


class PoolMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """One pool of workers: how many there are in each state, what waits, what runs, its KV."""

    pool: str
    """``aggregated``, ``prefill`` or ``decode``."""
    dp_size: int
    running: int
    """Workers taking requests."""
    starting: int
    """Workers decided but not routable yet (startup delay, registration)."""
    draining: int
    """Workers finishing their requests before they go."""
    running_ids: tuple[int, ...]
    """The running workers' ids, ascending."""
    router_queue: int
    """Requests the pool's router holds before dispatch (policy queue, affinity waits, no worker yet)."""
    engine_waiting: int
    """Requests the pool's engines accepted and have not started."""
    active_requests: int
    """Requests routed to the pool and not ended (the router's load view)."""
    active_by_worker: dict[int, int]
    """``active_requests`` per running worker."""
    kv: tuple[RankKv, ...]
    """Every rank of the running workers, by (worker, rank)."""

    @property
    def queue_depth(self) -> int:
        """Requests waiting anywhere in the pool: router queue plus engine waiting."""
        return self.router_queue + self.engine_waiting

    @property
    def kv_usage(self) -> float | None:
        """Mean ``RankKv.usage`` over the running ranks (None without any)."""
        return sum(r.usage for r in self.kv) / len(self.kv) if self.kv else None


class MetricsSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """The cluster at ``now_ns`` and its requests over the last ``window_ns``; read-only for the policy."""

    now_ns: int
    window_ns: int
    managed_pool: str
    """The pool the autoscaler scales (a key of ``pools``)."""
    pools: dict[str, PoolMetrics]
    in_flight: int
    """Requests arrived and not ended (all pools)."""
    arrivals: int
    """Requests that arrived in the window."""
    completed: int
    """Requests that completed in the window."""
    failed: int
    """Requests that failed in the window."""
    ttft_ms: Percentiles | None
    """Time to first token of the requests completed in the window (None: none completed)."""
    itl_ms: Percentiles | None
    """Every gap between consecutive tokens of those requests."""
    e2e_ms: Percentiles | None
    """Arrival to completion of those requests."""

    @property
    def pool(self) -> PoolMetrics:
        """The managed pool's metrics."""
        return self.pools[self.managed_pool]

    @property
    def arrival_rate_rps(self) -> float:
        """Arrivals per second over the window."""
        return self.arrivals * NS_PER_S / self.window_ns if self.window_ns else 0.0
