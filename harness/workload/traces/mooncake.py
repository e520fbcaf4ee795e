"""Mooncake JSONL (``mooncake``) and its delta form (``mooncake-delta``): rows of requests, sessions as chains.

Rows are read and checked by ``workers.trace.read_mooncake`` (one row schema for replay and conversion).
``mooncake_turns`` says when each row goes, the rule kvemu's replay has always used: a row whose
``session_id`` was seen continues that session ``delay`` ms after its previous turn ended; any other row starts
a session at its ``timestamp`` (ms), or ``delay`` ms after the last timestamp seen. In a graph a session is a
play of one chain: turn k+1 waits for turn k's completion plus its delay.

``mooncake-delta``: a later turn's ``hash_ids``/``input_length`` carry only what the turn adds; the prompt is the
previous prompt's blocks then the new ones (the previous output is not in it: the trace has no ids for it).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from kvemu.clock import NS_PER_MS
from workers.trace import MAX_TRACE_ROWS, MooncakeRow, read_mooncake

from harness.workload.traces.graph import COMPLETION, SEQUENCE, Dependency, GraphBuilder, Source, TraceGraph
from harness.workload.traces.rows import MAX_PROMPT_TOKENS, error, ns_to_ms

__all__ = ["DEFAULT_MODEL", "MooncakeTurn", "mooncake_turns", "load_mooncake", "load_mooncake_delta",
           "mooncake_rows", "mooncake_delta_rows"]

DEFAULT_MODEL = "unknown"
"""The model of a node whose format names none."""


class MooncakeTurn(NamedTuple):
    """A row and when it goes: ``follows`` its session's previous turn by ``time_ns``, or starts one then."""

    line: int
    row: MooncakeRow
    follows: bool
    time_ns: int


def mooncake_turns(path: str | Path, known: Container[str], limit: int | None, block_size: int, *,
                   speed: float = 1.0, max_rows: int = MAX_TRACE_ROWS) -> Iterator[MooncakeTurn]:
    """Each row of a Mooncake trace with its timing (see the module doc); ``known`` holds the session ids the
    caller has opened so far (read after each turn is taken, so the caller opens them as they come)."""
    last_ts = 0.0
    for lineno, row in read_mooncake(path, limit, block_size, max_rows=max_rows):
        sid = row.session_id
        delay_ms = row.delay or 0.0
        if row.timestamp is not None:
            last_ts = row.timestamp
        if sid is not None and sid in known:
            yield MooncakeTurn(lineno, row, True, round(delay_ms * NS_PER_MS / speed))
            continue
        start_ms = last_ts if row.timestamp is not None else last_ts + delay_ms
        yield MooncakeTurn(lineno, row, False, round(start_ms * NS_PER_MS / speed))


def _load(path: Path, block_size: int, max_rows: int, delta: bool, name: str) -> TraceGraph:
    b = GraphBuilder(block_size, str(path), Source(name))
    last: dict[str, tuple[int, str, int, list[int], int]] = {}  # session → (node, name, turns, hash ids, input)
    for t in mooncake_turns(path, last, None, block_size, max_rows=max_rows):
        row = t.row
        ids, length = list(row.hash_ids), row.input_length
        if t.follows:
            assert row.session_id is not None
            prev, session, k, prev_ids, prev_len = last[row.session_id]
            if delta:
                ids, length = prev_ids + ids, prev_len + length
                if length > MAX_PROMPT_TOKENS:
                    raise error(str(path), t.line, "input_length", f"the session's prompt grows to {length:,} "
                                f"tokens, longer than kvemu simulates ({MAX_PROMPT_TOKENS:,})")
            deps = [Dependency(b.request_id_of(prev), COMPLETION, SEQUENCE, t.time_ns, "delay")]
            not_before = 0
        else:
            session = row.session_id if row.session_id is not None else f"trace-{t.line}"
            k, deps, not_before = 0, [], t.time_ns
        i = b.add(f"{session}-t{k}", session, session, DEFAULT_MODEL, ids, length, row.output_length, not_before,
                  t.line, deps, output_token_ids=row.output_token_ids)
        if row.session_id is not None:
            last[row.session_id] = (i, session, k + 1, ids, length)
    return b.finish()


def load_mooncake(path: Path, block_size: int, *, max_rows: int = MAX_TRACE_ROWS) -> TraceGraph:
    """A Mooncake trace as a graph: each session a play of one chain."""
    return _load(path, block_size, max_rows, False, "mooncake")


def load_mooncake_delta(path: Path, block_size: int, *, max_rows: int = MAX_TRACE_ROWS) -> TraceGraph:
    """A Mooncake delta trace as a graph of whole prompts (each turn's prompt: the previous one's then its own)."""
    return _load(path, block_size, max_rows, True, "mooncake-delta")


def _rows(g: TraceGraph, prompt: Callable[[int, int | None], tuple[list[int], int]]) -> Iterator[dict[str, Any]]:
    """The rows of a graph of chains (``harness.workload.traces.convert`` checked it is one), in node order."""
    prev: dict[int, int] = {}  # session → its latest node
    for i in range(len(g)):
        s = g.session[i]
        p = prev.get(s)
        ids, length = prompt(i, p)
        row: dict[str, Any] = {"session_id": g.sessions[s], "input_length": length,
                               "output_length": g.output_length[i], "hash_ids": ids}
        edges = list(g.edges(i))
        if edges:
            row["delay"] = ns_to_ms(edges[0].delay_ns)
        else:
            row["timestamp"] = ns_to_ms(g.not_before_ns[i])
        out = g.output_token_ids.get(i)
        if out is not None:
            row["output_token_ids"] = list(out)
        prev[s] = i
        yield row


def mooncake_rows(g: TraceGraph) -> Iterator[dict[str, Any]]:
    """A graph of chains as Mooncake rows: a root at its ``timestamp``, a later turn with its ``delay``."""
    return _rows(g, lambda i, _p: (list(g.hash_ids(i)), g.input_length[i]))


def mooncake_delta_rows(g: TraceGraph) -> Iterator[dict[str, Any]]:
    """A graph of chains whose prompts extend each other as Mooncake delta rows (each turn's new blocks)."""
    def prompt(i: int, p: int | None) -> tuple[list[int], int]:
        ids = list(g.hash_ids(i))
        if p is None:
            return ids, g.input_length[i]
        return ids[len(g.hash_ids(p)):], g.input_length[i] - g.input_length[p]
    return _rows(g, prompt)
