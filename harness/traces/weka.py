"""Deprecated alias of ``harness.workload.traces.weka`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.traces.weka import load_weka, MAX_WEKA_BYTES

__all__ = ["load_weka", "MAX_WEKA_BYTES"]

warnings.warn("harness.traces.weka is deprecated: import from harness.workload.traces.weka",
              DeprecationWarning, stacklevel=2)
