"""Deprecated alias of ``harness.run.replica_stats`` (a run's modules have their folder now), kept for one release."""

import warnings

from harness.run.replica_stats import (
    replica_stats,
)

__all__ = [
    "replica_stats",
]

warnings.warn("harness.replica_stats is deprecated: import from harness.run.replica_stats",
              DeprecationWarning, stacklevel=2)
