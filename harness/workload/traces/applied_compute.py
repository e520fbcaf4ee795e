"""``applied_compute_agentic`` JSONL: one row is one whole session, expanded to ``num_turns + 1`` requests.

A row: ``num_turns``, ``input_prompt_length`` (> 0), and per turn (arrays of ``num_turns`` items)
``assistant_response_length``, ``tool_call_output_length`` and ``tool_call_latency`` (seconds), then
``final_assistant_response_length``. Request k's prompt is the initial prompt plus every earlier turn's response
and tool output; it goes ``tool_call_latency[k-1]`` s after request k-1 completed. The format has no arrival
times: every session is ready at 0, so it is meant for a closed loop (``workload.concurrency``).

Hash ids are synthetic, one per block of the session's longest prompt, so each turn extends the previous one's
prefix: the first ``round(blocks * shared_prefix_ratio)`` blocks of the initial prompt are shared by every
session of a prefix group (``0xA63E << 48 | group << 32 | block``, group = row index % ``num_prefix_groups``),
the others get ids of their own from a counter starting at 1.
"""

from __future__ import annotations

import math
from pathlib import Path


from harness.workload.traces.graph import COMPLETION, SEQUENCE, Dependency, GraphBuilder, Source, TraceGraph
from harness.workload.traces.mooncake import DEFAULT_MODEL
from harness.workload.traces.rows import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, MAX_TRACE_MS, MAX_TRACE_ROWS, Row, json_lines

__all__ = ["load_applied_compute", "SHARED_PREFIX_TAG", "MAX_TURNS"]

SHARED_PREFIX_TAG = 0xA63E_0000_0000_0000
MAX_TURNS = 100_000
"""Most turns one row may expand to."""


def _lengths(row: Row, key: str, n: int, high: int) -> list[int]:
    items = row.items(key, required=True, limit=MAX_TURNS)
    if len(items) != n:
        raise row.error(key, f"holds {len(items)} items but num_turns is {n}; they must match")
    for j, v in enumerate(items):
        if type(v) is not int or not 0 <= v <= high:
            raise row.error(f"{key}[{j}]", f"must be an integer in [0, {high:,}], got {v!r}")
    return items


def _latencies(row: Row, n: int) -> list[int]:
    items = row.items("tool_call_latency", required=True, limit=MAX_TURNS)
    if len(items) != n:
        raise row.error("tool_call_latency", f"holds {len(items)} items but num_turns is {n}; they must match")
    out = []
    for j, v in enumerate(items):
        if type(v) not in (int, float) or not math.isfinite(v) or not 0 <= v <= MAX_TRACE_MS / 1000:
            raise row.error(f"tool_call_latency[{j}]", f"must be a finite number of seconds >= 0, got {v!r}")
        out.append(round(v * 1_000_000_000))
    return out


def load_applied_compute(path: Path, block_size: int, *, max_rows: int = MAX_TRACE_ROWS,
                         shared_prefix_ratio: float = 0.0, num_prefix_groups: int = 1) -> TraceGraph:
    """An applied_compute_agentic file as a graph: each row a play of one chain (see the module doc)."""
    b = GraphBuilder(block_size, str(path), Source("applied_compute_agentic"))
    counter = 1
    nodes = 0
    for index, row in enumerate(json_lines(path, max_rows=max_rows)):
        n = row.integer("num_turns", high=MAX_TURNS)
        prompt = row.integer("input_prompt_length", low=1, high=MAX_PROMPT_TOKENS)
        responses = _lengths(row, "assistant_response_length", n, MAX_OUTPUT_TOKENS)
        tools = _lengths(row, "tool_call_output_length", n, MAX_PROMPT_TOKENS)
        latencies = _latencies(row, n)
        final = row.integer("final_assistant_response_length", high=MAX_OUTPUT_TOKENS)
        nodes += n + 1
        if nodes > max_rows:
            raise row.error("num_turns", f"the trace expands to more than {max_rows:,} requests, the most a trace "
                                         "may hold; split it")
        inputs = [prompt]
        for k in range(n):
            inputs.append(inputs[-1] + responses[k] + tools[k])
        if inputs[-1] > MAX_PROMPT_TOKENS:
            raise row.error("tool_call_output_length", f"the last turn's prompt grows to {inputs[-1]:,} tokens, "
                                                       f"longer than kvemu simulates ({MAX_PROMPT_TOKENS:,})")
        blocks = -(-inputs[-1] // block_size)
        shared = min(round(-(-prompt // block_size) * shared_prefix_ratio), blocks)
        group = index % num_prefix_groups
        ids = [SHARED_PREFIX_TAG | group << 32 | k for k in range(shared)]
        ids += range(counter, counter + blocks - shared)
        counter += blocks - shared
        session = f"applied_compute_agentic_session_{row.line}"
        for k in range(n + 1):
            deps = [] if not k else [Dependency(f"{session}-t{k - 1}", COMPLETION, SEQUENCE, latencies[k - 1],
                                                f"tool_call_latency[{k - 1}]")]
            b.add(f"{session}-t{k}", session, session, DEFAULT_MODEL, ids[:-(-inputs[k] // block_size)], inputs[k],
                  responses[k] if k < n else final, 0, row.line, deps)
    if not nodes:
        raise Row(str(path), 1, {}).error("num_turns", "the trace did not contain any sessions")
    return b.finish()
