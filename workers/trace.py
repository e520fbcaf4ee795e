"""Deprecated alias, kept for one release: a trace's prompt is ``workers.hash_id_prompt``; reading Mooncake rows
and files is the workload's (``harness.workload.traces.mooncake``, ``harness.workload.traces.rows``)."""

import warnings

from kvemu.limits import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS
from workers.hash_id_prompt import DEFAULT_TRACE_BLOCK_SIZE, HashIdTokens, clamped_input_length, expand_hash_ids

from harness.workload.traces.mooncake import MooncakeRow, mooncake_request, mooncake_row, read_mooncake
from harness.workload.traces.rows import (
    MAX_TRACE_LINE_BYTES,
    MAX_TRACE_MS,
    MAX_TRACE_ROWS,
    open_trace_file,
    trace_file_problem,
    trace_lines,
)

__all__ = [
    "DEFAULT_TRACE_BLOCK_SIZE",
    "MAX_PROMPT_TOKENS",
    "MAX_OUTPUT_TOKENS",
    "MAX_TRACE_MS",
    "MAX_TRACE_LINE_BYTES",
    "MAX_TRACE_ROWS",
    "MooncakeRow",
    "mooncake_row",
    "open_trace_file",
    "read_mooncake",
    "trace_file_problem",
    "trace_lines",
    "clamped_input_length",
    "expand_hash_ids",
    "HashIdTokens",
    "mooncake_request",
]

warnings.warn("workers.trace is deprecated: import from workers.hash_id_prompt (a trace's prompt) or "
              "harness.workload.traces (reading traces)", DeprecationWarning, stacklevel=2)
