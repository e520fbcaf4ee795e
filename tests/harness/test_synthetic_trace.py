"""The generated stand-in for the Mooncake trace: valid rows, fixed by the seed, shaped like the real trace.

Tests that replay "the Mooncake trace" get this one on a machine without the real one (the ``mooncake_trace``
fixture), so it must exercise what the real one does: a shared system prompt, conversations whose later turns
repeat most of an earlier prompt, prompts of thousands of tokens arriving a few a second.
"""

from __future__ import annotations

import statistics

from harness.workload.synthetic_trace import synthetic_rows, write_synthetic_trace
from harness.workload.traces.mooncake import read_mooncake


def test_the_same_seed_gives_the_same_bytes_and_another_seed_others(tmp_path):
    a = write_synthetic_trace(tmp_path / "a.jsonl", 500, seed=3).read_bytes()
    assert a == write_synthetic_trace(tmp_path / "b.jsonl", 500, seed=3).read_bytes()
    assert a != write_synthetic_trace(tmp_path / "c.jsonl", 500, seed=4).read_bytes()


def test_every_row_is_a_valid_mooncake_row_in_arrival_order(tmp_path):
    path = write_synthetic_trace(tmp_path / "t.jsonl", 2000)
    rows = [row for _, row in read_mooncake(path)]
    assert len(rows) == 2000
    timestamps = [row.timestamp for row in rows]
    assert timestamps == sorted(timestamps) and all(t % 1000 == 0 for t in timestamps)  # whole seconds, as the real
    for row in rows:  # the last block is partial, every other one full
        assert (len(row.hash_ids) - 1) * 512 < row.input_length <= len(row.hash_ids) * 512
        assert 1 <= row.output_length <= 2000


def test_its_shape_is_the_real_traces():
    rows = synthetic_rows(3000)
    assert all(r["hash_ids"][0] == 0 for r in rows)  # one system-prompt block shared by every prompt
    rate = len(rows) / (rows[-1]["timestamp"] / 1000)
    assert 3.0 <= rate <= 3.8  # the real trace: 3.4 rows a second
    inputs = [r["input_length"] for r in rows]
    assert 9_000 <= statistics.mean(inputs) <= 15_000 and 5_000 <= statistics.median(inputs) <= 10_000
    assert 300 <= statistics.mean(r["output_length"] for r in rows) <= 400
    seen: set[tuple[int, ...]] = set()
    continued = 0
    for r in rows:  # a row continues a conversation when it repeats more than the system prompt of an earlier one
        continued += tuple(r["hash_ids"][:2]) in seen
        seen.update(tuple(r["hash_ids"][:k]) for k in range(1, len(r["hash_ids"]) + 1))
    assert 0.25 <= continued / len(rows) <= 0.45  # the real trace: 0.39
