"""Engine flavours against the reference, request by request: tiny traces through both replays.

Each case is a hand-written Mooncake trace chosen to exercise one mechanism (admission under a KV
reservation, head-of-line waiting, prefix reuse of active and cached blocks, a fully cached prompt);
kvemu's TTFT and E2E must equal the reference's to 1 µs and the reused tokens exactly.
"""

from __future__ import annotations

import pytest

from tests.reference_cases import assert_same, kvemu_outcomes, reference_outcomes, write_trace

pytestmark = pytest.mark.reference


def rows(*specs: tuple[float, int, int, list[int]]) -> list[dict]:
    return [dict(timestamp=t, input_length=n, output_length=o, hash_ids=h) for t, n, o, h in specs]


TRTLLM_CASES = {
    "one request": (rows((0, 1000, 5, [1, 2])), {}, 512),
    "reservation makes the second wait": (rows((0, 320, 321, [1]), (1, 320, 320, [2])), {"num_gpu_blocks": 40}, 512),
    "reservation just fits": (rows((0, 320, 321, [1]), (1, 320, 320, [2])), {"num_gpu_blocks": 41}, 512),
    "head of line": (rows((0, 320, 400, [1]), (1, 320, 400, [2]), (2, 32, 4, [3])), {"num_gpu_blocks": 40}, 512),
    "active prefix discount": (rows((0, 320, 200, list(range(1, 11))), (1, 640, 160, list(range(1, 21)))),
                               {"num_gpu_blocks": 32}, 32),
    "no discount beyond it": (rows((0, 320, 200, list(range(1, 11))), (1, 640, 160, list(range(1, 21)))),
                              {"num_gpu_blocks": 31}, 32),
    "fully cached aligned prompt": (rows((0, 288, 3, list(range(1, 10))), (1000, 288, 3, list(range(1, 10)))), {}, 32),
    "overlapping contention": (rows(*[(t, 1000, 200, [10 * t + 1, 10 * t + 2]) for t in (0, 10, 20, 30)]),
                               {"num_gpu_blocks": 100}, 512),
}


VLLM_CASES = {
    # a batch's prefill is timed on b * (floor(sum isl / b) - floor(sum prefix / b)) tokens: 1500, not 1501
    "two prompts in one pass": (rows((0, 1000, 2, [1, 2]), (0, 501, 2, [3, 4])), {}, 512),
    "three prompts, one cached prefix": (rows((0, 1024, 2, [1, 2]), (100, 1535, 2, [1, 2, 3]), (100, 300, 2, [4]),
                                              (100, 301, 2, [5])), {}, 512),
    # preempted, re-admitted: its surviving cached blocks are reused (544 tokens), which the reuse counts
    "preemption and re-admission": (rows((0, 320, 400, [1]), (1, 320, 400, [2]), (2, 32, 4, [3])),
                                    {"num_gpu_blocks": 40, "block_size": 32}, 512),
    "p capped at the pool": (rows((0, 320, 200, list(range(1, 11))), (1, 640, 160, list(range(1, 21)))),
                             {"num_gpu_blocks": 32, "block_size": 32}, 32),
}


SGLANG_CASES = {
    "one request": (rows((0, 1000, 5, [1, 2])), {}),
    "extend pass starves decodes": (rows((0, 1000, 20, [1, 2]), (50, 2000, 3, [3, 4, 5, 6])), {}),
    "floored batch means": (rows((0, 1000, 3, [1, 2]), (0, 1001, 3, [3, 4])), {}),
    "chunk budget": (rows((0, 600, 2, [1, 2]), (0, 600, 2, [3, 4])), {"sglang": {"chunked_prefill_size": 1000}}),
    "max_prefill_tokens": (rows((0, 600, 2, [1, 2]), (0, 600, 2, [3, 4])), {"sglang": {"max_prefill_tokens": 1000}}),
    "ratio-gated admission": (rows((0, 6000, 4000, list(range(1, 13))), (100, 8000, 10, list(range(21, 37)))), {}),
    "chunks do not decay the ratio": (rows((0, 12000, 4000, list(range(1, 25))), (300, 2000, 10, [101, 102, 103, 104])),
                                      {"sglang": {"chunked_prefill_size": 2048}}),
    # c's prefix is a's, cached and unheld: admission charges it nothing more than the free + evictable pages do
    "cached prefix nobody holds": (rows((0, 1000, 1, [1, 2]), (100, 1200, 500, [3, 4, 5]), (200, 1500, 20, [1, 2, 6])),
                                   {"num_gpu_blocks": 2900}),
    "retraction keeps the cache": (rows((0, 6000, 3000, list(range(1, 13))), (10, 6000, 3000, list(range(101, 113)))), {}),
    "retraction tie": (rows((0, 5000, 4000, list(range(1, 11))), (0, 6000, 4000, list(range(101, 113)))), {}),
    "lru tail eviction": (rows((0, 1000, 1, [1, 2]), (100, 1000, 1, [3, 4]), (200, 1000, 1, [1, 2]),
                               (300, 1500, 1, [5, 6, 7]), (400, 1000, 1, [3, 4]), (500, 1000, 1, [1, 2])),
                          {"num_gpu_blocks": 3000}),
    # e cannot have its pages once its cached prefix (a's) is locked: each pass it tries, it looks that prefix up,
    # which keeps a's leaf the most recently used; the decode passes evict b's finished tokens instead
    "a request that cannot fit refreshes its prefix": (
        rows((0, 6207, 269, list(range(1, 14))), (2000, 3906, 320, [20, 21, 22, 23, 24, 25, 26, 27]),
             (7000, 7638, 260, [20, 21, 22, 23, *range(30, 41)]), (9000, 3254, 440, list(range(50, 57))),
             (13500, 5856, 395, [*range(1, 8), *range(60, 65)])), {}),
    "pages of 16": (rows((0, 1000, 1, [1, 2]), (100, 1000, 1, [3, 4]), (200, 1000, 1, [1, 2]), (300, 1500, 1, [5, 6, 7]),
                         (400, 1000, 1, [3, 4]), (500, 1000, 1, [1, 2])), {"num_gpu_blocks": 200, "block_size": 16}),
    "lpm": (rows((0, 1024, 1, [1, 2]), (100, 500, 50, [50]), (200, 600, 1, [60, 61]), (300, 1500, 1, [1, 2, 3])),
            {"max_num_seqs": 1, "sglang": {"schedule_policy": "lpm"}}),
    "prefill_decode_interval": (rows((0, 1000, 20, [1, 2]), (1, 2000, 3, [3, 4, 5, 6]), (2, 500, 3, [7])),
                                {"sglang": {"prefill_decode_interval": 3}}),
    "no prefix caching": (rows((0, 1024, 1, [1, 2]), (100, 1024, 1, [1, 2])), {"enable_prefix_caching": False}),
    "speedup ratios": (rows((0, 1000, 20, [1, 2]), (50, 2000, 3, [3, 4, 5, 6])),
                       {"speedup_ratio": 2.0, "decode_speedup_ratio": 4.0}),
}


@pytest.mark.parametrize("case", list(SGLANG_CASES))
def test_sglang_matches_the_reference_request_by_request(dynamo_core, tmp_path, case):
    trace_rows, engine = SGLANG_CASES[case]
    engine = dict(engine, backend="sglang")
    trace = write_trace(tmp_path, trace_rows)
    assert_same(kvemu_outcomes(trace, engine), reference_outcomes(dynamo_core, trace, engine))


def test_sglang_matches_the_reference_on_a_mooncake_slice(dynamo_core, mooncake_trace, tmp_path):
    """The first 300 rows of the trace with at most 8,000 input tokens (where the reference completes), 16 workers."""
    import json

    kept = [row for row in map(json.loads, mooncake_trace.read_text().splitlines()) if row["input_length"] <= 8000][:300]
    # from 0: the reference counts arrivals from the first row (kvemu keeps the trace's times, which only shifts them)
    trace = write_trace(tmp_path, [dict(r, timestamp=r["timestamp"] - kept[0]["timestamp"]) for r in kept])
    engine = {"backend": "sglang"}
    assert_same(kvemu_outcomes(trace, engine, workers=16), reference_outcomes(dynamo_core, trace, engine, workers=16))


def test_sglang_matches_the_reference_through_retractions_on_one_rank(dynamo_core, real_mooncake_trace, tmp_path):
    """One rank's share of the trace's short rows (round robin on 16 workers, rank 14) up to 1,900 s: requests
    are retracted under KV pressure around 1,790 s, and those already waiting are admitted before them (a
    moment of the real trace: a generated one need not have it)."""
    import json

    mooncake_trace = real_mooncake_trace
    short = [line for line in mooncake_trace.read_text().splitlines() if json.loads(line)["input_length"] <= 8000]
    rank = [json.loads(line) for i, line in enumerate(short) if i % 16 == 14]
    rank = [dict(r, timestamp=r["timestamp"] - rank[0]["timestamp"]) for r in rank if r["timestamp"] <= 1_900_000]
    trace = write_trace(tmp_path, rank)  # (from 0: the reference counts arrivals from the first)
    engine = {"backend": "sglang"}
    ours = kvemu_outcomes(trace, engine)
    assert_same(ours, reference_outcomes(dynamo_core, trace, engine))


@pytest.mark.parametrize("case", list(VLLM_CASES))
def test_vllm_matches_the_reference_request_by_request(dynamo_core, tmp_path, case):
    trace_rows, engine, trace_block_size = VLLM_CASES[case]
    trace = write_trace(tmp_path, trace_rows)
    assert_same(kvemu_outcomes(trace, engine, trace_block_size=trace_block_size),
                reference_outcomes(dynamo_core, trace, engine, trace_block_size=trace_block_size))


@pytest.mark.parametrize("case", list(TRTLLM_CASES))
def test_trtllm_matches_the_reference_request_by_request(dynamo_core, tmp_path, case):
    trace_rows, engine, trace_block_size = TRTLLM_CASES[case]
    engine = dict(engine, backend="trtllm")
    trace = write_trace(tmp_path, trace_rows)
    assert_same(kvemu_outcomes(trace, engine, trace_block_size=trace_block_size),
                reference_outcomes(dynamo_core, trace, engine, trace_block_size=trace_block_size))
