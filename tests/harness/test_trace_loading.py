"""Mooncake trace loading: timestamps and delays, sessions, block expansion and clamping, speedup, bad rows."""

import json
from pathlib import Path

import pytest

from harness.scenario import ScenarioError, TraceWorkload, parse_scenario
from harness.workload.trace_sessions import TraceSessions, turn_count
from harness.workload import Turn, build_sessions, load_trace
from workers.hash_id_prompt import expand_hash_ids

MS = 1_000_000


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def load(path: Path, *, block: int = 4, speedup: float = 1.0, max_requests: int | None = None):
    w = TraceWorkload(trace=str(path), trace_block_size=block, arrival_speedup_ratio=speedup)
    return load_trace(w, path, max_requests)


def row(ts=None, delay=None, isl=8, osl=3, ids=(1, 2), sid=None):
    r = {"input_length": isl, "output_length": osl, "hash_ids": list(ids)}
    if ts is not None:
        r["timestamp"] = ts
    if delay is not None:
        r["delay"] = delay
    if sid is not None:
        r["session_id"] = sid
    return r


# ------------------------------------------------------------------------------------- arrivals


def test_timestamps_are_absolute_milliseconds_and_rows_stand_alone(tmp_path):
    sessions = load(write(tmp_path / "t.jsonl", [row(ts=0), row(ts=1500.5), row(ts=250)]))
    assert [s.start_ns for s in sessions] == [0, 250 * MS, 1500_500_000]  # sorted by start
    assert all(len(s.turns) == 1 and not s.sticky for s in sessions)
    assert len({s.session_id for s in sessions}) == 3
    assert [s.turns[0].delay_ns for s in sessions] == [0, 0, 0]


def test_delay_without_a_timestamp_is_relative_to_the_last_timestamp(tmp_path):
    sessions = load(write(tmp_path / "t.jsonl", [row(ts=1000), row(delay=200), row(ts=3000), row(delay=50)]))
    assert [s.start_ns for s in sessions] == [1000 * MS, 1200 * MS, 3000 * MS, 3050 * MS]


def test_session_ids_chain_turns_with_their_delays(tmp_path):
    rows = [
        row(ts=100, sid="a", ids=(1, 2)),
        row(ts=150, sid="b", ids=(9,)),
        row(delay=2000, sid="a", ids=(1, 2, 3)),
        row(ts=175),                       # no session: a request of its own
        row(delay=500.5, sid="a", ids=(1, 2, 3, 4)),
        row(delay=10, sid=7),              # numeric session ids work too
        row(delay=20, sid=7),
    ]
    sessions = {s.session_id: s for s in load(write(tmp_path / "t.jsonl", rows))}
    a = sessions["a"]
    assert a.sticky and a.start_ns == 100 * MS
    assert [t.delay_ns for t in a.turns] == [0, 2000 * MS, 500_500_000]
    # the ids their 8-token prompts use (4-token blocks), kept as an array of their low 32 bits
    assert [tuple(t.hash_ids) for t in a.turns] == [(1, 2), (1, 2), (1, 2)]
    assert len(sessions["b"].turns) == 1 and sessions["b"].start_ns == 150 * MS
    assert sessions["7"].start_ns == (175 + 10) * MS and [t.delay_ns for t in sessions["7"].turns] == [0, 20 * MS]
    standalone = [s for s in sessions.values() if not s.sticky]
    assert len(standalone) == 1 and standalone[0].start_ns == 175 * MS


def test_arrival_speedup_ratio_compresses_starts_and_delays(tmp_path):
    path = write(tmp_path / "t.jsonl", [row(ts=1000, sid="s"), row(delay=300, sid="s"), row(ts=4000)])
    normal = load(path)
    fast = load(path, speedup=4.0)
    assert [s.start_ns for s in fast] == [s.start_ns // 4 for s in normal] == [250 * MS, 1000 * MS]
    assert fast[0].turns[1].delay_ns == 75 * MS
    scenario = parse_scenario("workload:\n  trace: t.jsonl\n  arrival_speedup_ratio: 0.5\n", base_dir=tmp_path)
    assert [s.start_ns for s in build_sessions(scenario)] == [2000 * MS, 8000 * MS]


# --------------------------------------------------------------------------------------- tokens


def test_expand_hash_ids_repeats_each_id_block_times_and_cuts_to_input_length():
    assert expand_hash_ids([7, 8, 9], 6, 4) == [7, 7, 7, 7, 8, 8]
    assert expand_hash_ids([7, 8], 8, 4) == [7] * 4 + [8] * 4
    assert expand_hash_ids([5], 1, 512) == [5]


def test_input_length_is_clamped_to_the_hash_ids(tmp_path):
    assert expand_hash_ids([7, 8], 100, 4) == [7] * 4 + [8] * 4
    sessions = load(write(tmp_path / "t.jsonl", [row(ts=0, isl=100, ids=(3, 4)), row(ts=1, isl=5, ids=(3, 4))]),
                    block=4)
    long, short = (s.turns[0] for s in sessions)
    assert long.prompt() == [3] * 4 + [4] * 4  # 100 > 2 ids x 4 tokens
    assert short.prompt() == [3] * 4 + [4]
    assert long.input_length == 100 and long.trace_block_size == 4


def test_rows_sharing_leading_hash_ids_share_the_token_prefix(tmp_path):
    sessions = load(write(tmp_path / "t.jsonl", [row(ts=0, isl=48, ids=(1, 2, 3)), row(ts=1, isl=48, ids=(1, 2, 4))]),
                    block=16)
    a, b = (s.turns[0].prompt() for s in sessions)
    assert a[:32] == b[:32] and a[32:] != b[32:]


def test_output_length_and_turn_fields(tmp_path):
    sessions = load(write(tmp_path / "t.jsonl", [row(ts=0, osl=0), row(ts=1, osl=17)]))
    assert [s.turns[0].max_tokens for s in sessions] == [1, 17]  # at least one output token
    turn = sessions[1].turns[0]
    assert isinstance(turn, Turn) and turn.tokens is None  # expanded only when sent


# ------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("bad", "what"),
    [
        ("{not json", "not JSON"),
        (json.dumps({"timestamp": 0, "input_length": 8, "output_length": 1}), "hash_ids"),
        (json.dumps({"timestamp": 0, "output_length": 1, "hash_ids": [1]}), "input_length"),
        (json.dumps({"timestamp": 0, "input_length": "many", "output_length": 1, "hash_ids": [1]}),
         "not a Mooncake trace row"),
        (json.dumps({"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": ["x"]}),
         "not a Mooncake trace row"),
        (json.dumps({"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": []}), "empty prompt"),
        (json.dumps({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}), "empty prompt"),
    ],
)
def test_malformed_rows_name_the_file_and_line(tmp_path, bad, what):
    path = write(tmp_path / "t.jsonl", [row(ts=0), row(ts=1), bad, row(ts=2)])
    with pytest.raises(ScenarioError) as info:
        load(path)
    assert f"{path}:3:" in str(info.value)
    assert what in str(info.value)


def test_blank_lines_are_skipped_and_max_requests_limits_the_rows(tmp_path):
    path = write(tmp_path / "t.jsonl", [row(ts=i) for i in range(10)])
    assert len(load(path, max_requests=4)) == 4
    blank = write(tmp_path / "b.jsonl", [row(ts=0), "", "   ", row(ts=1)])
    assert len(load(blank)) == 2


def test_a_bad_row_beyond_max_requests_is_never_read(tmp_path):
    path = write(tmp_path / "t.jsonl", [row(ts=0), row(ts=1), "{broken"])
    assert len(load(path, max_requests=2)) == 2


def test_build_sessions_applies_duration_and_max_requests(tmp_path):
    write(tmp_path / "t.jsonl", [row(ts=1000 * i) for i in range(10)])
    base = "workload:\n  trace: t.jsonl\n  trace_block_size: 4\n"
    by_time = parse_scenario(base, base_dir=tmp_path, overrides=["run.duration_s=3.5"])
    assert [s.start_ns for s in build_sessions(by_time)] == [0, 1000 * MS, 2000 * MS, 3000 * MS]
    by_count = parse_scenario(base, base_dir=tmp_path, overrides=["run.max_requests=2"])
    assert len(build_sessions(by_count)) == 2


def test_a_trace_past_the_row_bound_is_refused_at_the_row_past_it_without_reading_further(tmp_path):
    import io

    import harness.workload.build as workload
    from harness.scenario import MAX_REQUESTS
    from harness.workload.traces.rows import MAX_TRACE_ROWS

    assert MAX_TRACE_ROWS == MAX_REQUESTS == 10_000_000  # the documented bound, as a scenario's requests
    rows = [json.dumps(row(ts=i)) for i in range(6)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(rows) + "\n{not json at all\n")  # a bad line after the bound is never parsed
    w = TraceWorkload(trace=str(path), trace_block_size=4)
    with pytest.raises(ScenarioError, match=r"t.jsonl:6: more than 5 rows.*run.max_requests"):
        load_trace(w, path, max_rows=5)
    assert len(load_trace(w, path, 5, max_rows=5)) == 5  # run.max_requests reads the first ones
    early = tmp_path / "early.jsonl"
    early.write_text(rows[0] + "\n{bad\n\n" + "\n".join(rows[1:]) + "\n")
    with pytest.raises(ScenarioError, match=r"early.jsonl:7: more than 5 rows"):  # counted before any is parsed
        load_trace(w, early, max_rows=5)
    with pytest.raises(ScenarioError, match="t.jsonl:7: not JSON"):  # within the bound: every row is read
        load_trace(w, path, max_rows=7)
    out = io.StringIO()
    old, workload.PROGRESS_EVERY_ROWS = workload.PROGRESS_EVERY_ROWS, 2
    try:
        load_trace(w, path, 6, progress=out)
    finally:
        workload.PROGRESS_EVERY_ROWS = old
    assert out.getvalue().splitlines() == [f"kvemu: reading {path}: {n} rows (line {n})" for n in (2, 4, 6)]


def loaded_bytes_per_row(path: Path, rows: list[dict]) -> tuple[TraceSessions, float]:
    """The trace of ``rows`` written to ``path``, loaded, and the bytes it holds a row (tracemalloc)."""
    import tracemalloc

    write(path, rows)
    w = TraceWorkload(trace=str(path), trace_block_size=512)
    tracemalloc.start()
    try:
        sessions = load_trace(w, path)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(sessions) == len(rows)
    return sessions, held / len(rows)


def test_a_loaded_trace_row_is_compact(tmp_path):
    sessions, per_row = loaded_bytes_per_row(tmp_path / "t.jsonl", [
        {"timestamp": i, "input_length": 8000, "output_length": 2, "hash_ids": [7 * i + 1000 + k for k in range(16)]}
        for i in range(20_000)])
    # 16 hash ids a row: 1,008 bytes a row as tuples of Python ints; about 540 as an array of the 32 bits used
    assert per_row < 700, f"{per_row:.0f} bytes a row"
    first = sessions[0].turns[0]
    assert list(first.prompt()[:1]) == [1000] and len(first.prompt()) == 8000


def test_a_loaded_tiny_row_takes_at_most_100_bytes(tmp_path):
    sessions, per_row = loaded_bytes_per_row(tmp_path / "t.jsonl", [
        {"timestamp": i // 100, "input_length": 10, "output_length": 1, "hash_ids": [i % 977]} for i in range(20_000)])
    assert per_row <= 100, f"{per_row:.0f} bytes a row"  # (as Session and Turn objects: about 450)
    assert turn_count(sessions) == len(sessions)
