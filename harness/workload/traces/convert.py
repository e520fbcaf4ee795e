"""Writing a graph as another format: what the target can hold, what it would lose, and the file.

``losses`` lists what writing ``g`` as ``fmt`` would change in its replay (edges a format cannot hold, dispatch
triggers, delays, floors); ``convert_trace`` refuses those unless allowed, and always reports what only names
lose (request and play ids, models, recorded API times) — those do not move a request.
With ``allow_lossy`` a graph becomes chains for Mooncake: each session in node order, its first request at the
time it would be released if every request took no time, each later one after its predecessor.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from kvemu.errors import InvalidArgument

from harness.workload.traces.formats import WRITABLE, writer
from harness.workload.traces.graph import COMPLETION, DISPATCH, SEQUENCE, Dependency, GraphBuilder, TraceGraph
from harness.workload.traces.mooncake import DEFAULT_MODEL
from harness.workload.traces.timing import release_times

__all__ = ["Conversion", "losses", "notes", "convert_trace", "as_chains"]


class Conversion(NamedTuple):
    """What ``convert_trace`` wrote: rows, and what was lost (``dropped``: replay; ``renamed``: names only)."""

    rows: int
    dropped: list[str]
    renamed: list[str]


def _count(what: str, ids: list[str]) -> str:
    return f"{len(ids):,} {what} (first: {ids[0]!r})"


def _previous_in_session(g: TraceGraph) -> list[int]:
    """Each node's previous node of its session in node order (-1: its session's first)."""
    last: dict[int, int] = {}
    out = []
    for i in range(len(g)):
        out.append(last.get(g.session[i], -1))
        last[g.session[i]] = i
    return out


def losses(g: TraceGraph, fmt: str) -> list[str]:
    """What writing ``g`` as ``fmt`` would change in its replay, one line each (empty: nothing)."""
    out: list[str] = []
    if fmt == "agentic_mooncake":
        return out
    floors = [g.request_id(i) for i in range(len(g)) if g.edge_end[i] != (g.edge_end[i - 1] if i else 0)
              and g.not_before_ns[i]]
    if floors:
        out.append(_count("not_before floors of requests that also wait for others", floors))
    if fmt == "agentic_mooncake_legacy":
        dispatch = [g.request_id(i) for i in range(len(g)) if any(e.trigger == DISPATCH for e in g.edges(i))]
        uneven = [g.request_id(i) for i in range(len(g)) if len({e.delay_ns for e in g.edges(i)}) > 1]
        if dispatch:
            out.append(_count("requests started by another's dispatch (wait_for waits for completion)", dispatch))
        if uneven:
            out.append(_count("requests whose dependencies have different delays (one delay per row)", uneven))
        return out
    prev = _previous_in_session(g)
    other = [g.request_id(i) for i in range(len(g))
             if any(e.source != prev[i] or e.trigger != COMPLETION for e in g.edges(i))
             or (prev[i] >= 0 and g.edge_end[i] == (g.edge_end[i - 1] if i else 0))]
    if other:
        out.append(_count("requests with dependencies other than the previous turn of their session "
                          "(spawn, join, barrier, dispatch triggers, or a later root in a session)", other))
    shared = sorted({g.sessions[s] for s, key in enumerate(g.session_keys) if key != g.sessions[s]})
    if shared:
        out.append(_count("session names used in several plays (Mooncake would join them into one session)",
                          shared))
    plays = len(g.plays) != len(g.sessions)
    if plays:
        out.append(f"{len(g.plays):,} plays holding {len(g.sessions):,} sessions (Mooncake: one session each)")
    if fmt == "mooncake-delta":
        bad = [g.request_id(i) for i in range(len(g)) if prev[i] >= 0 and not _extends(g, prev[i], i)]
        if bad:
            out.append(_count("turns whose prompt does not extend the previous turn's (a delta holds only new "
                              "blocks)", bad))
    return out


def _extends(g: TraceGraph, p: int, i: int) -> bool:
    a, b = g.hash_ids(p), g.hash_ids(i)
    return len(b) > len(a) and b[:len(a)] == a and g.input_length[i] > g.input_length[p]


def notes(g: TraceGraph, fmt: str) -> list[str]:
    """What writing ``g`` as ``fmt`` loses in names only (ids, models, recorded times), one line each."""
    out: list[str] = []
    if fmt == "agentic_mooncake":
        cut = [g.request_id(i) for i in range(len(g))
               if g.input_length[i] > len(g.hash_ids(i)) * g.block_size
               or len(g.hash_ids(i)) > -(-g.input_length[i] // g.block_size)]
        if cut:
            out.append(_count("prompts written as the tokens their hash ids hold (v2 needs exactly "
                              "ceil(input_length / block_size) ids; replay already used these)", cut))
        return out
    models = [g.request_id(i) for i in range(len(g)) if g.models[g.model[i]] != DEFAULT_MODEL]
    if models:
        out.append(_count("model names", models))
    if g.api_time_ns:
        out.append(f"{len(g.api_time_ns):,} recorded API times")
    if fmt == "agentic_mooncake_legacy":
        first: dict[int, str] = {}
        for i in g.roots():
            first.setdefault(g.play_of(i), g.request_id(i))
        plays = [name for p, name in enumerate(g.plays) if name != f"legacy-play:{first.get(p)}"]
        if plays:
            out.append(_count("play ids (legacy rows name a play legacy-play:<its first root>)", plays))
        return out
    plays = [g.plays[g.session_play[s]] for s in range(len(g.sessions)) if g.plays[g.session_play[s]] != g.sessions[s]]
    if plays:
        out.append(_count("play ids (a Mooncake session is its own play)", plays))
    turn: dict[int, int] = {}
    ids = []
    for i in range(len(g)):
        k = turn.get(g.session[i], 0)
        turn[g.session[i]] = k + 1
        if g.request_id(i) != f"{g.sessions[g.session[i]]}-t{k}":
            ids.append(g.request_id(i))
    if ids:
        out.append(_count("request ids (Mooncake names a turn <session>-t<k>)", ids))
    return out


def as_chains(g: TraceGraph) -> TraceGraph:
    """``g`` as chains, a session a play: a session's first request at its release time if every request took
    no time, each later one after its predecessor's completion by its own delay (or the gap between releases).
    A session is named by its affinity key (``<play>:<session>`` where several plays use its name)."""
    release = release_times(g)
    prev = _previous_in_session(g)
    b = GraphBuilder(g.block_size, g.file, g.source)
    for i in range(len(g)):
        n = g.node(i)
        p = prev[i]
        if p < 0:
            deps, floor = [], release[i]
        else:
            same = [e.delay_ns for e in n.edges if e.source == p and e.trigger == COMPLETION]
            delay = same[0] if same else max(0, release[i] - release[p])
            deps, floor = [Dependency(g.request_id(p), COMPLETION, SEQUENCE, delay, "")], 0
        session = g.session_keys[g.session[i]]
        b.add(n.request_id, session, session, n.model, n.hash_ids, n.input_length, n.output_length, floor,
              g.line[i], deps, output_token_ids=n.output_token_ids, api_time_ns=n.api_time_ns)
    return b.finish()


def _lossy_graph(g: TraceGraph, fmt: str) -> TraceGraph:
    if fmt in ("mooncake", "mooncake-delta"):
        return as_chains(g)
    return g


def convert_trace(g: TraceGraph, out: Path, fmt: str, *, allow_lossy: bool = False) -> Conversion:
    """Writes ``g`` to ``out`` as ``fmt``; refuses (``InvalidArgument``, nothing written) a conversion that
    would change the replay unless ``allow_lossy``."""
    if fmt not in WRITABLE:
        raise InvalidArgument(f"kvemu cannot write {fmt!r} traces (a recording, not a graph); write one of "
                              f"{', '.join(WRITABLE)}", field="to")
    lost = losses(g, fmt)
    if lost and not allow_lossy:
        raise InvalidArgument(f"{g.file} as {fmt} would replay differently: " + "; ".join(lost)
                              + ". Convert to agentic_mooncake (v2) to keep the graph, or pass --allow-lossy to "
                                "drop that", field="to")
    h = _lossy_graph(g, fmt) if lost else g
    if fmt == "mooncake-delta" and losses(h, fmt):
        raise InvalidArgument(f"{g.file} as mooncake-delta: " + "; ".join(losses(h, fmt))
                              + "; write mooncake instead", field="to")
    rows = _write(out, writer(fmt)(h))
    return Conversion(rows, lost, notes(g, fmt))


def _write(out: Path, rows: Iterator[dict[str, Any]]) -> int:
    """Writes JSON Lines next to ``out`` and renames it there (a failed conversion leaves no half file)."""
    tmp = out.with_name(out.name + ".partial")
    n = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, separators=(",", ":")) + "\n")
            n += 1
    tmp.replace(out)
    return n
