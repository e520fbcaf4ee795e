"""Mooncake JSONL (``mooncake``) and its delta form (``mooncake-delta``): rows of requests, sessions as chains.

Rows are read and checked here by ``read_mooncake`` (one row schema for replay and conversion;
``mooncake_request`` makes a row an engine's ``Request``).
``mooncake_turns`` says when each row goes, the rule kvemu's replay has always used: a row whose
``session_id`` was seen continues that session ``delay`` ms after its previous turn ended; any other row starts
a session at its ``timestamp`` (ms), or ``delay`` ms after the last timestamp seen. In a graph a session is a
play of one chain: turn k+1 waits for turn k's completion plus its delay.

``mooncake-delta``: a later turn's ``hash_ids``/``input_length`` carry only what the turn adds; the prompt is the
previous prompt's blocks then the new ones (the previous output is not in it: the trace has no ids for it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import msgspec

from kvemu.clock import NS_PER_MS
from kvemu.errors import InvalidArgument
from kvemu.limits import MAX_ID_CHARS, MAX_OUTPUT_TOKENS, U64, Count, I64
from workers.hash_id_prompt import DEFAULT_TRACE_BLOCK_SIZE, U32_MASK, HashIdTokens, check_hash_ids
from workers.request import Request

from harness.workload.traces.graph import COMPLETION, SEQUENCE, Dependency, GraphBuilder, Source, TraceGraph
from harness.workload.traces.rows import (
    MAX_PROMPT_TOKENS,
    MAX_TRACE_MS,
    MAX_TRACE_ROWS,
    error,
    ns_to_ms,
    open_trace_file,
    row_past,
    too_many_rows,
    trace_lines,
)

__all__ = ["DEFAULT_MODEL", "MooncakeRow", "mooncake_row", "read_mooncake", "mooncake_request", "MooncakeTurn", "mooncake_turns", "load_mooncake", "load_mooncake_delta",
           "mooncake_rows", "mooncake_delta_rows"]

DEFAULT_MODEL = "unknown"
"""The model of a node whose format names none."""
_U64_LIMIT = 1 << 64


class MooncakeRow(NamedTuple):
    """One validated trace row (``timestamp``/``delay`` in ms; ``None`` where the row has none).

    ``output_length`` is at least 1: a request always produces one token, even where the trace says 0.
    """

    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int
    timestamp: float | None = None
    delay: float | None = None
    session_id: str | None = None
    output_token_ids: Sequence[int] | None = None


def _number(row: Mapping[str, Any], key: str) -> float | None:
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_TRACE_MS:
        raise InvalidArgument(f"{key} must be a number of ms in [0, {MAX_TRACE_MS:.0e}] (ten years), got {value!r}",
                              field=key)
    return float(value)


def mooncake_row(row: object, trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE) -> MooncakeRow:
    """Validate one decoded trace row; ``InvalidArgument`` names the field (nothing else reads raw rows)."""
    if not isinstance(row, Mapping):
        raise InvalidArgument(f"a trace row must be a JSON object, got {type(row).__name__}")
    for key in ("hash_ids", "input_length", "output_length"):
        if key not in row:
            raise InvalidArgument(f"missing field {key!r}", field=key)
    hash_ids, input_length, output_length = row["hash_ids"], row["input_length"], row["output_length"]
    if not isinstance(hash_ids, (list, tuple)):
        raise InvalidArgument(f"hash_ids must be a list of integers, got {type(hash_ids).__name__}", field="hash_ids")
    check_hash_ids(hash_ids, input_length, trace_block_size)
    prompt = min(input_length, len(hash_ids) * trace_block_size)
    if prompt < 1:
        raise InvalidArgument(f"empty prompt (input_length {input_length}, {len(hash_ids)} hash ids)",
                              field="input_length")
    if prompt > MAX_PROMPT_TOKENS:
        raise InvalidArgument(f"a prompt of {prompt:,} tokens is longer than kvemu simulates "
                              f"({MAX_PROMPT_TOKENS:,})", field="input_length")
    if type(output_length) is not int or not 0 <= output_length <= MAX_OUTPUT_TOKENS:
        raise InvalidArgument(f"output_length must be an integer in [0, {MAX_OUTPUT_TOKENS:,}], got {output_length!r}",
                              field="output_length")
    sid = row.get("session_id")
    if sid is not None and len(str(sid).encode()) > MAX_ID_CHARS:
        raise InvalidArgument(f"session_id is {len(str(sid).encode()):,} bytes long, more than the {MAX_ID_CHARS} a "
                              "router takes", field="session_id")
    out_ids = row.get("output_token_ids")
    if out_ids is not None and not (isinstance(out_ids, (list, tuple)) and all(type(t) is int and 0 <= t <= U32_MASK for t in out_ids)):
        raise InvalidArgument("output_token_ids must be a list of integers in [0, 2**32)", field="output_token_ids")
    return MooncakeRow(tuple(hash_ids), input_length, max(1, output_length), _number(row, "timestamp"), _number(row, "delay"),
                       None if sid is None else str(sid), out_ids)


_Ms = Annotated[float, msgspec.Meta(ge=0, le=MAX_TRACE_MS)]


class _DecodedRow(msgspec.Struct):
    """A trace row as msgspec decodes it, types and ranges checked in C: the fast path of ``read_mooncake``."""

    hash_ids: Annotated[tuple[U64, ...], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]  # (below 2**64: checked after)
    input_length: Count
    output_length: Annotated[int, msgspec.Meta(ge=0, le=MAX_OUTPUT_TOKENS)]
    timestamp: _Ms | None = None
    delay: _Ms | None = None
    session_id: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)] | I64 | None = None
    output_token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=U32_MASK)]],
                                msgspec.Meta(max_length=MAX_OUTPUT_TOKENS)] | None = None


_decode_row = msgspec.json.Decoder(_DecodedRow).decode


def _fast_row(line: str, trace_block_size: int) -> MooncakeRow | None:
    """The row of a JSON line that ``mooncake_row(json.loads(line))`` accepts, equal to what it gives; None for
    any other line (that path then names the error), so a valid row skips the per-field Python checks."""
    try:
        r = _decode_row(line)
    except msgspec.MsgspecError:
        return None
    ids = r.hash_ids
    prompt = min(r.input_length, len(ids) * trace_block_size)
    if not 1 <= prompt <= MAX_PROMPT_TOKENS or max(ids) >= _U64_LIMIT:
        return None
    sid = r.session_id
    if type(sid) is str and len(sid) > MAX_ID_CHARS // 4 and len(sid.encode()) > MAX_ID_CHARS:
        return None  # (more bytes than characters: the full path names it)
    return MooncakeRow(ids, r.input_length, max(1, r.output_length), r.timestamp, r.delay,
                       None if sid is None else str(sid), r.output_token_ids)


def read_mooncake(path: str | Path, limit: int | None = None,
                  trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE, *,
                  max_rows: int = MAX_TRACE_ROWS) -> Iterator[tuple[int, MooncakeRow]]:
    """``(line number, row)`` for the first ``limit`` rows (blank lines skipped, not counted), read lazily.

    A bad line raises ``InvalidArgument`` naming the file, the line and the field; so does the row past
    ``max_rows`` when no ``limit`` (at most ``max_rows``) stops the reading first — before it is parsed,
    so that a huge trace is refused at its bound, not after it was all read.
    """
    if limit is None or limit > max_rows:
        limit, bounded = max_rows, True
    else:
        bounded = False
    if limit is not None and limit <= 0:
        return
    n = 0
    fast = type(trace_block_size) is int and trace_block_size >= 1  # (else every row gets the full path's error)
    with open_trace_file(path) as fh:
        if bounded and fh.seekable():  # refused before any row is parsed and kept (a pipe: at the row past it)
            past = row_past(fh, max_rows)
            if past is not None:
                raise InvalidArgument(too_many_rows(path, past, max_rows), field="max_requests")
            fh.seek(0)
        for lineno, line in trace_lines(fh, path):
            if n >= limit:  # (the file grew after the count)
                raise InvalidArgument(too_many_rows(path, lineno, max_rows), field="max_requests")
            row = _fast_row(line, trace_block_size) if fast else None
            try:
                if row is None:
                    row = mooncake_row(json.loads(line), trace_block_size)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            except InvalidArgument as exc:
                raise InvalidArgument(f"{path}:{lineno}: not a Mooncake trace row: {exc}", field=exc.field) from None
            yield lineno, row
            n += 1
            if n >= limit and not bounded:
                return


def mooncake_request(
    record: MooncakeRow | Mapping[str, Any],
    *,
    request_id: str,
    arrival_ns: int | None = None,
    trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE,
    priority: int = 0,
) -> Request:
    """A ``Request`` from one trace row (validated first if raw); arrival defaults to its ``timestamp`` (ms) in ns.

    Multi-turn ``delay`` records need the caller to resolve their absolute time.
    """
    if not isinstance(record, MooncakeRow):
        try:
            record = mooncake_row(record, trace_block_size)
        except InvalidArgument as exc:
            raise InvalidArgument(f"trace record {request_id!r}: {exc}", field=exc.field) from None
    if arrival_ns is None:
        if record.timestamp is None:
            raise InvalidArgument(f"trace record {request_id!r}: no timestamp and no arrival_ns given")
        arrival_ns = round(record.timestamp * 1_000_000)
    return Request(
        request_id=request_id,
        token_ids=HashIdTokens(record.hash_ids, record.input_length, trace_block_size),
        max_tokens=record.output_length,
        arrival_ns=arrival_ns,
        priority=priority,
        output_token_ids=record.output_token_ids,
    )


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
