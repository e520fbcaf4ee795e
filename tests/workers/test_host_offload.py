"""Host offload (``native_host_offload``): configuration, the host tier's bookkeeping, its KV events, and the
engine's two drivers agreeing with it on (hypothesis)."""

from __future__ import annotations

import random
from itertools import islice

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu.clock import MAX_TIME_NS
from kvemu.errors import InvalidArgument
from kvemu.router_events import StorageTier
from kvemu.hashing import local_block_hashes
from kvemu.routing_core import RoutingCore
from kvemu.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored
from kvemu.wire.stream import EventStream, WorkerEventStats
from tests.engine_runs import steps
from tests.workers.test_engines_fastforward import fast_forward, summary, workloads
from workers.blocks import BlockPool
from workers.config import EngineConfig, HostOffloadConfig
from workers.vllm.engine import VllmEngineCore
from workers.vllm.host_tier import HOST_REMOVED, HOST_STORED, HostTier
from workers.request import Request

MS = 1_000_000


def host_config(**kw) -> EngineConfig:
    offload = HostOffloadConfig(num_host_blocks=kw.pop("host", 100), d2h_bandwidth_gbps=0.064,
                                h2d_bandwidth_gbps=0.064)
    return EngineConfig(num_gpu_blocks=kw.pop("gpu", 20), kv_cache_bytes_per_token=1000, native_host_offload=offload,
                        **kw)


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("kw, field, text", [
    ({"kv_cache_bytes_per_token": None}, "kv_cache_bytes_per_token", "needs kv_cache_bytes_per_token"),
    ({"backend": "trtllm"}, "native_host_offload", "backend vllm"),
    ({"enable_prefix_caching": False}, "native_host_offload", "enable_prefix_caching"),
])
def test_host_offload_is_refused_where_the_reference_refuses_it(kw, field, text):
    base = {"kv_cache_bytes_per_token": 1000, "native_host_offload": HostOffloadConfig(num_host_blocks=8)}
    with pytest.raises(InvalidArgument, match=text) as exc:
        EngineConfig(**{**base, **kw})
    assert exc.value.field == field


@pytest.mark.parametrize("kw, field", [({"num_host_blocks": 0}, "num_host_blocks"),
                                       ({"num_host_blocks": 4, "d2h_bandwidth_gbps": -1.0}, "d2h_bandwidth_gbps"),
                                       ({"num_host_blocks": 4, "latency_to_first_byte_ms": float("nan")},
                                        "latency_to_first_byte_ms")])
def test_host_offload_knobs_are_range_checked(kw, field):
    with pytest.raises(InvalidArgument) as exc:
        HostOffloadConfig(**kw)
    assert exc.value.field == field


def test_defaults_are_the_references():
    c = HostOffloadConfig(num_host_blocks=1)
    assert (c.d2h_bandwidth_gbps, c.h2d_bandwidth_gbps, c.latency_to_first_byte_ms, c.scope) == (
        32.0, 32.0, 0.0, "dp_rank_local")
    assert EngineConfig().native_host_offload is None


# --------------------------------------------------------------------------------------- host tier


class Source:
    def __init__(self, hashes: list[int]) -> None:
        self.hashes = hashes


def tier(capacity: int = 4, latency_ms: float = 0.0) -> HostTier:
    cfg = HostOffloadConfig(num_host_blocks=capacity, d2h_bandwidth_gbps=0.064, h2d_bandwidth_gbps=0.032,
                            latency_to_first_byte_ms=latency_ms)
    return HostTier(cfg, 64, 1000, BlockPool(8, 64))  # a block: 64,000 bytes, 1 ms out, 2 ms back


def store(t: HostTier, hashes: list[int], now_ns: int) -> None:
    src = Source(hashes)
    t.stage(src, hashes, 0, len(hashes))
    t.submit(now_ns)


def test_a_store_takes_its_room_at_once_and_is_resident_when_its_copy_ends():
    t = tier(latency_ms=5.0)
    store(t, [1, 2, 3], 0)
    assert t.pending == {1: 8 * MS, 2: 8 * MS, 3: 8 * MS} and not t.resident
    t.poll(8 * MS - 1)
    assert not t.resident
    t.poll(8 * MS)
    assert set(t.resident) == {1, 2, 3} and not t.pending and t.stored_blocks == 3
    assert t.pool.log == [(HOST_STORED, [1, 2, 3], None, t.pool.log[0][3], 0)]
    t.check()


def test_the_lane_is_first_in_first_out():
    t = tier(capacity=8)
    store(t, [1, 2], 0)
    store(t, [3], MS)
    assert t.pending[3] == 3 * MS  # waits for the first copy (0 -> 2 ms), then 1 ms


def test_eviction_takes_the_oldest_epoch_then_the_smallest_signed_hash():
    t = tier(capacity=4)
    big = (1 << 64) - 5  # -5 as a signed 64-bit value: the smallest
    store(t, [10, big, 30], 0)
    t.poll(10 * MS)
    store(t, [40, 50], 10 * MS)
    assert t.pool.log[-1] == (HOST_REMOVED, [big])
    t.poll(20 * MS)
    store(t, [60], 20 * MS)
    assert t.pool.log[-1] == (HOST_REMOVED, [10])
    t.check()


def test_pinned_blocks_stay_and_a_cohort_that_cannot_fit_waits():
    t = tier(capacity=3)
    store(t, [1, 2, 3], 0)
    t.poll(10 * MS)
    end = t.load([1, 2, 3], 10 * MS)
    assert end == 16 * MS  # 3 blocks at 2 ms
    store(t, [4], 10 * MS)
    assert 4 not in t.pending and t.staged  # nothing evictable: retried at the next boundary
    t.loaded([1, 2, 3])
    t.submit(16 * MS)
    assert t.pending == {4: 17 * MS} and not t.staged
    t.check()


def test_a_cohort_larger_than_the_tier_is_never_stored():
    t = tier(capacity=2)
    store(t, [1, 2, 3], 0)
    assert not t.pending and not t.staged and not t.pool.log


def test_lookup_stops_at_the_first_missing_block_and_reports_a_store_to_wait_for():
    t = tier(capacity=8)
    store(t, [1, 2], 0)
    t.poll(5 * MS)
    store(t, [3], 5 * MS)
    assert t.lookup([1, 2, 3, 4], 0, 4) == (2, 6 * MS)
    assert t.lookup([9, 2], 0, 2) == (0, 0)


# ------------------------------------------------------------------------------------------ engine


def run(eng: VllmEngineCore, reqs: list[Request], records: list | None = None) -> list:
    """Step every pass; returns the KV events of each (``records`` receives the requests' live records)."""
    for r in reqs:
        rec = eng.add_request(r)
        if records is not None:
            records.append(rec)
    batches = []
    while (s := eng.next_pass_start_ns()) is not None:
        res = eng.step(s)
        eng.check_invariants()
        if res.events is not None:
            batches.append(res.events)
    return batches


def prompt(*ids: int) -> list[int]:
    return [i for i in ids for _ in range(512)]


def test_an_evicted_prompt_comes_back_from_the_host_with_cpu_events():
    eng = VllmEngineCore(host_config())
    reqs = [Request(request_id="a", token_ids=prompt(1, 2), max_tokens=2, arrival_ns=0),
            Request(request_id="b", token_ids=prompt(3, 4, 5)[:1216], max_tokens=2, arrival_ns=1000 * MS),
            Request(request_id="c", token_ids=prompt(1, 2), max_tokens=2, arrival_ns=2000 * MS)]
    records: list = []
    batches = run(eng, reqs, records)
    c = records[2]
    assert c.engine.admitted_ns == 2016 * MS  # 16 blocks loaded at 1 ms each
    assert (c.engine.cached_tokens, c.engine.host_cached_tokens) == (960, 960)
    assert records[0].engine.host_cached_tokens == 0
    wire = [ev for p in batches for ev in p.batch().events]
    cpu_stored = [ev for ev in wire if isinstance(ev, BlockStored) and ev.medium == MEDIUM_CPU]
    assert cpu_stored and cpu_stored[0].token_ids and cpu_stored[0].block_size == 64
    assert all(ev.medium in (MEDIUM_GPU, MEDIUM_CPU) for ev in wire if isinstance(ev, (BlockStored, BlockRemoved)))
    model = [p.router_batch() for p in batches]
    assert any(b.host_events for b in model) and all(
        not any(e.block_hashes == ev.block_hashes for e in b.events) for b in model for ev in b.host_events
        if isinstance(ev, BlockStored))
    assert eng.host is not None and eng.host.loaded_blocks == 16


def test_host_events_reach_the_host_tier_index_of_the_router():
    eng = VllmEngineCore(host_config())
    batches = run(eng, [Request(request_id="a", token_ids=prompt(1, 2), max_tokens=2, arrival_ns=0)])
    core = RoutingCore(block_size=64)
    stream = EventStream(1, 0, sink=core.apply_event, block_size=64, stats=WorkerEventStats())
    for i, p in enumerate(batches):
        stream.apply(i, p.router_batch())
    host = core.tier_indexes[StorageTier.HOST_PINNED]
    assert host.find_matches(local_block_hashes(prompt(1, 2), 64)) == {(1, 0): 16}


# ---------------------------------------------------------------------------------------- property


def with_offload(cfg: EngineConfig, host_blocks: int, gbps: float) -> EngineConfig:
    fields = {f: getattr(cfg, f) for f in cfg.__struct_fields__}
    fields.update(backend="vllm", enable_prefix_caching=True, kv_cache_bytes_per_token=50,
                  native_host_offload=HostOffloadConfig(num_host_blocks=host_blocks, d2h_bandwidth_gbps=gbps,
                                                        h2d_bandwidth_gbps=gbps / 2))
    return EngineConfig(**fields)


def stepwise(cfg: EngineConfig, reqs: list[Request]):
    eng = VllmEngineCore(cfg)
    done, batches, firsts, preempted = [], [], [], []
    for res in islice(steps(eng, reqs), 100_000):
        done += res.completed
        firsts += [(rid, res.end_ns) for rid in res.first_tokens]
        preempted += [(rid, res.end_ns) for rid in res.preempted]
        if res.events is not None:
            batches.append(res.kv_batch)
    assert len(done) == len(reqs)
    return summary(done), batches, firsts, preempted, eng.passes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads(), st.integers(1, 30), st.sampled_from([0.0, 1e-4, 1e-3, 0.05]), st.randoms(use_true_random=False))
def test_fast_forward_equals_stepwise_with_host_offload(work, host_blocks, gbps, rng: random.Random):
    cfg, reqs, checkpoints = work
    cfg = with_offload(cfg, host_blocks, gbps)
    reqs = [Request(request_id=r.request_id, token_ids=r.token_ids, max_tokens=r.max_tokens, arrival_ns=r.arrival_ns,
                    priority=r.priority, output_token_ids=r.output_token_ids) for r in reqs]
    ref = stepwise(cfg, reqs)
    ff = fast_forward(cfg, reqs, checkpoints, rng)
    assert ff[0] == ref[0]  # every request: admission, first token, every token time, completion, hits
    assert ff[1] == ref[1]  # KV event batches (GPU and CPU), in order, with their timestamps
    assert ff[2:] == ref[2:]
    assert MAX_TIME_NS > 0


def test_tier_index_counts_blocks_past_a_start_and_removes_only_what_is_named():
    from kvemu.hashing import sequence_hashes
    from kvemu.tier_index import TierIndex

    locs = [11, 12, 13, 14, 15]
    paths = sequence_hashes(locs)
    index = TierIndex()
    index.store(0, locs, paths, sequence_hashed=True)
    index.remove(0, [paths[1]])  # a hole: the blocks after it stay
    assert index.find_matches(locs) == {(0, 0): 1}
    assert index.runs_from(paths, {(0, 0): 2}) == {(0, 0): 3}
    index.store(1, locs[3:], paths[3:], parent_hash=999)  # unknown parent, external hashes: dropped
    assert index.dropped_stores == 1 and (1, 0) not in index.runs_from(paths, {(1, 0): 3})
    index.store(1, locs[3:], paths[3:], parent_hash=paths[2], sequence_hashed=True)
    assert index.runs_from(paths, {(0, 0): 2, (1, 0): 3}) == {(0, 0): 3, (1, 0): 2}
    index.remove_worker(0)
    assert index.runs_from(paths, {(0, 0): 2}) == {}
