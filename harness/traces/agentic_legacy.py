"""Deprecated alias of ``harness.workload.traces.agentic_legacy`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.traces.agentic_legacy import DEFAULT_SESSION, load_agentic_legacy, legacy_rows

__all__ = ["DEFAULT_SESSION", "load_agentic_legacy", "legacy_rows"]

warnings.warn("harness.traces.agentic_legacy is deprecated: import from harness.workload.traces.agentic_legacy",
              DeprecationWarning, stacklevel=2)
