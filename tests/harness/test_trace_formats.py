"""Every trace format loads into the common graph, and round-trips: load → convert → load gives an equal graph."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvemu.errors import InvalidArgument
from harness.workload.traces.convert import convert_trace
from harness.workload.traces.formats import detect_format, load_graph
from harness.workload.traces.graph import COMPLETION, DISPATCH, JOIN, SEQUENCE, SPAWN, Edge, TraceGraph

from tests.harness.trace_files import (HEADER, applied_row, dynamo_end, dynamo_tool, legacy_row, v2_row, weka_request,
                                       weka_trace, write)

MS = 1_000_000


def roundtrip(g: TraceGraph, tmp_path: Path, fmt: str) -> TraceGraph:
    """``g`` written as ``fmt`` and read back (with ``g``'s block size where the format does not say it)."""
    out = tmp_path / f"roundtrip.{fmt}.jsonl"
    convert_trace(g, out, fmt)
    return load_graph(out, fmt, g.block_size)


def by_id(g: TraceGraph) -> dict[str, tuple]:
    return {n.request_id: n for n in g.nodes()}


# ------------------------------------------------------------------------------------- mooncake


def mooncake_file(tmp_path: Path) -> Path:
    return write(tmp_path / "m.jsonl", [
        {"timestamp": 100, "session_id": "a", "input_length": 8, "output_length": 3, "hash_ids": [1, 2]},
        {"timestamp": 150, "input_length": 4, "output_length": 1, "hash_ids": [9]},
        {"delay": 2000, "session_id": "a", "input_length": 12, "output_length": 3, "hash_ids": [1, 2, 3]},
    ])


def test_mooncake_sessions_are_chains_of_completion_edges(tmp_path):
    g = load_graph(mooncake_file(tmp_path), "mooncake", 4)
    nodes = by_id(g)
    assert list(nodes) == ["a-t0", "trace-2-t0", "a-t1"]
    assert nodes["a-t0"].not_before_ns == 100 * MS and nodes["trace-2-t0"].not_before_ns == 150 * MS
    assert nodes["a-t1"].edges == (Edge(0, COMPLETION, SEQUENCE, 2000 * MS),)
    assert nodes["a-t1"].play == nodes["a-t1"].session == "a"
    assert len(g.plays) == 2 and g.edge_count() == 1


@pytest.mark.parametrize("fmt", ["mooncake", "agentic_mooncake"])
def test_mooncake_round_trips(tmp_path, fmt):
    g = load_graph(mooncake_file(tmp_path), "mooncake", 4)
    assert roundtrip(g, tmp_path, fmt) == g


def test_mooncake_as_legacy_rows_keeps_all_but_play_names(tmp_path):
    g = load_graph(mooncake_file(tmp_path), "mooncake", 4)
    back = roundtrip(g, tmp_path, "agentic_mooncake_legacy")
    assert [n._replace(play="") for n in back.nodes()] == [n._replace(play="") for n in g.nodes()]
    assert back.plays == ["legacy-play:a-t0", "legacy-play:trace-2-t0"]


def test_mooncake_delta_prompts_accumulate_and_round_trip(tmp_path):
    path = write(tmp_path / "d.jsonl", [
        {"timestamp": 0, "session_id": "a", "input_length": 8, "output_length": 3, "hash_ids": [1, 2]},
        {"delay": 5, "session_id": "a", "input_length": 4, "output_length": 3, "hash_ids": [3]},
        {"delay": 5, "session_id": "a", "input_length": 6, "output_length": 3, "hash_ids": [4, 5]},
    ])
    g = load_graph(path, "mooncake-delta", 4)
    assert [list(n.hash_ids) for n in g.nodes()] == [[1, 2], [1, 2, 3], [1, 2, 3, 4, 5]]
    assert [n.input_length for n in g.nodes()] == [8, 12, 18]
    assert roundtrip(g, tmp_path, "mooncake-delta") == g
    assert roundtrip(g, tmp_path, "agentic_mooncake") == g


# ------------------------------------------------------------------------------------- agentic mooncake


def v2_file(tmp_path: Path) -> Path:
    """A play with a parent session, a sub-agent spawned on dispatch, joined back, and a second play."""
    return write(tmp_path / "v2.jsonl", [HEADER,
        v2_row("p0"),
        v2_row("c0", ("p0", "dispatch", "spawn", 100), session="child", ids=(1, 3)),
        v2_row("c1", ("c0", "completion", "sequence", 5), session="child", isl=12, ids=(1, 3, 4)),
        v2_row("p1", ("p0", "completion", "sequence", 10), ("c1", "completion", "join", 20), isl=12, ids=(1, 2, 5),
               recorded_api_time_ms=1.5, output_token_ids=[7, 8]),
        v2_row("q0", play="q", session="s", at=250.5),
    ])


def test_v2_reads_typed_dependencies_plays_and_sessions(tmp_path):
    g = load_graph(v2_file(tmp_path))
    assert g.block_size == 4 and g.source.format == "test"
    n = by_id(g)
    assert n["c0"].edges == (Edge(0, DISPATCH, SPAWN, 100 * MS),)
    assert n["p1"].edges == (Edge(0, COMPLETION, SEQUENCE, 10 * MS), Edge(2, COMPLETION, JOIN, 20 * MS))
    assert n["p1"].api_time_ns == 1_500_000 and n["p1"].output_token_ids == (7, 8)
    assert n["q0"].not_before_ns == 250_500_000
    assert g.plays == ["p", "q"] and g.sessions == ["s", "child", "s"]  # a session is per play
    assert list(g.roots()) == [0, 4]


def test_v2_round_trips(tmp_path):
    g = load_graph(v2_file(tmp_path))
    assert roundtrip(g, tmp_path, "agentic_mooncake") == g


def test_legacy_wait_for_rows_become_completion_edges_in_component_plays(tmp_path):
    path = write(tmp_path / "l.jsonl", [
        legacy_row("a", timestamp=10),
        legacy_row("b", "a", delay=5, tool_wait_ms=7),
        legacy_row("c", "a", "b", delay_ms=1),
        legacy_row("z", session="other", created_time=3),
    ])
    assert detect_format(path) == "mooncake"  # (its first row has no wait_for: name the format)
    g = load_graph(path, "agentic_mooncake", 4)
    n = by_id(g)
    assert n["b"].edges == (Edge(0, COMPLETION, SEQUENCE, 12 * MS),)
    assert n["c"].edges == (Edge(0, COMPLETION, JOIN, 1 * MS), Edge(1, COMPLETION, JOIN, 1 * MS))
    assert [x.play for x in g.nodes()] == ["legacy-play:a"] * 3 + ["legacy-play:z"]
    assert n["a"].session == "agentic-session" and n["z"].not_before_ns == 3 * MS
    assert roundtrip(g, tmp_path, "agentic_mooncake_legacy") == g
    assert roundtrip(g, tmp_path, "agentic_mooncake") == g


# ------------------------------------------------------------------------------------- applied compute


def test_applied_compute_rows_expand_to_growing_turns(tmp_path):
    path = write(tmp_path / "ac.jsonl", [applied_row(turns=2, prompt=10), applied_row(turns=0, prompt=3)])
    assert detect_format(path) == "applied_compute_agentic"
    g = load_graph(path, block_size=4)
    nodes = list(g.nodes())
    assert [x.input_length for x in nodes] == [10, 18, 26, 3]
    assert [x.output_length for x in nodes] == [3, 3, 4, 4]
    assert nodes[1].edges == (Edge(0, COMPLETION, SEQUENCE, 500 * MS),)
    assert nodes[2].hash_ids[:len(nodes[1].hash_ids)] == nodes[1].hash_ids  # each turn extends the last
    assert not set(nodes[3].hash_ids) & set(nodes[2].hash_ids)
    assert nodes[0].session == "applied_compute_agentic_session_1" and len(g.plays) == 2
    assert roundtrip(g, tmp_path, "agentic_mooncake") == g


# ------------------------------------------------------------------------------------- weka


def test_weka_lowers_a_blocking_sub_agent_to_spawn_and_join(tmp_path):
    path = write(tmp_path / "w.jsonl", [weka_trace("p1"), weka_trace("p2", [weka_request(10.0, isl=4, ids=(7,))])])
    assert detect_format(path) == "weka"
    g = load_graph(path)
    nodes = list(g.nodes())
    outer0, outer2, inner, other = nodes
    assert outer0.request_id.endswith(":play:p1:request:outer:0") and inner.request_id.endswith(":outer:1:inner:0")
    assert inner.session.endswith(":session:subagent:1:a") and outer0.session.endswith(":session:root")
    assert inner.edges == (Edge(0, DISPATCH, SPAWN, 600 * MS),)  # starts during outer:0 (ends at 1 s)
    assert outer2.edges == (Edge(0, COMPLETION, SEQUENCE, 2000 * MS), Edge(2, COMPLETION, JOIN, 1900 * MS))
    assert [x.not_before_ns for x in nodes] == [0, 3000 * MS, 600 * MS, 0]  # each play starts at 0
    assert outer0.hash_ids[0] == inner.hash_ids[0] != other.hash_ids[0]  # equal source ids, one file: equal
    assert outer0.api_time_ns == 1_000_000_000
    assert roundtrip(g, tmp_path, "agentic_mooncake") == g


def test_weka_splits_overlapping_requests_into_worker_chains_by_shared_prefix(tmp_path):
    requests = [weka_request(0.0, isl=8, ids=(1, 2), api=1.0),      # the main chain
                weka_request(0.5, isl=8, ids=(1, 5), api=1.0),      # starts while the first runs: a worker
                weka_request(2.0, isl=12, ids=(1, 2, 3), api=1.0),  # extends the main chain's prompt
                weka_request(2.5, isl=12, ids=(1, 5, 6), api=1.0)]  # extends the worker's
    g = load_graph(write(tmp_path / "w.jsonl", [weka_trace("p", requests)]))
    n = list(g.nodes())
    assert [x.session.rsplit(":session:", 1)[1] for x in n] == ["root", "root:worker:1", "root", "root:worker:1"]
    assert n[1].edges == (Edge(0, DISPATCH, SPAWN, 500 * MS),)
    assert n[2].edges == (Edge(0, COMPLETION, SEQUENCE, 1000 * MS),)
    assert n[3].edges == (Edge(1, COMPLETION, SEQUENCE, 1000 * MS),)


def test_weka_reads_a_json_object_and_a_directory_in_sorted_order(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "b.json").write_text(json.dumps(weka_trace("b")))
    (tmp_path / "dir" / "a.json").write_text(json.dumps(weka_trace("a")))
    g = load_graph(tmp_path / "dir")
    assert [p.rsplit(":", 1)[1] for p in g.plays] == ["a", "b"]
    single = load_graph(tmp_path / "dir" / "a.json")
    assert len(single) == 3


def test_weka_relative_child_times_count_from_their_marker(tmp_path):
    sub = {"type": "subagent", "t": 5.0, "agent_id": "x", "status": "async_launched",
           "requests": [weka_request(0.25, api=0.1)]}
    g = load_graph(write(tmp_path / "w.jsonl", [weka_trace("p", [weka_request(4.0, api=2.0), sub])]))
    inner = list(g.nodes())[1]
    assert inner.not_before_ns == 1250 * MS  # 5.25 s - 4 s
    assert inner.edges == (Edge(0, DISPATCH, SPAWN, 1250 * MS),)  # background: no join


# ------------------------------------------------------------------------------------- dynamo


def test_dynamo_standard_requests_are_roots_rebased_to_the_first_start(tmp_path):
    path = write(tmp_path / "d.jsonl", [
        {"event": {"schema": "dynamo.request.trace.v1", "event_type": "request_payload", "event_time_unix_ms": 1}},
        dynamo_end("r2", 1_700_000_000_500, 100),
        dynamo_end("r1", 1_700_000_000_000, 300, ids=(5,), isl=3),
    ])
    assert detect_format(path) == "dynamo"
    g = load_graph(path)
    assert [(n.request_id, n.not_before_ns) for n in g.nodes()] == [("r2", 500 * MS), ("r1", 0)]
    assert g.edge_count() == 0 and g.block_size == 4
    assert roundtrip(g, tmp_path, "agentic_mooncake") == g
    assert roundtrip(g, tmp_path, "mooncake").nodes().__next__().hash_ids == (1, 2)


def test_dynamo_agentic_chains_sessions_and_links_children_by_tool_or_by_time(tmp_path):
    t0 = 1_700_000_000_000
    path = write(tmp_path / "d.jsonl", [
        dynamo_end("p0", t0, 100, session="main"),
        dynamo_end("c0", t0 + 50, 200, session="kid", parent="main"),
        dynamo_end("p1", t0 + 400, 100, session="main"),
        dynamo_end("b0", t0 + 420, 10, session="bg", parent="main"),
        dynamo_end("p2", t0 + 600, 100, session="main"),
        dynamo_tool("p0", "kid", consumer="p1"),
    ])
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    g = load_graph(gz)
    n = by_id(g)
    ids = list(n)
    assert ids == ["p0", "c0", "p1", "b0", "p2"]
    assert n["c0"].edges == (Edge(0, DISPATCH, SPAWN, 50 * MS),)
    assert n["p1"].edges == (Edge(0, COMPLETION, SEQUENCE, 300 * MS), Edge(1, COMPLETION, JOIN, 150 * MS))
    assert n["b0"].edges == (Edge(2, DISPATCH, SPAWN, 20 * MS),)  # no tool event: the latest parent started
    assert n["p2"].edges == (Edge(2, COMPLETION, SEQUENCE, 100 * MS), Edge(3, COMPLETION, JOIN, 170 * MS))
    assert {x.play for x in g.nodes()} == {"dynamo-play:p0"}
    assert roundtrip(g, tmp_path, "agentic_mooncake") == g


def test_a_dynamo_trace_in_shards_reads_as_the_whole(tmp_path):
    t0 = 1_700_000_000_000
    records = [dynamo_end("p0", t0, 100, session="main"), dynamo_end("c0", t0 + 50, 200, session="kid", parent="main"),
               dynamo_end("p1", t0 + 400, 100, session="main")]
    whole = load_graph(write(tmp_path / "whole.jsonl", records))
    (tmp_path / "shards").mkdir()
    write(tmp_path / "shards" / "a.jsonl", records[:1])
    (tmp_path / "shards" / "b.jsonl.gz").write_bytes(gzip.compress(write(tmp_path / "b", records[1:]).read_bytes()))
    assert detect_format(tmp_path / "shards") == "dynamo"
    assert load_graph(tmp_path / "shards") == whole
    write(tmp_path / "shards" / "c.jsonl", [dynamo_end("p0", t0, 1, session="x")])
    with pytest.raises(InvalidArgument, match=r"c.jsonl:1: request.request_id: 'p0' ends twice \(.*a.jsonl:1 too\)"):
        load_graph(tmp_path / "shards")


# ------------------------------------------------------------------------------------- detection


def test_detection_reads_the_first_row_and_falls_back_to_mooncake(tmp_path):
    assert detect_format(v2_file(tmp_path)) == "agentic_mooncake"
    assert detect_format(write(tmp_path / "l.jsonl", [legacy_row("b", "a")])) == "agentic_mooncake_legacy"
    unknown = write(tmp_path / "x.jsonl", [{"hello": 1}])
    assert detect_format(unknown) == "mooncake"  # kvemu's default: its reader then names what is missing
    with pytest.raises(InvalidArgument, match=r"x.jsonl:1: not a Mooncake trace row: missing field 'hash_ids'"):
        load_graph(unknown)


def test_the_scenario_format_names_every_format():
    from typing import get_args, get_type_hints

    from harness.scenario import TraceWorkload
    from harness.workload.traces.names import FORMATS

    assert get_args(get_type_hints(TraceWorkload)["format"]) == ("auto", *FORMATS)
