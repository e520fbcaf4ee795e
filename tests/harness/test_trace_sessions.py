"""A loaded trace kept column-wise (``TraceSessions``): the same sessions a list of them held, compact, lazy."""

from __future__ import annotations

import asyncio
import json
from array import array
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu.clock import NS_PER_MS, ManualClock
from kvemu.runtime.loop import run_virtual
from harness.workload.traces.mooncake import read_mooncake

from harness.run.runner import count_requests
from harness.scenario import TraceWorkload, parse_scenario
from harness.workload.sessions import SessionPlayer, drain_deadline_s
from harness.workload.synthetic_trace import write_synthetic_trace
from harness.workload.trace_sessions import TraceSessions, start_times, turn_count
from harness.workload.turns import Session, SessionList, Turn
from harness.workload import build_sessions, load_trace

MS = NS_PER_MS


def reference(w: TraceWorkload, path: Path, max_requests: int | None = None) -> list[Session]:
    """The simple model: a list of ``Session``s built row by row, sorted stably by start."""
    block, speed = w.trace_block_size, w.arrival_speedup_ratio
    named: dict[str, Session] = {}
    ends: dict[str, int] = {}
    order: list[Session] = []
    last_ts = 0.0
    for lineno, row in read_mooncake(path, max_requests, block):
        prompt = min(row.input_length, len(row.hash_ids) * block)
        ids = array("I", [h & 0xFFFFFFFF for h in row.hash_ids[:-(-prompt // block)]])
        turn = Turn(None, row.output_length, 0, hash_ids=ids, input_length=row.input_length, trace_block_size=block)
        sid = row.session_id
        if row.timestamp is not None:
            last_ts = row.timestamp
        if sid is not None and sid in named:
            delay_ns = round((row.delay or 0.0) * MS / speed)
            ends[sid] += delay_ns
            named[sid].turns.append(turn._replace(delay_ns=delay_ns))
            continue
        start_ns = round((last_ts if row.timestamp is not None else last_ts + (row.delay or 0.0)) * MS / speed)
        session = Session(sid if sid is not None else f"trace-{lineno}", start_ns, [turn], sid is not None)
        if sid is not None:
            named[sid], ends[sid] = session, start_ns
        order.append(session)
    return sorted(order, key=lambda s: s.start_ns)


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def assert_same(loaded: TraceSessions, expected: list[Session]) -> None:
    """Equal as a sequence: length, iteration, indexing (also negative), slices, starts and counts."""
    assert len(loaded) == len(expected)
    assert list(loaded) == expected
    assert [loaded[i] for i in range(len(loaded))] == expected
    if expected:
        assert loaded[-1] == expected[-1]
    assert loaded[1:3] == expected[1:3]
    assert list(start_times(loaded)) == [s.start_ns for s in expected]
    assert turn_count(loaded) == turn_count(SessionList(expected)) == count_requests(loaded) == \
        count_requests(SessionList(expected))
    for got, want in zip(loaded, expected):
        assert [t.prompt().to_list() for t in got.turns] == [t.prompt().to_list() for t in want.turns]


HAND_WRITTEN = [
    {"timestamp": 300, "input_length": 20, "output_length": 3, "hash_ids": [1, 2, 3]},
    {"timestamp": 100, "input_length": 9, "output_length": 0, "hash_ids": [2**64 - 1, 5], "session_id": "a"},
    {"delay": 40, "input_length": 999, "output_length": 5, "hash_ids": [7], "session_id": "a",
     "output_token_ids": [1, 2]},  # clamped to one block
    {"timestamp": 100, "input_length": 4, "output_length": 1, "hash_ids": [8, 9, 10]},  # starts with "a"
    {"delay": 25, "input_length": 8, "output_length": 2, "hash_ids": [3, 4], "session_id": 7},  # 125 ms
    {"timestamp": 50, "input_length": 8, "output_length": 2, "hash_ids": [3], "output_token_ids": [4]},
    {"delay": 10, "input_length": 12, "output_length": 2, "hash_ids": [3, 11, 12], "session_id": 7},
    {"delay": 5, "input_length": 6, "output_length": 9, "hash_ids": [6, 6], "session_id": "a"},
]


def test_hand_written_sessions_equal_the_list_model(tmp_path):
    path = write(tmp_path / "t.jsonl", HAND_WRITTEN)
    w = TraceWorkload(trace=str(path), trace_block_size=4, arrival_speedup_ratio=2.0)
    loaded, expected = load_trace(w, path), reference(w, path)
    assert [s.session_id for s in expected] == ["trace-6", "a", "trace-4", "7", "trace-1"]  # unsorted rows, sorted
    assert [t.delay_ns for t in expected[1].turns] == [0, 20 * MS, round(2.5 * MS)]
    assert_same(loaded, expected)
    assert_same(load_trace(w, path, 4), reference(w, path, 4))  # run.max_requests


def test_the_generated_trace_equals_the_list_model(tmp_path):
    path = write_synthetic_trace(tmp_path / "synthetic.jsonl", 600)
    w = TraceWorkload(trace=str(path), trace_block_size=512)
    assert_same(load_trace(w, path), reference(w, path))


def test_a_duration_cut_is_the_prefix_that_starts_by_it(tmp_path):
    path = write(tmp_path / "t.jsonl", HAND_WRITTEN)
    scenario = parse_scenario("workload:\n  trace: t.jsonl\n  trace_block_size: 4\nrun:\n  duration_s: 0.1\n",
                              base_dir=tmp_path)
    w = scenario.workload
    assert isinstance(w, TraceWorkload)
    cut = build_sessions(scenario)
    assert isinstance(cut, TraceSessions)
    assert_same(cut, [s for s in reference(w, path) if s.start_ns <= 100 * MS])
    assert len(cut) == 3 and turn_count(cut) == 5
    assert drain_deadline_s(scenario, cut) == 0.1 + scenario.run.drain_timeout_s


_ROW = st.fixed_dictionaries(
    {"input_length": st.integers(1, 40), "output_length": st.integers(0, 5),
     "hash_ids": st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4)},
    optional={"timestamp": st.integers(0, 500), "delay": st.floats(0, 100, allow_nan=False),
              "session_id": st.sampled_from(["a", "b", "c"]), "output_token_ids": st.lists(st.integers(0, 9))})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(_ROW, max_size=12), speed=st.sampled_from([1.0, 3.0]), cut_ms=st.integers(0, 600))
def test_any_trace_equals_the_list_model(tmp_path, rows, speed, cut_ms):
    path = write(tmp_path / "t.jsonl", rows)
    w = TraceWorkload(trace=str(path), trace_block_size=8, arrival_speedup_ratio=speed)
    loaded, expected = load_trace(w, path), reference(w, path)
    assert_same(loaded, expected)
    assert list(loaded.starting_by(cut_ms * MS)) == [s for s in expected if s.start_ns <= cut_ms * MS]


def materializations(monkeypatch: Any, clock: ManualClock) -> list[tuple[int, int]]:
    """``(virtual time, session index)`` of each session a ``TraceSessions`` materializes from now on."""
    taken: list[tuple[int, int]] = []
    materialize = TraceSessions._session

    def counted(self: TraceSessions, i: int) -> Session:
        taken.append((clock.now_ns(), i))
        return materialize(self, i)

    monkeypatch.setattr(TraceSessions, "_session", counted)
    return taken


def test_the_player_materializes_a_loaded_session_only_when_it_starts(tmp_path, monkeypatch):
    rows = [{"timestamp": t, "input_length": 4, "output_length": 1, "hash_ids": [t]} for t in (0, 30, 10, 20)]
    path = write(tmp_path / "t.jsonl", rows)
    sessions = load_trace(TraceWorkload(trace=str(path), trace_block_size=4), path)
    clock = ManualClock()
    taken = materializations(monkeypatch, clock)
    sent: list[tuple[int, str]] = []

    def submit(req: Any, on_end: Any) -> None:
        sent.append((clock.now_ns(), req.request_id))
        asyncio.get_running_loop().call_at_ns(clock.now_ns() + 5 * MS, on_end, None)

    async def main() -> None:
        await SessionPlayer(sessions, submit, clock).run()

    run_virtual(main, clock)
    starts = [0, 10 * MS, 20 * MS, 30 * MS]
    assert taken == [(t, i) for i, t in enumerate(starts)]  # each once, when it starts
    assert sent == [(t, f"trace-{line}-t0") for t, line in zip(starts, (1, 3, 4, 2))]


def test_a_closed_loop_takes_the_next_loaded_session_when_a_slot_frees(tmp_path, monkeypatch):
    rows = [{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [k]} for k in range(5)]
    path = write(tmp_path / "t.jsonl", rows)
    sessions = load_trace(TraceWorkload(trace=str(path), trace_block_size=4), path)
    clock = ManualClock()
    taken = materializations(monkeypatch, clock)

    def submit(req: Any, on_end: Any) -> None:
        asyncio.get_running_loop().call_at_ns(clock.now_ns() + 10 * MS, on_end, None)

    async def main() -> None:
        await SessionPlayer(sessions, submit, clock, concurrency=2).run()

    run_virtual(main, clock)
    assert taken == [(0, 0), (0, 1), (10 * MS, 2), (10 * MS, 3), (20 * MS, 4)]  # two slots, each when one frees
