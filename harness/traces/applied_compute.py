"""Deprecated alias of ``harness.workload.traces.applied_compute`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.traces.applied_compute import load_applied_compute, SHARED_PREFIX_TAG, MAX_TURNS

__all__ = ["load_applied_compute", "SHARED_PREFIX_TAG", "MAX_TURNS"]

warnings.warn("harness.traces.applied_compute is deprecated: import from harness.workload.traces.applied_compute",
              DeprecationWarning, stacklevel=2)
