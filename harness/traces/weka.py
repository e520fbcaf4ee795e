"""Weka traces (a ``.json`` object, ``.jsonl`` of objects, or a directory of them), lowered to the graph.

A trace object is one play: ``id``, ``models``, ``block_size``, ``hash_id_scope`` ("local") and ``requests``, a
list of entries tagged ``type``: ``n``/``s`` requests (``t`` seconds, ``model``, ``in``, ``out``, ``hash_ids``,
``api_time`` seconds) and ``subagent`` markers (``t``, ``agent_id``, ``duration_ms``, ``status``: ``completed``
is blocking, ``async_launched`` background, and their own ``requests``).

Lowering (AISimulate's, without its chain detection: kvemu keeps the outer requests as one chain rather than
splitting concurrent worker chains by shared hash prefixes):
- the outer requests form session ``<ns>:session:root``, each waiting for its predecessor's completion plus
  ``t − (pred.t + pred.api_time)``; a sub-agent's requests form ``<ns>:session:subagent:<i>:<agent_id>`` the same way;
- a sub-agent's first request is spawned by the latest outer request before its marker: on its dispatch (delay from
  its ``t``) if the child starts before that request ends, else on its completion; a blocking sub-agent's last
  request joins the first later outer request whose ``t`` is at or after the sub-agent's end (marker +
  ``duration_ms``, else its requests' latest end; an understated ``duration_ms`` is refused);
- every node's ``not_before`` is its ``t`` after the play's first ``t`` (each play starts at 0); delays are clamped at 0;
- nested ``t`` are absolute, unless some child starts before its marker (then all are relative to their marker);
- hash ids are renamed per source file: a full block's id is blake3 of its source id and the file, a partial last
  block or a missing id gets an id of its own request's, so sharing stays within one file.
``<ns>`` is the play's id, ``weka:<blake3(relative path)[:16]>:play:<trace id>``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import blake3

from workers.trace import MAX_TRACE_ROWS

from harness.traces.graph import COMPLETION, DISPATCH, JOIN, SEQUENCE, SPAWN, Dependency, GraphBuilder, Source, \
    TraceGraph
from harness.traces.rows import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, Row, error, json_lines

__all__ = ["load_weka", "MAX_WEKA_BYTES"]

MAX_WEKA_BYTES = 1 << 30
"""Largest single ``.json`` trace object read (1 GiB)."""
_NS_PER_S = 1_000_000_000
_EPS_NS = 1_000  # 1e-6 s


class _Req(NamedTuple):
    row: Row
    t: int  # ns
    model: str
    length: int
    output: int
    hashes: list[int]
    api: int | None  # ns


class _Sub(NamedTuple):
    row: Row
    position: int  # its position among the outer entries
    t: int
    agent: str
    duration: int | None  # ns
    blocking: bool
    requests: list[_Req]


def _objects(path: Path, max_rows: int) -> Iterator[tuple[str, Row]]:
    """(relative path, trace object) of a file or, recursively in sorted order, a directory (no symlinks)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".json", ".jsonl") or p.is_symlink())
        for f in files:
            if f.is_symlink():
                raise error(str(f), 1, "path", "is a symbolic link; a Weka directory is read without following "
                                               "links (copy the file in)")
            if f.is_file():
                yield from _file(f, f.relative_to(path).as_posix(), max_rows)
        return
    yield from _file(path, path.name, max_rows)


def _file(path: Path, rel: str, max_rows: int) -> Iterator[tuple[str, Row]]:
    if path.suffix == ".json":
        if path.stat().st_size > MAX_WEKA_BYTES:
            raise error(str(path), 1, "requests", f"the file is larger than {MAX_WEKA_BYTES:,} bytes")
        try:
            data = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise error(str(path), getattr(exc, "lineno", 1), "id", f"not a JSON object ({exc})") from None
        if not isinstance(data, dict):
            raise error(str(path), 1, "id", f"a .json Weka file holds one trace object, got {type(data).__name__}")
        yield rel, Row(str(path), 1, data)
        return
    for row in json_lines(path, max_rows=max_rows, what="Weka trace object"):
        yield rel, row


def _request(row: Row, models: set[str]) -> _Req:
    model = row.string("model")
    if model not in models:
        raise row.error("model", f"{model!r} is not in the trace's models; list it there")
    length = row.integer("in", low=1, high=MAX_PROMPT_TOKENS)
    api = row.seconds("api_time", default_ns=-1)
    return _Req(row, row.seconds("t", required=True), model, length, row.integer("out", high=MAX_OUTPUT_TOKENS),
                row.hash_ids("hash_ids", required=False), None if api < 0 else api)


def _entries(obj: Row) -> tuple[list[_Req | _Sub], int, str]:
    """The trace's outer entries, its block size and its id (every field checked)."""
    trace_id = obj.string("id")
    block = obj.integer("block_size", low=1, high=MAX_PROMPT_TOKENS)
    scope = obj.data.get("hash_id_scope")
    if scope != "local":
        raise obj.error("hash_id_scope", f"must be 'local' (ids comparable within one trace), got {scope!r}")
    models = obj.items("models", required=True)
    if not all(isinstance(m, str) and m for m in models):
        raise obj.error("models", "must be a list of non-empty model names")
    names = set(models)
    out: list[_Req | _Sub] = []
    for i, e in enumerate(obj.objects("requests", required=True)):
        kind = e.data.get("type")
        if kind in ("n", "s"):
            out.append(_request(e, names))
        elif kind == "subagent":
            status = e.data.get("status")
            if status not in ("completed", "async_launched"):
                raise e.error("status", f"must be 'completed' (blocking) or 'async_launched' (background), got "
                                        f"{status!r}")
            reqs = []
            for c in e.objects("requests"):
                if c.data.get("type") not in ("n", "s"):
                    raise c.error("type", f"a sub-agent holds 'n' or 's' requests, got {c.data.get('type')!r}")
                reqs.append(_request(c, names))
            if status == "completed" and not reqs:
                raise e.error("requests", "a blocking sub-agent (status 'completed') has no requests")
            dur = e.integer("duration_ms", high=1 << 53, required=False, default=-1)
            out.append(_Sub(e, i, e.seconds("t", required=True), e.string("agent_id"),
                            None if dur < 0 else dur * 1_000_000, status == "completed", reqs))
        else:
            raise e.error("type", f"must be 'n', 's' or 'subagent', got {kind!r}")
    return out, block, trace_id


def _hashes(rel: str, req: _Req, rid: str, block: int) -> list[int]:
    """The request's hash ids renamed (see the module doc): one per block of its prompt."""
    blocks = -(-req.length // block)
    full = req.length // block
    out = []
    for k in range(blocks):
        if k < full and k < len(req.hashes):
            key = f"source:{rel}:{req.hashes[k]}"
        else:
            key = f"private:{rel}:{rid}:{k}"
        out.append(int.from_bytes(blake3.blake3(b"weka-full-block" + key.encode()).digest()[:8], "little"))
    return out


def load_weka(path: Path, block_size: int | None = None, *, max_rows: int = MAX_TRACE_ROWS) -> TraceGraph:
    """A Weka file or directory as a graph (see the module doc); one block size for the whole corpus."""
    corpus = [(rel, obj, *_entries(obj)) for rel, obj in _objects(path, max_rows)]
    if not corpus:
        raise error(str(path), 1, "requests", "no Weka trace object found")
    size = corpus[0][3]
    for rel, obj, _, block, _ in corpus:
        if block != size or (block_size is not None and block != block_size):
            other = f"the corpus has {size}" if block != size else f"{block_size} was given"
            raise obj.error("block_size", f"is {block}, but {other}; one block size per corpus")
    relative = any(c.t < s.t - _EPS_NS for _, _, entries, _, _ in corpus for s in entries if isinstance(s, _Sub)
                   for c in s.requests)
    digest = blake3.blake3()
    for rel, obj, *_ in corpus:
        digest.update(json.dumps(obj.data, sort_keys=True).encode())
    digest.update(b"relative" if relative else b"absolute")
    b = GraphBuilder(size, str(path), Source("weka", digest.hexdigest()))
    for rel, obj, entries, block, trace_id in corpus:
        _lower(b, rel, obj, entries, block, trace_id, relative)
    return b.finish()


def _lower(b: GraphBuilder, rel: str, obj: Row, entries: list[_Req | _Sub], block: int, trace_id: str,
           relative: bool) -> None:
    play = ns = f"weka:{blake3.blake3(rel.encode()).hexdigest()[:16]}:play:{trace_id}"

    def when(s: _Sub, c: _Req) -> int:
        return s.t + c.t if relative else c.t

    times = [e.t for e in entries if isinstance(e, _Req)] + [when(e, c) for e in entries if isinstance(e, _Sub)
                                                              for c in e.requests]
    if not times:
        raise obj.error("requests", "the trace has no requests")
    origin = min(times)
    outer = [(i, e) for i, e in enumerate(entries) if isinstance(e, _Req)]
    root_session = f"{ns}:session:root"

    def end(t: int, r: _Req) -> int:
        return t + (r.api or 0)

    def add(rid: str, session: str, r: _Req, t: int, deps: list[Dependency]) -> None:
        b.add(rid, play, session, r.model, _hashes(rel, r, rid, block), r.length, r.output, t - origin, r.row.line,
              deps, api_time_ns=r.api, id_field=r.row.name("t"))

    prev: tuple[str, int, _Req] | None = None
    joins: dict[int, list[Dependency]] = {}  # outer entry index → join edges into it
    subs = [e for e in entries if isinstance(e, _Sub)]
    for s in subs:
        if not s.requests:
            continue
        last_t = when(s, s.requests[-1])
        tail_end = max(end(when(s, c), c) for c in s.requests)
        if s.duration is not None and s.t + s.duration < tail_end - _EPS_NS:
            raise s.row.error("duration_ms", f"says the sub-agent ended {s.duration / 1e6:g} ms after its marker, "
                                             f"but its requests run until {(tail_end - s.t) / 1e6:g} ms; fix it or "
                                             "drop it")
        if s.blocking:
            done = s.t + s.duration if s.duration is not None else tail_end
            target = next((i for i, e in outer if i > s.position and e.t >= done - _EPS_NS), None)
            if target is not None:
                tail = f"{ns}:request:outer:{s.position}:inner:{len(s.requests) - 1}"
                last = s.requests[-1]
                joins.setdefault(target, []).append(Dependency(
                    tail, COMPLETION, JOIN, max(0, entries[target].t - end(last_t, last)), s.row.name("status")))
    # outer chain, then each sub-agent's chain (ids referenced before their node are resolved at finish)
    for i, r in outer:
        rid = f"{ns}:request:outer:{i}"
        deps = [] if prev is None else [Dependency(prev[0], COMPLETION, SEQUENCE, max(0, r.t - end(prev[1], prev[2])),
                                                   r.row.name("t"))]
        add(rid, root_session, r, r.t, deps + joins.get(i, []))
        prev = (rid, r.t, r)
    for s in subs:
        session = f"{ns}:session:subagent:{s.position}:{s.agent}"
        owner = None
        for i, r in outer:
            if i < s.position and r.t <= s.t + _EPS_NS:
                owner = (i, r)
        before: tuple[str, int, _Req] | None = None
        for j, c in enumerate(s.requests):
            t = when(s, c)
            rid = f"{ns}:request:outer:{s.position}:inner:{j}"
            chain: list[Dependency] = []
            if before is not None:
                chain.append(Dependency(before[0], COMPLETION, SEQUENCE, max(0, t - end(before[1], before[2])),
                                       c.row.name("t")))
            elif owner is not None:
                oi, o = owner
                dispatch = t < end(o.t, o)
                chain.append(Dependency(f"{ns}:request:outer:{oi}", DISPATCH if dispatch else COMPLETION, SPAWN,
                                       max(0, t - (o.t if dispatch else end(o.t, o))), s.row.name("t")))
            add(rid, session, c, t, chain)
            before = (rid, t, c)

