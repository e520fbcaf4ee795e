"""Deprecated alias of ``harness.workload.trace_sessions`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.trace_sessions import TraceSessions, TraceSessionsBuilder, start_times, turn_count

__all__ = ["TraceSessions", "TraceSessionsBuilder", "start_times", "turn_count"]

warnings.warn("harness.trace_sessions is deprecated: import from harness.workload.trace_sessions",
              DeprecationWarning, stacklevel=2)
