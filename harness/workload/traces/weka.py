"""Weka traces (a ``.json`` object, ``.jsonl`` of objects, or a directory of them), lowered to the graph.

A trace object is one play: ``id``, ``models``, ``block_size``, ``hash_id_scope`` ("local") and ``requests``, a
list of entries tagged ``type``: ``n``/``s`` requests (``t`` seconds, ``model``, ``in``, ``out``, ``hash_ids``,
``api_time`` seconds) and ``subagent`` markers (``t``, ``agent_id``, ``duration_ms``, ``status``: ``completed``
is blocking, ``async_launched`` background, and their own ``requests``).

Lowering (after AISimulate's, simplified: no preamble split, seam splicing or replay barriers):
- a stream (the outer requests; a sub-agent's requests) splits into chains: a request extends the chain whose
  tail's full blocks prefix its hash ids, of the same model, that ended by its start; else it starts a worker
  chain, spawned by the latest request of the chain it shares the longest prefix with. Each request waits for
  its chain predecessor's completion plus ``t − (pred.t + pred.api_time)``. The outer stream's first chain is
  session ``<ns>:session:root``, a sub-agent's ``<ns>:session:subagent:<i>:<agent_id>``, further chains
  ``<that>:worker:<k>``;
- a sub-agent's first request is spawned by the latest outer request before its marker: on its dispatch (delay from
  its ``t``) if the child starts before that request ends, else on its completion; a blocking sub-agent's last
  request joins the first later outer request whose ``t`` is at or after the sub-agent's end (marker +
  ``duration_ms``, else its requests' latest end; an understated ``duration_ms`` is refused), from the tail of
  each of its chains;
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


from harness.workload.traces.graph import COMPLETION, DISPATCH, JOIN, SEQUENCE, SPAWN, Dependency, GraphBuilder, Source, \
    TraceGraph
from harness.workload.traces.rows import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, MAX_TRACE_ROWS, Row, error, json_lines

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
    for _rel, obj, _, block, _ in corpus:
        if block != size or (block_size is not None and block != block_size):
            other = f"the corpus has {size}" if block != size else f"{block_size} was given"
            raise obj.error("block_size", f"is {block}, but {other}; one block size per corpus")
    relative = any(c.t < s.t - _EPS_NS for _, _, entries, _, _ in corpus for s in entries if isinstance(s, _Sub)
                   for c in s.requests)
    digest = blake3.blake3()
    for _rel, obj, *_ in corpus:
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

    def add(item: _Timed, session: str, deps: list[Dependency]) -> None:
        r = item.req
        b.add(item.rid, play, session, r.model, _hashes(rel, r, item.rid, block), r.length, r.output, item.t - origin,
              r.row.line, deps, api_time_ns=r.api, id_field=r.row.name("t"))

    main = [_Timed(f"{ns}:request:outer:{i}", r.t, r) for i, r in outer]
    main_sessions, main_deps, _ = _streams(main, f"{ns}:session:root", block)
    subs = [e for e in entries if isinstance(e, _Sub)]
    lowered = []
    for s in subs:
        items = [_Timed(f"{ns}:request:outer:{s.position}:inner:{j}", when(s, c), c) for j, c in enumerate(s.requests)]
        sessions, deps, tails = _streams(items, f"{ns}:session:subagent:{s.position}:{s.agent}", block)
        lowered.append((items, sessions, deps))
        if not items:
            continue
        tail_end = max(it.end for it in items)
        if s.duration is not None and s.t + s.duration < tail_end - _EPS_NS:
            raise s.row.error("duration_ms", f"says the sub-agent ended {s.duration / 1e6:g} ms after its marker, "
                                             f"but its requests run until {(tail_end - s.t) / 1e6:g} ms; fix it or "
                                             "drop it")
        owner = None
        for k, (i, r) in enumerate(outer):
            if i < s.position and r.t <= s.t + _EPS_NS:
                owner = main[k]
        if owner is not None:
            deps[0].append(_spawn(owner, items[0], s.row.name("t")))
        if s.blocking:
            done = s.t + s.duration if s.duration is not None else tail_end
            target = next((k for k, (i, r) in enumerate(outer) if i > s.position and r.t >= done - _EPS_NS), None)
            if target is not None:
                t = main[target].t
                main_deps[target] += [Dependency(items[k].rid, COMPLETION, JOIN, max(0, t - items[k].end),
                                                 s.row.name("status")) for k in tails]
    for k, item in enumerate(main):
        add(item, main_sessions[k], main_deps[k])
    for items, sessions, deps in lowered:
        for k, item in enumerate(items):
            add(item, sessions[k], deps[k])


class _Timed(NamedTuple):
    """A request of a stream with its id and its start (ns, on the corpus's time basis)."""

    rid: str
    t: int
    req: _Req

    @property
    def end(self) -> int:
        """When it ended as recorded: its start plus its API time."""
        return self.t + (self.req.api or 0)


def _spawn(parent: _Timed, child: _Timed, field: str) -> Dependency:
    """``child`` started by ``parent``: on its dispatch if the child starts before it ended, else on its end."""
    if child.t < parent.end:
        return Dependency(parent.rid, DISPATCH, SPAWN, max(0, child.t - parent.t), field)
    return Dependency(parent.rid, COMPLETION, SPAWN, max(0, child.t - parent.end), field)


def _streams(items: list[_Timed], session: str, block: int
             ) -> tuple[list[str], list[list[Dependency]], list[int]]:
    """A stream's requests split into chains (each request's session and incoming edges; each chain's tail).

    A request extends the chain whose tail's full blocks prefix its hash ids, of the same model, that ended by
    its start (the longest such tail); else it starts a chain (session ``<session>:worker:<k>``), spawned by
    the latest request, started by then, of the chain it shares the longest prefix with."""
    chains: list[list[int]] = []
    sessions: list[str] = []
    deps: list[list[Dependency]] = []
    for k, it in enumerate(items):
        ids = it.req.hashes
        best, best_len = -1, -1
        for c, chain in enumerate(chains):
            tail = items[chain[-1]]
            full = tail.req.hashes[:tail.req.length // block]
            if (tail.req.model == it.req.model and tail.end <= it.t + _EPS_NS and ids[:len(full)] == full
                    and len(full) > best_len):
                best, best_len = c, len(full)
        field = it.req.row.name("t")
        if best >= 0:
            tail = items[chains[best][-1]]
            deps.append([Dependency(tail.rid, COMPLETION, SEQUENCE, max(0, it.t - tail.end), field)])
            chains[best].append(k)
            sessions.append(session if best == 0 else f"{session}:worker:{best}")
            continue
        mine: list[Dependency] = []
        if chains:
            parent = max(range(len(chains)), key=lambda c: (_common(items[chains[c][-1]].req.hashes, ids), -c))
            started = [j for j in chains[parent] if items[j].t <= it.t + _EPS_NS]
            mine.append(_spawn(items[started[-1] if started else chains[parent][0]], it, field))
        chains.append([k])
        deps.append(mine)
        sessions.append(session if len(chains) == 1 else f"{session}:worker:{len(chains) - 1}")
    return sessions, deps, [chain[-1] for chain in chains]


def _common(a: list[int], b: list[int]) -> int:
    """The length of the common prefix of two hash id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
