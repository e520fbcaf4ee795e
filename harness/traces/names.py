"""Deprecated alias of ``harness.workload.traces.names`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.traces.names import FORMATS, WRITABLE, EMBEDDED_BLOCK_SIZE

__all__ = ["FORMATS", "WRITABLE", "EMBEDDED_BLOCK_SIZE"]

warnings.warn("harness.traces.names is deprecated: import from harness.workload.traces.names",
              DeprecationWarning, stacklevel=2)
