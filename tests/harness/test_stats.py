"""The one percentile definition (``harness.report.stats.percentile``): rounded rank, as Dynamo's replay report."""

import json
import math
from pathlib import Path

import pytest

from harness.report.stats import percentile


def test_one_value_is_every_percentile():
    for q in (0, 1, 50, 99, 100):
        assert percentile([7.5], q) == 7.5


def test_two_values_round_half_up_not_interpolate():
    assert percentile([10, 20], 0) == 10
    assert percentile([10, 20], 49.9) == 10  # rank 0.499 -> 0
    assert percentile([10, 20], 50) == 20  # rank 0.5 -> 1 (half rounds up; no 15, no Python round-half-even)
    assert percentile([10, 20], 100) == 20


def test_known_small_inputs():
    values = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # n - 1 = 9
    assert [percentile(values, q) for q in (0, 50, 75, 90, 95, 99, 100)] == [1, 6, 8, 9, 10, 10, 10]
    three = [50, 100, 200]  # n - 1 = 2: ranks 1.5, 1.8, 1.98 round to 2
    assert [percentile(three, q) for q in (25, 50, 75, 90, 99)] == [100, 100, 200, 200, 200]
    assert percentile(three, 24.9) == 50  # rank 0.498 -> 0


def test_q_bounds_are_min_and_max():
    values = list(range(101))
    assert percentile(values, 0) == 0 and percentile(values, 100) == 100
    assert all(percentile(values, q) == q for q in range(101))  # n - 1 = 100: the rank is q itself


def test_returns_float_for_ints_and_numpy():
    assert isinstance(percentile([1, 2, 3], 50), float)
    np = pytest.importorskip("numpy")
    assert percentile(np.array([1.0, 2.0, 4.0]), 75) == 4.0


@pytest.mark.parametrize("q", [-0.1, 100.1, math.nan])
def test_q_out_of_range_raises(q):
    with pytest.raises(ValueError):
        percentile([1, 2], q)


def test_empty_raises():
    with pytest.raises(ValueError):
        percentile([], 50)


@pytest.mark.reference
def test_matches_dynamo_replay_report(tmp_path: Path):
    """Differential: Dynamo's offline replay summary against its own per-request values, bit for bit."""
    core = pytest.importorskip("dynamo._core", exc_type=ImportError,
                               reason="needs ai-dynamo-runtime==1.6.1 (x86-64 Linux)")
    for n in (1, 2, 3, 4, 10, 21):
        trace = tmp_path / f"t{n}.jsonl"
        rows = [{"timestamp": i * 5000, "input_length": 512 * (1 + i * 7 % 23), "output_length": 4 + i % 5,
                 "hash_ids": list(range(1000 * i, 1000 * i + 1 + i * 7 % 23))} for i in range(n)]
        trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
        result = core.run_mocker_trace_replay([str(trace)], num_workers=1, trace_block_size=512,
                                              capture_per_request=True)
        summary, per_request = result.summary, result.per_request
        for metric in ("ttft", "e2e_latency"):
            values = sorted(r[f"{metric}_ms"] for r in per_request if r.get(f"{metric}_ms") is not None)
            assert len(values) == n
            for key, q in (("min", 0), ("median", 50), ("p75", 75), ("p90", 90), ("p95", 95), ("p99", 99),
                           ("max", 100)):
                assert percentile(values, q) == summary[f"{key}_{metric}_ms"], (n, metric, key)
