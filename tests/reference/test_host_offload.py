"""Host offload (``native_host_offload``) against the reference, request by request on tiny traces.

The cases are the reference's measured ones (GPU pool of 20 blocks of 64 tokens, 1,000 bytes a token, so a
block crosses a 0.064 GB/s link in 1 ms): a prompt evicted from the GPU and found on the host, partly on the
GPU and partly on the host, host capacities that keep or lose it, a slow store that delays the pass which
needs its GPU blocks or preempts a request whose blocks are being stored, a load other requests overtake, a load that holds its GPU prefix and destination blocks
while it runs; then a Mooncake slice under pressure (2 workers, 150 rows of the real trace, or of the generated
one without it). TTFT and E2E must equal the reference's to 1 µs and the reused tokens exactly.
"""

from __future__ import annotations


import pytest

from tests.reference_cases import assert_same, kvemu_outcomes, reference_outcomes, write_trace

pytestmark = pytest.mark.reference



def rows(*specs: tuple[float, int, int, list[int]]) -> list[dict]:
    return [dict(timestamp=t, input_length=n, output_length=o, hash_ids=h) for t, n, o, h in specs]


def offload(host_blocks: int = 100, d2h: float = 0.064, h2d: float = 0.064, **extra: float) -> dict:
    return {"num_gpu_blocks": 20, "kv_cache_bytes_per_token": 1000,
            "native_host_offload": {"num_host_blocks": host_blocks, "d2h_bandwidth_gbps": d2h,
                                    "h2d_bandwidth_gbps": h2d, **extra}}


EVICT = ((0, 1024, 2, [1, 2]), (1000, 1216, 2, [3, 4, 5]))
HEADROOM = ((0, 512, 2, [1]), (1, 512, 2, [2]), (1000, 1216, 2, [3, 4, 5]))
TOUCHED = ((0, 1024, 2, [1, 2]), (1000, 1024, 2, [1, 2]), (2000, 1024, 2, [5, 6]), (3000, 1024, 2, [1, 2]))

CASES = {
    "evicted prompt loaded from the host": (rows(*EVICT, (2000, 1024, 2, [1, 2])), offload()),
    "offload off recomputes it": (rows(*EVICT, (2000, 1024, 2, [1, 2])), {"num_gpu_blocks": 20}),
    "longer prompt on a host prefix": (rows(*EVICT, (2000, 1100, 2, [1, 2, 7])), offload()),
    "part on the GPU, part on the host": (rows((0, 1024, 2, [1, 2]), (1000, 1024, 2, [3, 4]),
                                                (2000, 1024, 2, [1, 2])), offload()),
    "slower load": (rows((0, 1024, 2, [1, 2]), (1000, 1024, 2, [3, 4]), (2000, 1024, 2, [1, 2])),
                    offload(h2d=0.032)),
    "host of 30 keeps a prefix": (rows(*EVICT, (2000, 1024, 2, [1, 2])), offload(30)),
    "host of 20 loses it": (rows(*EVICT, (2000, 1024, 2, [1, 2])), offload(20)),
    "a cohort larger than the host never stores": (rows(*EVICT, (2000, 1024, 2, [1, 2])), offload(16)),
    "host of 10 stores nothing": (rows(*EVICT, (2000, 1024, 2, [1, 2])), offload(10)),
    "a pass waits for the store of the blocks it evicts": (rows((0, 1024, 2, [1, 2]), (200, 1216, 2, [3, 4, 5])),
                                                           offload(d2h=0.0064)),
    "others overtake a load": (rows(*EVICT, (2000, 1024, 2, [1, 2]), (2001, 128, 2, [9])), offload()),
    "first-byte latency": (rows(*EVICT, (2000, 1024, 2, [1, 2])), offload(latency_to_first_byte_ms=5.0)),
    "instant links": (rows(*EVICT, (2000, 1024, 2, [1, 2]), (2000, 512, 3, [1])), offload(d2h=0.0, h2d=0.0)),
    # a prompt wholly on the GPU loads nothing, though vLLM recomputes its last block (which the host holds)
    "a GPU hit on every prompt block": (rows((0, 1024, 2, [1, 2]), (1000, 1024, 2, [1, 2])), offload()),
    # the lookup of a GPU hit touches the prompt's host copies, last block first, so a later store evicts
    # their tail: the prompt comes back with more of it on the host than a store-order LRU would leave
    "a GPU hit refreshes the host copies, tail first": (rows(*TOUCHED), offload(24)),
    "a GPU hit refreshes the host copies, tail first (host of 28)": (rows(*TOUCHED), offload(28)),
    "a partial GPU hit refreshes its own blocks": (rows((0, 1024, 2, [1, 2]), (1000, 1100, 2, [1, 2, 9]),
                                                        (2000, 1024, 2, [5, 6]), (3000, 1024, 2, [1, 2])), offload(24)),
    # a load takes the request's GPU prefix and allocates the loaded blocks' destinations when it starts (vLLM's
    # allocation before an async load): a request arriving during the load neither evicts that prefix (the
    # first 8 blocks, which the second prompt's eviction left on the GPU) nor fits beside it, so it waits
    "a load holds its GPU prefix and destinations": (
        rows((0, 1024, 2, [1, 2]), (1000, 768, 2, [3, 4]), (2000, 1024, 2, [1, 2]), (2001, 1216, 2, [5, 6, 7])),
        offload(h2d=0.0064)),
    "a load holds its GPU prefix and destinations (fast link)": (
        rows((0, 1024, 2, [1, 2]), (1000, 768, 2, [3, 4]), (2000, 1024, 2, [1, 2]), (2001, 1216, 2, [5, 6, 7])),
        offload()),
    # a load starts only if its whole sequence (11 blocks) fits beside what loads already started still need (the
    # first one's 3 blocks past its 8 loaded ones): the second waits for the first's admission (with 10-block
    # prompts, 10 of the 12 blocks left fit beside 2: both load at once)
    "a load leaves room for the loads in flight": (
        rows(*HEADROOM, (2000, 700, 2, [1, 6]), (2000, 700, 3, [2, 7])), offload(h2d=0.0064)),
    "a load leaves room for the loads in flight (it fits)": (
        rows(*HEADROOM, (2000, 600, 2, [1, 6]), (2000, 600, 3, [2, 7])), offload(h2d=0.0064)),
    # the decode growth preempts the second request while its prompt's blocks are still being copied to the host
    # (the first's 10 blocks go first, 100 ms each at 0.00064 GB/s): the pass that preempts it waits for that copy
    "a pass waits for the store of the request it preempts": (
        rows((0, 640, 60, [1, 2]), (1, 576, 60, [3, 4])), offload(d2h=0.00064)),
    "a pass waits for the store of the request it preempts (faster link)": (
        rows((0, 640, 60, [1, 2]), (1, 576, 60, [3, 4])), offload(d2h=0.0016)),
    # the store cursor starts at the first block: a GPU hit re-stores the host copies another store evicted
    "a GPU hit re-stores what the host lost": (
        rows((0, 1024, 2, [1, 2]), (1000, 1024, 2, [5, 6]), (2000, 1024, 2, [1, 2]),
             (3000, 2496, 2, [11, 12, 13, 14, 15]), (4000, 1024, 2, [1, 2])), {**offload(24), "num_gpu_blocks": 40}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_host_offload_matches_the_reference_request_by_request(dynamo_core, tmp_path, case):
    trace_rows, engine = CASES[case]
    trace = write_trace(tmp_path, trace_rows)
    assert_same(kvemu_outcomes(trace, engine), reference_outcomes(dynamo_core, trace, engine))


@pytest.mark.parametrize("source", ["fixture", "generated"])
def test_mooncake_slice_under_pressure_matches_the_reference(dynamo_core, mooncake_trace, tmp_path, source):
    # the fixture's trace is the real one where it is present; the generated one is always replayed too (its
    # follow-ups find their prompts on the host after the GPU lost them, and loads overlap under pressure)
    if source == "generated":
        from harness.workload.synthetic_trace import write_synthetic_trace

        mooncake_trace = write_synthetic_trace(tmp_path / "generated.jsonl", 150)
    lines = mooncake_trace.read_text().splitlines(keepends=True)[:150]
    trace = tmp_path / "slice.jsonl"
    trace.write_text("".join(lines))
    engine = {"num_gpu_blocks": 2048, "kv_cache_bytes_per_token": 131072,
              "native_host_offload": {"num_host_blocks": 8192}}
    assert_same(kvemu_outcomes(trace, engine, workers=2), reference_outcomes(dynamo_core, trace, engine, workers=2))
