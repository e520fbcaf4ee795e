"""Deprecated alias of ``workers.actor.metrics`` (the actor shell has its folder now), kept for one release."""

import warnings

from workers.actor.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, VllmMetrics

__all__ = ["VllmMetrics", "TTFT_BUCKETS", "ITL_BUCKETS", "REQUEST_LATENCY_BUCKETS"]

warnings.warn("workers.metrics is deprecated: import from workers.actor.metrics",
              DeprecationWarning, stacklevel=2)
