"""Deprecated alias of ``harness.run.pools`` (a run's modules have their folder now), kept for one release."""

import warnings

from harness.run.pools import (
    AGGREGATED, pool_sizes, speculative_settings, routing_block_size, worker_type_of, compose_pools, owner, samples, kv_stats, affinity_stats,
)

__all__ = [
    "AGGREGATED",
    "pool_sizes",
    "speculative_settings",
    "routing_block_size",
    "worker_type_of",
    "compose_pools",
    "owner",
    "samples",
    "kv_stats",
    "affinity_stats",
]

warnings.warn("harness.pools is deprecated: import from harness.run.pools",
              DeprecationWarning, stacklevel=2)
