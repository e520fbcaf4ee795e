"""Deprecated alias of ``harness.workload.traces.agentic_v2`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.traces.agentic_v2 import SCHEMA, VERSION, is_header, load_agentic_v2, v2_rows

__all__ = ["SCHEMA", "VERSION", "is_header", "load_agentic_v2", "v2_rows"]

warnings.warn("harness.traces.agentic_v2 is deprecated: import from harness.workload.traces.agentic_v2",
              DeprecationWarning, stacklevel=2)
