"""Deprecated alias of ``harness.workload.traces.rows`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.traces.rows import (
    MAX_ID_BYTES, MAX_HASH_IDS, MAX_TRACE_NS, Row, json_lines, line_count, open_text, ms_to_ns, ns_to_ms, MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS, MAX_TRACE_MS, MAX_TRACE_LINE_BYTES, MAX_TRACE_ROWS, error, open_trace_file, trace_file_problem, trace_lines, too_many_rows, row_past,
)

__all__ = [
    "MAX_ID_BYTES",
    "MAX_HASH_IDS",
    "MAX_TRACE_NS",
    "Row",
    "json_lines",
    "line_count",
    "open_text",
    "ms_to_ns",
    "ns_to_ms",
    "MAX_PROMPT_TOKENS",
    "MAX_OUTPUT_TOKENS",
    "MAX_TRACE_MS",
    "MAX_TRACE_LINE_BYTES",
    "MAX_TRACE_ROWS",
    "error",
    "open_trace_file",
    "trace_file_problem",
    "trace_lines",
    "too_many_rows",
    "row_past",
]

warnings.warn("harness.traces.rows is deprecated: import from harness.workload.traces.rows",
              DeprecationWarning, stacklevel=2)
