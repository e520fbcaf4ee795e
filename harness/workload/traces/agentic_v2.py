"""Agentic Mooncake v2: a header line, then one request node per line with its typed incoming dependencies.

Header: ``{"schema": "dynamo.agentic_mooncake", "version": 2, "block_size": N, "hash_id_scope": "local",
"source": {"format": ..., "digest": ...}}``. A row: ``request_id``, ``play_id``, ``session_id``, ``model``
(non-empty strings), ``input_length``/``output_length`` (aliases ``input_tokens``/``output_tokens``),
``hash_ids`` (exactly ceil(input_length / block_size)), ``not_before_ms``, optional ``dependencies``
``[{request_id, trigger: dispatch|completion, delay_ms, relation: sequence|spawn|join|replay_barrier}]``,
``recorded_api_time_ms``, ``output_token_ids``, ``source_play_ordinal``. Times are milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any


from harness.workload.traces.graph import ALLOWED, RELATIONS, TRIGGERS, Dependency, GraphBuilder, Source, TraceGraph
from harness.workload.traces.rows import MAX_PROMPT_TOKENS, MAX_TRACE_ROWS, Row, check_capacity, json_lines, ns_to_ms

__all__ = ["SCHEMA", "VERSION", "is_header", "load_agentic_v2", "v2_rows"]

SCHEMA = "dynamo.agentic_mooncake"
VERSION = 2


def is_header(data: dict[str, Any]) -> bool:
    """Whether a decoded first line is an Agentic Mooncake header (of any version)."""
    return data.get("schema") == SCHEMA


def _header(row: Row, block_size: int | None) -> tuple[int, Source]:
    if not is_header(dict(row.data)):
        raise row.error("schema", f"the file is missing its v2 header (a first line with schema {SCHEMA!r}); "
                                  "a file of request rows without one is the legacy agentic_mooncake format")
    version = row.data.get("version")
    if version != VERSION or type(version) is not int:
        raise row.error("version", f"must be {VERSION}, got {version!r}; kvemu reads Agentic Mooncake v2")
    size = row.integer("block_size", low=1, high=MAX_PROMPT_TOKENS)
    if block_size is not None and block_size != size:
        raise row.error("block_size", f"the header says {size} tokens per hash id, but {block_size} was given "
                                      "(trace_block_size / --block-size); drop that or make them equal")
    scope = row.data.get("hash_id_scope")
    if scope != "local":
        raise row.error("hash_id_scope", f"must be 'local' (the only scope), got {scope!r}")
    src = row.sub("source", required=True)
    assert src is not None
    return size, Source(src.string("format"), src.string("digest"))


def _dependencies(row: Row) -> list[Dependency]:
    deps = []
    for d in row.objects("dependencies"):
        trigger = d.data.get("trigger")
        relation = d.data.get("relation")
        if trigger not in TRIGGERS:
            raise d.error("trigger", f"must be 'dispatch' or 'completion', got {trigger!r}")
        if relation not in RELATIONS:
            raise d.error("relation", f"must be one of {', '.join(RELATIONS)}, got {relation!r}")
        t, r = TRIGGERS.index(trigger), RELATIONS.index(relation)
        if (r, t) not in ALLOWED:
            raise d.error("trigger", f"a {relation} edge needs trigger 'completion' (only spawn may use "
                                     "'dispatch')")
        deps.append(Dependency(d.string("request_id"), t, r, d.ms("delay_ms", required=True),
                               d.name("request_id")))
    return deps


def load_agentic_v2(path: Path, block_size: int | None = None, *, max_rows: int = MAX_TRACE_ROWS) -> TraceGraph:
    """An Agentic Mooncake v2 file as a graph (its header's block size; ``block_size``, if given, must agree)."""
    rows = json_lines(path, max_rows=max_rows + 1)
    first = next(rows, None)
    if first is None:
        raise Row(str(path), 1, {}).error("schema", "the file is empty; it needs a v2 header and request rows")
    size, source = _header(first, block_size)
    b = GraphBuilder(size, str(path), source)
    ordinals: dict[str, int] = {}
    with_ordinal = None
    for row in rows:
        if is_header(dict(row.data)):
            raise row.error("schema", "a second header; a file holds one trace")
        rid = row.string("request_id")
        play = row.string("play_id")
        length = row.input_length()
        out = row.output_length()
        ids = row.hash_ids()
        check_capacity(row, ids, length, size, exact=True)
        has = row.has("source_play_ordinal")
        if with_ordinal is None:
            with_ordinal = has
        elif has != with_ordinal:
            raise row.error("source_play_ordinal", "set on some rows and not on others; give it on every row or "
                                                   "on none")
        if has:
            k = row.integer("source_play_ordinal", high=MAX_TRACE_ROWS)
            if ordinals.setdefault(play, k) != k:
                raise row.error("source_play_ordinal", f"is {k} but play {play!r} had {ordinals[play]}; one "
                                                       "ordinal per play")
        api = row.ms("recorded_api_time_ms", default_ns=-1)
        b.add(rid, play, row.string("session_id"), row.string("model"), ids, length, out,
              row.ms("not_before_ms", required=True), row.line, _dependencies(row),
              output_token_ids=row.token_ids("output_token_ids", out), api_time_ns=None if api < 0 else api)
    if not len(b):
        raise Row(str(path), first.line, {}).error("request_id", "the file has a header but no request rows")
    if ordinals and sorted(ordinals.values()) != list(range(len(ordinals))):
        raise Row(str(path), first.line, {}).error(
            "source_play_ordinal", f"the plays' ordinals must be 0..{len(ordinals) - 1}, each once; got "
                                   f"{sorted(ordinals.values())[:10]}")
    return b.finish()


def v2_rows(g: TraceGraph) -> Iterator[dict[str, Any]]:
    """The header, then each node as a v2 row (the prompt cut to the hash ids it uses, as v2 requires)."""
    yield {"schema": SCHEMA, "version": VERSION, "block_size": g.block_size, "hash_id_scope": "local",
           "source": {"format": g.source.format, "digest": g.source.digest or "unknown"}}
    bs = g.block_size
    for n in g.nodes():
        length = min(n.input_length, len(n.hash_ids) * bs)
        row: dict[str, Any] = {"request_id": n.request_id, "play_id": n.play, "session_id": n.session,
                               "model": n.model, "input_length": length, "output_length": n.output_length,
                               "hash_ids": list(n.hash_ids[:-(-length // bs)]),
                               "not_before_ms": ns_to_ms(n.not_before_ns)}
        if n.edges:
            row["dependencies"] = [{"request_id": g.request_id(e.source), "trigger": TRIGGERS[e.trigger],
                                    "delay_ms": ns_to_ms(e.delay_ns), "relation": RELATIONS[e.relation]}
                                   for e in n.edges]
        if n.api_time_ns is not None:
            row["recorded_api_time_ms"] = ns_to_ms(n.api_time_ns)
        if n.output_token_ids is not None:
            row["output_token_ids"] = list(n.output_token_ids)
        yield row
