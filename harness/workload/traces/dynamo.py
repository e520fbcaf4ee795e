"""Dynamo's request trace (``dynamo.request.trace.v1``, JSONL or gzip JSONL; a directory: its shards, sorted),
lowered to a graph.

A record (or its nested ``event`` object) has ``schema``, ``event_type``, ``event_time_unix_ms``, optional
``agent_context {session_id, parent_session_id}``, ``request {request_id, model, output_tokens,
request_received_ms, total_time_ms, replay {trace_block_size, input_length, input_sequence_hashes}}`` and
``tool {tool_call_id, tool_class, claude {source_request_id, consumer_request_id, child_session_id,
execution_mode}}``. Only ``request_end``, ``tool_end`` and ``tool_error`` count; ``request_payload`` and
``tool_start`` are skipped. A request starts at ``request_received_ms`` (else event time − total time) and
ends at start + total time (else the event time); times are rebased to the first start.

Standard form (no ``agent_context``): each request is a root at its start. Agentic form: a session's requests
(sorted by start, end, id) chain by completion edges; a child session is spawned (dispatch) by the tool event's
``source_request_id`` naming it, else by the parent's latest request started by the child's start, and joined
(completion) into the tool's ``consumer_request_id``, else the parent's first request started at or after the
child's end. An edge's delay is the target's start minus the source's dispatch or completion time. A play is a
connected component, named ``dynamo-play:<its first request>``.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple


from harness.workload.traces.graph import COMPLETION, DISPATCH, JOIN, SEQUENCE, SPAWN, Dependency, GraphBuilder, Source, \
    TraceGraph
from harness.workload.traces.mooncake import DEFAULT_MODEL
from harness.workload.traces.rows import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, MAX_TRACE_ROWS, Row, check_capacity, error, json_lines, ms_to_ns

__all__ = ["SCHEMA", "load_dynamo"]

SCHEMA = "dynamo.request.trace.v1"
_SKIPPED = ("request_payload", "tool_start")
_MAX_UNIX_MS = 1 << 53


class _Request(NamedTuple):
    start: int  # ns since the epoch
    end: int
    request_id: str
    file: str
    line: int
    session: str | None
    parent: str | None
    model: str
    output: int
    block: int
    length: int
    hashes: list[int]


class _Tool(NamedTuple):
    file: str
    line: int
    field: str
    source: str
    consumer: str | None
    child: str


def _event(row: Row) -> Row:
    inner = row.sub("event")
    ev = inner if inner is not None else row
    schema = ev.data.get("schema")
    if schema != SCHEMA:
        raise ev.error("schema", f"must be {SCHEMA!r}, got {schema!r}; is this a Dynamo request trace?")
    return ev


def _request(ev: Row, explicit_block: int | None) -> _Request:
    req = ev.sub("request", required=True)
    assert req is not None
    rid = req.string("request_id")
    event_ms = ev.integer("event_time_unix_ms", high=_MAX_UNIX_MS)
    total = req.has("total_time_ms")
    total_ns = req.ms("total_time_ms") if total else 0
    start = ms_to_ns(req.number("request_received_ms", high=float(_MAX_UNIX_MS))) if req.has("request_received_ms") \
        else ms_to_ns(event_ms) - total_ns
    end = start + total_ns if total else ms_to_ns(event_ms)
    if end < start:
        raise req.error("request_received_ms", "the request ends before it starts (event time before the "
                                               "received time); check the clocks")
    replay = req.sub("replay", required=True)
    assert replay is not None
    block = replay.integer("trace_block_size", low=1, high=MAX_PROMPT_TOKENS)
    if explicit_block is not None and block != explicit_block:
        raise replay.error("trace_block_size", f"is {block} but {explicit_block} was given (trace_block_size / "
                                               "--block-size); drop that or make them equal")
    length = replay.integer("input_length", low=1, high=MAX_PROMPT_TOKENS)
    hashes = replay.hash_ids("input_sequence_hashes")
    check_capacity(replay, hashes, length, block, exact=False, key="input_sequence_hashes")
    ctx = ev.sub("agent_context")
    session = parent = None
    if ctx is not None:
        session = ctx.string("session_id")
        parent = ctx.string("parent_session_id", required=False) or None
    return _Request(start, end, rid, ev.file, ev.line, session, parent, req.string("model", required=False,
                                                                          default=DEFAULT_MODEL),
                    req.integer("output_tokens", high=MAX_OUTPUT_TOKENS, required=False, default=1), block, length,
                    hashes)


def _tool(ev: Row) -> _Tool | None:
    tool = ev.sub("tool")
    claude = tool.sub("claude") if tool is not None else None
    if claude is None:
        return None
    mode = claude.data.get("execution_mode")
    if mode not in ("blocking", "background"):
        raise claude.error("execution_mode", f"must be 'blocking' or 'background', got {mode!r}")
    child = claude.string("child_session_id", required=False)
    if not child:
        return None
    consumer = claude.string("consumer_request_id", required=False) or None
    return _Tool(ev.file, ev.line, claude.name("child_session_id"), claude.string("source_request_id"),
                 consumer if mode == "blocking" else None, child)


def _rows(path: Path, max_rows: int) -> Iterator[Row]:
    """The records of a trace file, or of every ``.jsonl``/``.jsonl.gz`` shard under a directory (sorted)."""
    if not path.is_dir():
        yield from json_lines(path, max_rows=max_rows)
        return
    shards = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz")))
    if not shards:
        raise error(str(path), 1, "event_type", "the directory holds no .jsonl or .jsonl.gz shard")
    left = max_rows
    for shard in shards:
        for row in json_lines(shard, max_rows=left):
            left -= 1
            yield row


def _where(r: _Request) -> str:
    return f"{r.file}:{r.line}"


def _read(path: Path, block_size: int | None, max_rows: int) -> tuple[list[_Request], list[_Tool]]:
    requests: list[_Request] = []
    tools: list[_Tool] = []
    seen: dict[str, _Request] = {}
    first: _Request | None = None
    for row in _rows(path, max_rows):
        ev = _event(row)
        kind = ev.data.get("event_type")
        if kind in _SKIPPED:
            continue
        if kind == "request_end":
            r = _request(ev, block_size)
            if r.request_id in seen:
                raise ev.error("request.request_id", f"{r.request_id!r} ends twice ({_where(seen[r.request_id])} "
                                                     "too); request ids must be unique")
            seen[r.request_id] = r
            if first is None:
                first = r
            elif r.block != first.block:
                raise ev.error("request.replay.trace_block_size", f"is {r.block} but {_where(first)} has "
                                                                  f"{first.block}; one block size per trace")
            elif (r.session is None) != (first.session is None):
                raise ev.error("agent_context", f"{_where(first)} {'has' if first.session else 'has no'} "
                               "agent_context and this one differs; a trace is all agentic or all standard")
            requests.append(r)
        elif kind in ("tool_end", "tool_error"):
            t = _tool(ev)
            if t is not None:
                tools.append(t)
        else:
            raise ev.error("event_type", f"unknown event type {kind!r} (kvemu reads request_end, tool_end, "
                                         "tool_error and skips request_payload, tool_start)")
    if not requests:
        raise Row(str(path), 1, {}).error("event_type", "the trace has no request_end event: no request to replay")
    return requests, tools


def load_dynamo(path: Path, block_size: int | None = None, *, max_rows: int = MAX_TRACE_ROWS) -> TraceGraph:
    """A Dynamo request trace as a graph (see the module doc); its block size is the embedded one."""
    requests, tools = _read(path, block_size, max_rows)
    origin = min(r.start for r in requests)
    b = GraphBuilder(requests[0].block, str(path), Source("dynamo"))
    if requests[0].session is None:
        for r in requests:
            b.add(r.request_id, r.request_id, r.request_id, r.model, r.hashes, r.length, r.output,
                  r.start - origin, r.line, [])
        return b.finish()
    deps = _agentic_edges(requests, tools)
    plays = _plays(requests, deps)
    for r in sorted(requests, key=lambda r: (r.start, r.end, r.request_id)):
        mine = deps.get(r.request_id, [])
        b.add(r.request_id, plays[r.request_id], r.session or "", r.model, r.hashes, r.length, r.output,
              0 if mine else r.start - origin, r.line, mine)
    return b.finish()


def _agentic_edges(requests: list[_Request], tools: list[_Tool]) -> dict[str, list[Dependency]]:
    """Each request's incoming edges: its session's chain, then spawns and joins of child sessions."""
    by_id = {r.request_id: r for r in requests}
    sessions: dict[str, list[_Request]] = {}
    for r in sorted(requests, key=lambda r: (r.start, r.end, r.request_id)):
        sessions.setdefault(r.session or "", []).append(r)
    deps: dict[str, list[Dependency]] = {}

    def edge(src: _Request, dst: _Request, trigger: int, relation: int, field: str) -> None:
        at = src.start if trigger == DISPATCH else src.end
        deps.setdefault(dst.request_id, []).append(
            Dependency(src.request_id, trigger, relation, max(0, dst.start - at), field))

    for chain in sessions.values():
        for a, c in zip(chain, chain[1:]):
            edge(a, c, COMPLETION, SEQUENCE, "agent_context.session_id")
    parents: dict[str, str] = {}
    for chain in sessions.values():
        for r in chain:
            if r.parent is not None and parents.setdefault(r.session or "", r.parent) != r.parent:
                raise Row(r.file, r.line, {}).error("agent_context.parent_session_id", f"session {r.session!r} names "
                                                f"parent {r.parent!r} here and {parents[r.session or '']!r} before")
    by_child = {t.child: t for t in tools}
    for child, parent in parents.items():
        kids = sessions[child]
        head, tail = kids[0], kids[-1]
        mother = sessions.get(parent)
        tool = by_child.get(child)
        if tool is not None:
            src = by_id.get(tool.source)
            if src is None:
                raise Row(tool.file, tool.line, {}).error(tool.field.replace("child_session_id", "source_request_id"),
                                                   f"names request {tool.source!r}, which the trace has no "
                                                   "request_end for")
            edge(src, head, DISPATCH, SPAWN, "tool.claude.source_request_id")
            consumer = by_id.get(tool.consumer) if tool.consumer else None
            if consumer is not None:
                edge(tail, consumer, COMPLETION, JOIN, "tool.claude.consumer_request_id")
            continue
        if not mother:
            raise Row(head.file, head.line, {}).error("agent_context.parent_session_id", f"parent session {parent!r} has "
                                               "no request in the trace")
        starts = [m.start for m in mother]
        k = bisect_right(starts, head.start) - 1
        if k < 0:
            raise Row(head.file, head.line, {}).error("agent_context.parent_session_id", f"session {child!r} starts "
                                               f"before any request of its parent {parent!r}")
        edge(mother[k], head, DISPATCH, SPAWN, "agent_context.parent_session_id")
        j = bisect_left(starts, tail.end)
        if j < len(mother):
            edge(tail, mother[j], COMPLETION, JOIN, "agent_context.parent_session_id")
    return deps


def _plays(requests: list[_Request], deps: dict[str, list[Dependency]]) -> dict[str, str]:
    """Each request's play: its connected component, named by its earliest request."""
    parent = {r.request_id: r.request_id for r in requests}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for dst, ds in deps.items():
        for d in ds:
            if d.request_id in parent:
                a, c = find(dst), find(d.request_id)
                parent[a] = c
    first: dict[str, str] = {}
    for r in sorted(requests, key=lambda r: (r.start, r.end, r.request_id)):
        first.setdefault(find(r.request_id), r.request_id)
    return {r.request_id: f"dynamo-play:{first[find(r.request_id)]}" for r in requests}

