"""``kvemu trace validate|convert`` and a scenario's trace formats, as a user runs them."""

from __future__ import annotations

from pathlib import Path

from harness.scenario import parse_scenario
from harness.workload.traces.formats import load_graph
from harness.workload.traces.graph import TraceGraph
from harness.workload.build import build_sessions

from tests.harness.test_cli import kvemu
from tests.harness.trace_files import HEADER, v2_row, weka_trace, write


def graph_file(tmp_path: Path) -> Path:
    return write(tmp_path / "g.jsonl", [HEADER,
        v2_row("p0"),
        v2_row("c0", ("p0", "dispatch", "spawn", 5), session="child"),
        v2_row("p1", ("p0", "completion", "sequence", 1), ("c0", "completion", "join", 3)),
        v2_row("q0", play="q", at=7000)])


def test_validate_prints_requests_edges_sessions_and_plays(tmp_path):
    proc = kvemu("trace", "validate", str(graph_file(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (f"ok: {tmp_path / 'g.jsonl'}: agentic_mooncake, 4 requests, 3 edges, 2 roots, "
                                   "3 sessions, 2 plays, block size 4")


def test_a_bad_file_is_refused_naming_file_line_and_field_without_a_traceback(tmp_path):
    path = write(tmp_path / "bad.jsonl", [HEADER, v2_row("a"), v2_row("b", ("a", "dispatch", "join", 0))])
    proc = kvemu("trace", "validate", str(path))
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"invalid: {path}:3: dependencies[0].trigger: a join edge needs trigger")
    assert "Traceback" not in proc.stderr


def test_convert_refuses_a_lossy_conversion_and_says_what_would_be_lost(tmp_path):
    out = tmp_path / "m.jsonl"
    proc = kvemu("trace", "convert", str(graph_file(tmp_path)), str(out), "--to", "mooncake")
    assert proc.returncode == 2 and not out.exists()
    assert "would replay differently" in proc.stderr and "spawn, join" in proc.stderr
    assert "--allow-lossy" in proc.stderr
    proc = kvemu("trace", "convert", str(graph_file(tmp_path)), str(out), "--to", "mooncake", "--allow-lossy")
    assert proc.returncode == 0, proc.stderr
    assert "dropped: 2 requests with dependencies other than the previous turn" in proc.stderr
    chains = load_graph(out, "mooncake", 4)
    assert "dropped: 1 session names used in several plays" in proc.stderr
    assert [n.request_id for n in chains.nodes()] == ["p:s-t0", "child-t0", "p:s-t1", "q:s-t0"]
    assert [n.not_before_ns for n in chains.nodes()] == [0, 5_000_000, 0, 7_000_000_000]


def test_convert_writes_a_weka_corpus_as_v2_and_back_to_the_same_graph(tmp_path):
    src = write(tmp_path / "w.jsonl", [weka_trace("p1")])
    out = tmp_path / "v2.jsonl"
    proc = kvemu("trace", "convert", str(src), str(out), "--to", "agentic_mooncake", "--from", "weka")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out}: 4 rows as agentic_mooncake (read weka, 3 requests")
    assert load_graph(out) == load_graph(src)


def test_convert_refuses_a_format_it_cannot_write(tmp_path):
    proc = kvemu("trace", "convert", str(graph_file(tmp_path)), str(tmp_path / "o"), "--to", "weka")
    assert proc.returncode == 2 and "invalid choice: 'weka'" in proc.stderr


def scenario(tmp_path: Path, workload: str, run: str = "") -> str:
    return f"name: t\ncluster:\n  workers: 2\nworkload:\n  kind: trace\n{workload}run:\n  mode: virtual\n{run}"


def test_a_scenario_detects_a_graph_trace_and_validate_counts_its_plays(tmp_path):
    graph_file(tmp_path)
    (tmp_path / "s.yaml").write_text(scenario(tmp_path, "  trace: g.jsonl\n"))
    proc = kvemu("validate", str(tmp_path / "s.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert "2 plays of 3 sessions, 4 requests (3 dependencies)" in proc.stdout


def test_a_scenario_block_size_must_agree_with_the_trace(tmp_path):
    graph_file(tmp_path)
    (tmp_path / "s.yaml").write_text(scenario(tmp_path, "  trace: g.jsonl\n  trace_block_size: 16\n"))
    proc = kvemu("validate", str(tmp_path / "s.yaml"))
    assert proc.returncode == 2
    assert f"{tmp_path / 'g.jsonl'}:1: block_size: the header says 4" in proc.stderr


def test_a_graph_is_cut_by_duration_at_whole_plays_and_by_max_requests_at_nodes(tmp_path):
    graph_file(tmp_path)
    cut = build_sessions(parse_scenario(scenario(tmp_path, "  trace: g.jsonl\n", "  duration_s: 5\n"),
                                        base_dir=tmp_path))
    assert isinstance(cut, TraceGraph) and cut.plays == ["p"] and len(cut) == 3
    cut = build_sessions(parse_scenario(scenario(tmp_path, "  trace: g.jsonl\n  arrival_speedup_ratio: 2\n",
                                                 "  max_requests: 2\n"), base_dir=tmp_path))
    assert isinstance(cut, TraceGraph) and [n.request_id for n in cut.nodes()] == ["p0", "c0"]
    assert [e.delay_ns for e in cut.edges(1)] == [2_500_000]  # 5 ms, twice as fast
