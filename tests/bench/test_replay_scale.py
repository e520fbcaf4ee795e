"""``bench.replay --scale N``'s trace: ``scale_rows`` on a few rows (a pure function; no run of the bench)."""

from __future__ import annotations

import json

import pytest

from bench.replay_inputs import SCALE_GAP_MS, scale_rows, scaled_trace

ROWS = [
    {"timestamp": 100, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 100, "input_length": 512, "output_length": 5, "hash_ids": [0, 7], "session_id": "a"},
    {"input_length": 600, "output_length": 5, "hash_ids": [0, 7, 8], "session_id": "a", "delay": 50},
    {"timestamp": 2100, "input_length": 512, "output_length": 3, "hash_ids": [9], "session_id": "b"},
]


def test_four_copies_shifted_by_the_span_plus_a_second_with_new_hash_and_session_ids():
    out = scale_rows(ROWS, 4)
    assert len(out) == 4 * len(ROWS)
    assert out[:len(ROWS)] == ROWS  # copy 0 is the trace itself
    span, stride = 2100 - 100, 9 + 1
    for k in range(4):
        copy = out[k * len(ROWS):(k + 1) * len(ROWS)]
        for row, orig in zip(copy, ROWS):
            assert row.get("timestamp") == (None if "timestamp" not in orig else orig["timestamp"] + k * (span + SCALE_GAP_MS))
            assert row["hash_ids"] == [h + k * stride for h in orig["hash_ids"]]
            assert (row["input_length"], row["output_length"], row.get("delay")) == (
                orig["input_length"], orig["output_length"], orig.get("delay"))
        stamps = [r["timestamp"] for r in copy if "timestamp" in r]
        assert max(stamps) - min(stamps) == span
    # copies share no hash id and no session id; every copy keeps its own sessions' rows together
    hashes = [{h for r in out[k * 4:(k + 1) * 4] for h in r["hash_ids"]} for k in range(4)]
    assert all(not (hashes[i] & hashes[j]) for i in range(4) for j in range(i + 1, 4))
    sids = [{r["session_id"] for r in out[k * 4:(k + 1) * 4] if "session_id" in r} for k in range(4)]
    assert all(len(s) == 2 for s in sids)
    assert len(set().union(*sids)) == 8
    stamps = [r["timestamp"] for r in out if "timestamp" in r]
    assert stamps == sorted(stamps)
    assert ROWS[2] == {"input_length": 600, "output_length": 5, "hash_ids": [0, 7, 8], "session_id": "a", "delay": 50}


def test_integer_session_ids_stay_integers_and_distinct():
    rows = [{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [3], "session_id": 5},
            {"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [4], "session_id": 6}]
    out = scale_rows(rows, 3)
    assert [r["session_id"] for r in out] == [5, 6, 12, 13, 19, 20]
    assert [r["timestamp"] for r in out] == [0, 0, 1000, 1000, 2000, 2000]  # a span of 0: copies 1 s apart


def test_scale_one_is_the_identity_and_below_one_is_refused():
    assert scale_rows(ROWS, 1) == ROWS
    with pytest.raises(ValueError):
        scale_rows(ROWS, 0)


def test_the_file_takes_the_first_rows_before_scaling(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = scaled_trace(trace, 2, 3, tmp_path)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == scale_rows(ROWS[:3], 2)
