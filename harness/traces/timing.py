"""Deprecated alias of ``harness.workload.traces.timing`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.traces.timing import release_times, topological_order

__all__ = ["release_times", "topological_order"]

warnings.warn("harness.traces.timing is deprecated: import from harness.workload.traces.timing",
              DeprecationWarning, stacklevel=2)
