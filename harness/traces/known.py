"""Deprecated alias of ``harness.scenario.known_traces`` (a scenario's hint for a missing trace), kept for one release."""

import warnings

from harness.scenario.known_traces import MOONCAKE_CONVERSATION_URL, MOONCAKE_CONVERSATION_ROWS, missing_trace_hint

__all__ = ["MOONCAKE_CONVERSATION_URL", "MOONCAKE_CONVERSATION_ROWS", "missing_trace_hint"]

warnings.warn("harness.traces.known is deprecated: import from harness.scenario.known_traces",
              DeprecationWarning, stacklevel=2)
