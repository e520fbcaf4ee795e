"""The trace formats by name: which loader reads each, which writer writes it, and telling them apart.

``detect_format`` decides from the path and the first row where that shows a format (a v2 header, a Dynamo
schema, a Weka object, an applied-compute session row, a row with ``wait_for``); anything else is read as
Mooncake, kvemu's default, whose reader names what a row lacks. ``mooncake-delta`` rows look like Mooncake rows
and are never guessed. ``load_graph`` reads any format as a
``TraceGraph``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvemu.errors import InvalidArgument
from workers.hash_id_prompt import DEFAULT_TRACE_BLOCK_SIZE

from harness.workload.traces.agentic_legacy import legacy_rows, load_agentic_legacy
from harness.workload.traces.agentic_v2 import is_header, load_agentic_v2, v2_rows
from harness.workload.traces.applied_compute import load_applied_compute
from harness.workload.traces.dynamo import SCHEMA as DYNAMO_SCHEMA
from harness.workload.traces.dynamo import load_dynamo
from harness.workload.traces.graph import TraceGraph
from harness.workload.traces.mooncake import load_mooncake, load_mooncake_delta, mooncake_delta_rows, mooncake_rows
from harness.workload.traces.rows import MAX_TRACE_ROWS, open_text, trace_lines
from harness.workload.traces.names import EMBEDDED_BLOCK_SIZE, FORMATS, WRITABLE
from harness.workload.traces.weka import load_weka

__all__ = ["FORMATS", "WRITABLE", "EMBEDDED_BLOCK_SIZE", "detect_format", "load_graph", "writer"]

_WRITERS: dict[str, Callable[[TraceGraph], Iterator[dict[str, Any]]]] = {
    "mooncake": mooncake_rows, "mooncake-delta": mooncake_delta_rows, "agentic_mooncake": v2_rows,
    "agentic_mooncake_legacy": legacy_rows}


def writer(fmt: str) -> Callable[[TraceGraph], Iterator[dict[str, Any]]]:
    """The rows of a graph written as ``fmt`` (one of ``WRITABLE``)."""
    return _WRITERS[fmt]


def _first_row(path: Path) -> dict[str, Any] | None:
    """The first non-blank line of a JSON Lines file, decoded (None: empty, or not a JSON object)."""
    with open_text(path) as fh:
        for _, text in trace_lines(fh, path):
            try:
                data = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                return None
            return data if isinstance(data, dict) else None
    return None


def detect_format(path: Path) -> str:
    """The format of the trace at ``path``, from its first row (``mooncake`` when nothing else shows)."""
    if path.is_dir():  # a Weka corpus, or a Dynamo trace's shards: as its first file is
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith((".json", ".jsonl", ".gz")))
        return "weka" if not files or files[0].suffix == ".json" else detect_format(files[0])
    if path.suffix == ".json":
        return "weka"
    row = _first_row(path)
    if row is not None:
        event = row.get("event")
        if is_header(row):
            return "agentic_mooncake"
        if row.get("schema") == DYNAMO_SCHEMA or (isinstance(event, dict) and event.get("schema") == DYNAMO_SCHEMA):
            return "dynamo"
        if "requests" in row and "hash_id_scope" in row:
            return "weka"
        if "num_turns" in row:
            return "applied_compute_agentic"
        if "wait_for" in row or "tool_wait_ms" in row:
            return "agentic_mooncake_legacy"
    return "mooncake"  # kvemu's own format (and its default): its reader names what a row lacks


def load_graph(path: Path, fmt: str = "auto", block_size: int | None = None, *,
               max_rows: int = MAX_TRACE_ROWS) -> TraceGraph:
    """The trace at ``path`` as a graph. ``fmt`` ``auto`` detects it; ``block_size`` None takes the file's own
    (or 512 where a format has none)."""
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt not in FORMATS:
        raise InvalidArgument(f"unknown trace format {fmt!r}; kvemu reads {', '.join(FORMATS)}", field="format")
    if path.is_dir() and fmt not in ("weka", "dynamo"):
        raise InvalidArgument(f"{path} is a directory; only a weka corpus or a dynamo trace's shards may be one",
                              field="trace")
    bs = DEFAULT_TRACE_BLOCK_SIZE if block_size is None else block_size
    if fmt == "mooncake":
        return load_mooncake(path, bs, max_rows=max_rows)
    if fmt == "mooncake-delta":
        return load_mooncake_delta(path, bs, max_rows=max_rows)
    if fmt == "agentic_mooncake":
        first = _first_row(path)
        if first is not None and ("schema" in first or "version" in first):  # (a header, maybe a bad one)
            return load_agentic_v2(path, block_size, max_rows=max_rows)
        return load_agentic_legacy(path, bs, max_rows=max_rows)
    if fmt == "agentic_mooncake_legacy":
        return load_agentic_legacy(path, bs, max_rows=max_rows)
    if fmt == "applied_compute_agentic":
        return load_applied_compute(path, bs, max_rows=max_rows)
    if fmt == "weka":
        return load_weka(path, block_size, max_rows=max_rows)
    return load_dynamo(path, block_size, max_rows=max_rows)
