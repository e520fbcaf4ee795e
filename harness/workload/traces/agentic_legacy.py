"""Legacy ``agentic_mooncake`` (no header): one request per row, ``wait_for`` naming the requests it waits for.

A row has the Mooncake fields, a unique ``request_id``, ``wait_for`` (request ids: all must complete),
``tool_wait_ms`` and ``delay``/``delay_ms`` (added together after the last of them completed), and for a root
(no ``wait_for``) ``timestamp``/``created_time``, its ready time in ms (default 0). ``session_id`` defaults to
``agentic-session``. Each ``wait_for`` id becomes a completion edge (``join`` when a row waits for several,
else ``sequence``); a play is a connected component of the edges, named ``legacy-play:<its first root>``.
Metadata without effect on replay (``request_kind``, ``branches``, ``prefix_reset``, ``tool_events``) is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple


from harness.workload.traces.graph import COMPLETION, JOIN, SEQUENCE, Dependency, GraphBuilder, Source, TraceGraph
from harness.workload.traces.mooncake import DEFAULT_MODEL
from harness.workload.traces.rows import MAX_PROMPT_TOKENS, MAX_TRACE_ROWS, Row, check_capacity, json_lines, ns_to_ms

__all__ = ["DEFAULT_SESSION", "load_agentic_legacy", "legacy_rows"]

DEFAULT_SESSION = "agentic-session"


class _Parsed(NamedTuple):
    line: int
    request_id: str
    session: str
    hash_ids: list[int]
    input_length: int
    output_length: int
    ready_ns: int
    wait_for: list[str]
    delay_ns: int
    output_token_ids: list[int] | None


def _parse(row: Row, block_size: int) -> _Parsed:
    ids = row.hash_ids()
    if not ids:
        raise row.error("hash_ids", "is empty; a request needs at least one block of prompt")
    key = row.alias("input_length", "input_tokens")
    length = row.integer(key, low=1, high=MAX_PROMPT_TOKENS, required=False,
                         default=min(len(ids) * block_size, MAX_PROMPT_TOKENS))
    check_capacity(row, ids, length, block_size, exact=False)
    out = row.output_length()
    wait = row.items("wait_for")
    for j, w in enumerate(wait):
        if not isinstance(w, str) or not w:
            raise row.error(f"wait_for[{j}]", f"must be a non-empty request id (a string), got {w!r}")
    ts = row.alias("timestamp", "created_time")
    delay = row.ms(row.alias("delay", "delay_ms")) + row.ms("tool_wait_ms")
    return _Parsed(row.line, row.string("request_id"), row.string("session_id", required=False,
                                                                  default=DEFAULT_SESSION, numbers=True),
                   ids, length, out, row.ms(ts), wait, delay, row.token_ids("output_token_ids", out))


def _components(rows: list[_Parsed]) -> list[int]:
    """Each row's component (union-find over ``wait_for``, unknown ids left to the graph's check)."""
    index = {r.request_id: i for i, r in enumerate(rows)}
    parent = list(range(len(rows)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, r in enumerate(rows):
        for w in r.wait_for:
            j = index.get(w)
            if j is not None:
                a, b = find(i), find(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    return [find(i) for i in range(len(rows))]


def load_agentic_legacy(path: Path, block_size: int, *, max_rows: int = MAX_TRACE_ROWS) -> TraceGraph:
    """A legacy agentic_mooncake file as a graph (see the module doc)."""
    rows = []
    for row in json_lines(path, max_rows=max_rows):
        if row.has("schema"):
            raise row.error("schema", f"this is a header ({row.data['schema']!r}), which legacy agentic_mooncake "
                                      "rows have none of; read the file as agentic_mooncake")
        rows.append(_parse(row, block_size))
    if not rows:
        raise Row(str(path), 1, {}).error("request_id", "the trace did not contain any requests")
    comp = _components(rows)
    play_root: dict[int, str] = {}
    for r, c in zip(rows, comp):
        if not r.wait_for:
            play_root.setdefault(c, r.request_id)
    b = GraphBuilder(block_size, str(path), Source("agentic_mooncake_legacy"))
    for r, c in zip(rows, comp):
        relation = JOIN if len(r.wait_for) > 1 else SEQUENCE
        deps = [Dependency(w, COMPLETION, relation, r.delay_ns, f"wait_for[{j}]") for j, w in enumerate(r.wait_for)]
        play = f"legacy-play:{play_root.get(c, rows[c].request_id)}"
        b.add(r.request_id, play, r.session, DEFAULT_MODEL, r.hash_ids, r.input_length, r.output_length,
              0 if r.wait_for else r.ready_ns, r.line, deps, output_token_ids=r.output_token_ids)
    return b.finish()


def legacy_rows(g: TraceGraph) -> Iterator[dict[str, Any]]:
    """Each node as a legacy row: its edges' sources as ``wait_for`` and their longest delay as ``delay``
    (``harness.workload.traces.convert`` says what that loses)."""
    for n in g.nodes():
        row: dict[str, Any] = {"request_id": n.request_id, "session_id": n.session, "input_length": n.input_length,
                               "output_length": n.output_length, "hash_ids": list(n.hash_ids)}
        if n.edges:
            row["wait_for"] = [g.request_id(e.source) for e in n.edges]
            delay = max(e.delay_ns for e in n.edges)
            if delay:
                row["delay"] = ns_to_ms(delay)
        else:
            row["timestamp"] = ns_to_ms(n.not_before_ns)
        if n.output_token_ids is not None:
            row["output_token_ids"] = list(n.output_token_ids)
        yield row
