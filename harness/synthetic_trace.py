"""Deprecated alias of ``harness.workload.synthetic_trace`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.synthetic_trace import (
    synthetic_rows, iter_synthetic_rows, write_synthetic_trace, MAX_SYNTHETIC_ROWS, TRACE_BLOCK_SIZE,
)

__all__ = ["synthetic_rows", "iter_synthetic_rows", "write_synthetic_trace", "MAX_SYNTHETIC_ROWS", "TRACE_BLOCK_SIZE"]

warnings.warn("harness.synthetic_trace is deprecated: import from harness.workload.synthetic_trace",
              DeprecationWarning, stacklevel=2)
