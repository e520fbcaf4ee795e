"""Graph traces replay in virtual time: each request goes when its edges say, against a tiny reference model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu.clock import ManualClock
from kvemu.runtime.loop import run_virtual

from harness.workload.sessions import GraphPlayer
from harness.workload.traces.convert import convert_trace
from harness.workload.traces.formats import load_graph
from harness.workload.traces.graph import TraceGraph
from harness.workload.traces.timing import release_times

from tests.harness.trace_files import HEADER, v2_row, write

MS = 1_000_000
ROOT = Path(__file__).resolve().parents[2]


def play(g: TraceGraph, service_ms, concurrency: int | None = None) -> dict[str, tuple[int, str | None]]:
    """Request id → (arrival ns, session id) when request ``rid`` takes ``service_ms(rid)`` ms."""
    clock = ManualClock()
    log: dict[str, tuple[int, str | None]] = {}

    def submit(req, on_end):
        log[req.request_id] = (clock.now_ns(), req.session_id)
        asyncio.get_running_loop().call_at_ns(clock.now_ns() + service_ms(req.request_id) * MS, on_end, None)

    async def main() -> None:
        await GraphPlayer(g, submit, clock, concurrency=concurrency).run()

    run_virtual(main, clock)
    return log


def spawn_join_graph(tmp_path: Path) -> TraceGraph:
    """A parent turn spawns a sub-agent 5 ms after it was sent; the parent's next turn joins the sub-agent."""
    return load_graph(write(tmp_path / "g.jsonl", [HEADER,
        v2_row("p0", at=10),
        v2_row("c0", ("p0", "dispatch", "spawn", 5), session="child"),
        v2_row("c1", ("c0", "completion", "sequence", 2), session="child"),
        v2_row("p1", ("p0", "completion", "sequence", 1), ("c1", "completion", "join", 3)),
        v2_row("p2", ("p1", "completion", "sequence", 0), at=500),  # its floor is later than its edge
        v2_row("q0", play="q", session="other", at=0),
    ]))


def test_a_spawn_and_a_join_release_requests_as_the_edges_say(tmp_path):
    g = spawn_join_graph(tmp_path)
    log = play(g, lambda rid: 20)
    assert log == {
        "q0": (0, "other"),
        "p0": (10 * MS, "s"),
        "c0": (15 * MS, "child"),      # p0 sent at 10, + 5 (dispatch)
        "c1": (37 * MS, "child"),      # c0 ended at 35, + 2
        "p1": (60 * MS, "s"),          # p0 ended at 30 + 1 = 31; c1 ended at 57 + 3 = 60: the later one
        "p2": (500 * MS, "s"),         # p1 ended at 80, but not before 500
    }
    assert [log[g.request_id(i)][0] for i in range(len(g))] == list(release_times(g, lambda i: 20 * MS))


def test_a_closed_loop_plays_one_play_at_a_time_with_its_own_times(tmp_path):
    g = spawn_join_graph(tmp_path)
    log = play(g, lambda rid: 20, concurrency=1)
    assert log["q0"][0] == 0  # q starts first (its first root is the earliest)
    # p starts when q ended (20 ms); its times count from its first root (10 ms): p0 at 20 ms
    assert log["p0"][0] == 20 * MS and log["c0"][0] == 25 * MS and log["p2"][0] == 510 * MS


def test_plays_that_share_a_session_name_keep_their_own_affinity_keys(tmp_path):
    g = load_graph(write(tmp_path / "g.jsonl", [HEADER, v2_row("a0", play="a", session="agent"),
                                                 v2_row("b0", play="b", session="agent"),
                                                 v2_row("b1", play="b", session="solo")]))
    log = play(g, lambda rid: 1)
    assert {rid: sid for rid, (_, sid) in log.items()} == {"a0": "a:agent", "b0": "b:agent", "b1": "solo"}


@st.composite
def dags(draw) -> list[dict]:
    """v2 rows of a random DAG in one play (edges from earlier rows), sessions, triggers, delays and floors."""
    n = draw(st.integers(1, 10))
    rows = []
    for i in range(n):
        deps = []
        if i:
            for j in sorted(draw(st.sets(st.integers(0, i - 1), max_size=3))):
                trigger = draw(st.sampled_from(["dispatch", "completion"]))
                relation = "spawn" if trigger == "dispatch" else draw(
                    st.sampled_from(["sequence", "spawn", "join", "replay_barrier"]))
                deps.append((f"n{j}", trigger, relation, draw(st.integers(0, 40)) / 2))
        at = draw(st.integers(0, 60)) if not deps or draw(st.booleans()) else 0
        rows.append(v2_row(f"n{i}", *deps, session=f"s{draw(st.integers(0, 2))}", at=at))
    return rows


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=dags())
def test_replay_matches_the_reference_model_and_v2_round_trips(tmp_path, rows):
    g = load_graph(write(tmp_path / "dag.jsonl", [HEADER, *rows]))
    service = {g.request_id(i): 1 + (i * 7) % 13 for i in range(len(g))}
    log = play(g, service.__getitem__)
    expected = release_times(g, lambda i: service[g.request_id(i)] * MS)
    assert [log[g.request_id(i)][0] for i in range(len(g))] == list(expected)
    out = tmp_path / "back.jsonl"
    convert_trace(g, out, "agentic_mooncake")
    assert load_graph(out) == g


@st.composite
def chains(draw) -> list[dict]:
    """Mooncake rows: sessions of turns, each turn's prompt a random list of hash ids."""
    rows = []
    for s in range(draw(st.integers(1, 4))):
        for k in range(draw(st.integers(1, 4))):
            ids = draw(st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=4))
            row = {"session_id": f"s{s}", "input_length": len(ids) * 4, "output_length": draw(st.integers(1, 9)),
                   "hash_ids": ids}
            row["timestamp" if k == 0 else "delay"] = draw(st.integers(0, 10_000)) / 4
            rows.append(row)
    return rows


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=chains())
def test_random_chains_round_trip_through_every_writable_format(tmp_path, rows):
    g = load_graph(write(tmp_path / "m.jsonl", rows), "mooncake", 4)
    for fmt in ("mooncake", "agentic_mooncake"):
        out = tmp_path / f"back.{fmt}"
        convert_trace(g, out, fmt)
        assert load_graph(out, fmt, 4) == g, fmt


def test_a_scenario_replays_a_v2_trace_with_arrivals_as_its_edges_say(tmp_path):
    write(tmp_path / "g.jsonl", [HEADER,
        v2_row("p0"),
        v2_row("c0", ("p0", "dispatch", "spawn", 5), session="child"),
        v2_row("p1", ("p0", "completion", "sequence", 1.5), ("c0", "completion", "join", 3)),
    ])
    (tmp_path / "s.yaml").write_text("name: g\ncluster:\n  workers: 2\nworkload:\n  kind: trace\n  trace: g.jsonl\n")
    run = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(tmp_path / "s.yaml"), "--quiet", "-o",
                          str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    records = {r["request_id"]: r for r in map(json.loads, (tmp_path / "out" / "requests.jsonl").open())}
    p0, c0, p1 = records["p0"], records["c0"], records["p1"]
    assert all(r["failure"] is None for r in records.values())
    assert p0["arrival_ns"] == 0 and c0["arrival_ns"] == 5 * MS
    assert p1["arrival_ns"] == max(p0["completion_ns"] + 1_500_000, c0["completion_ns"] + 3 * MS)
    assert (p0["session_id"], c0["session_id"], p1["session_id"]) == ("s", "child", "s")
