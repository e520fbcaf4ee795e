"""Fast-forward (advance_to / next_event_ns) gives exactly what stepping every pass gives."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu.clock import MAX_TIME_NS
from kvemu.transfer import KvTransfer
from kvemu.kv_events import BlockRemoved, BlockStored
from workers.config import (EngineConfig, InterpolatedTimingSpec, KvGroupSpec, PolynomialTimingSpec, SglangConfig,
                            SpeculativeConfig)
from workers.vllm.hybrid import max_blocks
from workers.vllm.engine import AdvanceResult, VllmEngineCore
from workers.mock_worker import engine_core
from workers.request import Request

from tests.engine_runs import steps

MS = 1_000_000


TRANSFERS = [KvTransfer(source_worker_id=9), KvTransfer(source_worker_id=9, bandwidth_gbps=1e-4, bytes_per_token=40),
             KvTransfer(source_worker_id=9, bandwidth_gbps=1e-3, bytes_per_token=300, mode="destination_missing")]
"""Decode legs: their prompt's KV arrives from a prefill rank, instantly or after a transfer (4 ms / 3 ms a token)."""
PROFILE = InterpolatedTimingSpec(path=str(Path(__file__).parents[1] / "data" / "tiny-profile.csv"))
"""A batch-aware timing model: decode time depends on the mean context as well."""


def kv_groups(draw, bs: int):
    """A hybrid model's layer kinds (full attention, sliding windows of a few blocks, state layers)."""
    window = draw(st.sampled_from([2, 3, bs + 1, 2 * bs, 3 * bs + 2]))
    layers = st.integers(1, 4)
    full = KvGroupSpec(kind="full_attention", layers=draw(layers))
    swa = KvGroupSpec(kind="sliding_window", layers=draw(layers), window=window)
    state = KvGroupSpec(kind="state", layers=draw(layers), cache_mode=draw(st.sampled_from([None, "align", "all"])))
    return draw(st.sampled_from([[full, swa], [swa, full], [full, state], [swa], [state], [full, swa, state],
                                 [full, KvGroupSpec(kind="sliding_window", layers=1, window=window + bs), swa]]))


@st.composite
def workloads(draw, hybrid: float = 0.0):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    blocks = draw(st.integers(3, 40))
    max_seqs = draw(st.integers(1, 5))
    backend = draw(st.sampled_from(["vllm", "vllm", "trtllm", "sglang"]))
    sglang = SglangConfig(
        schedule_policy=draw(st.sampled_from(["fifo", "fifo", "lpm"])),
        chunked_prefill_size=bs * draw(st.integers(1, 12)),
        max_prefill_tokens=draw(st.integers(1, 64)),
        clip_max_new_tokens=draw(st.sampled_from([4096, 8, 0])),
        schedule_conservativeness=draw(st.sampled_from([1.0, 0.3])),
        prefill_decode_interval=draw(st.sampled_from([0, 0, 2])),
    )
    cfg = EngineConfig(
        backend=backend,
        sglang=sglang,
        timing_model=draw(st.sampled_from([PolynomialTimingSpec(), PolynomialTimingSpec(), PROFILE])),
        num_gpu_blocks=blocks,
        block_size=bs,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=draw(st.integers(max_seqs, 48)),
        enable_prefix_caching=draw(st.sampled_from([True, True, True, False])),
        enable_chunked_prefill=True if backend == "sglang" else draw(st.sampled_from([True, True, False])),
        speedup_ratio=draw(st.sampled_from([1.0, 1.0, 7.0, 0.0])),
        decode_speedup_ratio=draw(st.sampled_from([1.0, 1.0, 2.5, 0.0])),
        preemption_mode=draw(st.sampled_from(["lifo", "fifo"])),
        eviction_policy=draw(st.sampled_from(["lru", "lineage"])),
    )
    if backend == "vllm" and hybrid and draw(st.floats(0, 1)) < hybrid:
        cfg = msgspec.structs.replace(cfg, kv_groups=kv_groups(draw, bs), eviction_policy="lru",
                                      max_num_batched_tokens=max(cfg.max_num_batched_tokens, bs))  # (align: >= a block)
    capacity = blocks * bs
    limit = capacity if cfg.enable_chunked_prefill else min(capacity, cfg.max_num_batched_tokens)
    if cfg.backend == "trtllm":  # it reserves prompt + max_tokens, the last token's KV included
        limit = min(limit, capacity - 1)
    if cfg.backend == "sglang":  # a prompt must leave room for output in the pool less a page (outputs are clipped)
        limit = capacity - bs - 1
    if cfg.kv_groups:  # what one request may hold at once over every group must fit the pool
        limit = cfg.pool_blocks * bs
        if not cfg.enable_chunked_prefill:
            limit = min(limit, cfg.max_num_batched_tokens)
        while max_blocks(cfg, limit) > cfg.pool_blocks:
            limit -= 1
    prefixes = [[p] * draw(st.integers(0, 3 * bs)) for p in range(3)]
    shared_outputs = draw(st.booleans())
    reqs = []
    for i in range(draw(st.integers(1, 8))):
        prompt = prefixes[draw(st.integers(0, 2))] + [1000 + 100 * i + k for k in range(draw(st.integers(1, 3 * bs)))]
        max_tokens = draw(st.integers(1, 24))
        if len(prompt) + max_tokens - 1 > limit:  # keep it acceptable: shrink output, then prompt
            max_tokens = max(1, limit - len(prompt) + 1)
            prompt = prompt[: limit - max_tokens + 1]
        reqs.append(
            Request(
                request_id=f"r{i}",
                token_ids=prompt,
                max_tokens=max_tokens,
                arrival_ns=draw(st.integers(0, 40)) * 3 * MS,
                priority=draw(st.sampled_from([0, 0, 1])),
                output_token_ids=[5] * max_tokens if shared_outputs else None,
                kv_transfer=None if backend == "sglang" else draw(st.sampled_from([None, None, None, *TRANSFERS])),
            )
        )
    checkpoints = sorted(draw(st.lists(st.integers(0, 300 * MS), max_size=6)))
    return cfg, reqs, checkpoints


def summary(records) -> dict:
    return {
        r.request_id: (
            r.arrival_ns,
            r.engine.admitted_ns,
            r.first_token_ns,
            r.completion_ns,
            r.engine.cached_tokens,
            r.output_tokens,
            r.engine.preemptions,
            tuple(r.token_times_ns),
            r.kv_reserved_ns,
            r.kv_activated_ns,
        )
        for r in records
    }


def transfers(eng) -> int:
    """Decode legs whose KV is in transit (the SGLang flavour runs none)."""
    return len(eng.scheduler.transfers) if isinstance(eng, VllmEngineCore) else 0


def cached_hashes(eng) -> set[int]:
    return eng.pool.cached_hashes() if isinstance(eng, VllmEngineCore) else eng.cache.cached_hashes()


def stepwise(cfg, reqs):
    eng = engine_core(cfg)
    done, batches, firsts, preempted = [], [], [], []
    announced: set[int] = set()
    idle = 0
    for res in steps(eng, reqs):
        if res.idle:  # a decode leg reserved its blocks; its transfer runs
            idle += 1
            assert transfers(eng) and idle < 1000, (res.start_ns, eng)
            continue
        done += res.completed
        firsts += [(rid, res.end_ns) for rid in res.first_tokens]
        preempted += [(rid, res.end_ns) for rid in res.preempted]
        if res.events is not None:
            batch = res.kv_batch
            batches.append(batch)
            for ev in batch.events:  # stores are new blocks; removals name cached ones (per KV cache group)
                group = (ev.group_idx or 0) << 64
                if isinstance(ev, BlockStored):
                    keys = [h + group for h in ev.block_hashes]
                    assert announced.isdisjoint(keys)
                    announced.update(keys)
                else:
                    assert isinstance(ev, BlockRemoved) and ev.block_hashes[0] + group in announced
                    announced.discard(ev.block_hashes[0] + group)
        # blocks announced minus blocks removed == what the pool caches, after every pass
        assert announced == cached_hashes(eng)
    assert len(done) == len(reqs)
    return summary(done), batches, firsts, preempted, eng.passes


class Collect:
    def __init__(self) -> None:
        self.done, self.batches, self.firsts, self.preempted, self.passes = [], [], [], [], 0

    def add(self, out: AdvanceResult) -> None:
        self.done += out.completed
        self.batches += out.kv_batches
        self.firsts += out.first_tokens
        self.preempted += out.preempted
        self.passes += out.passes

    def result(self, n: int):
        assert len(self.done) == n
        return summary(self.done), self.batches, self.firsts, self.preempted, self.passes


def fast_forward(cfg, reqs, checkpoints, rng: random.Random):
    """Host that adds requests lazily (never after advancing past their arrival) and advances in jumps."""
    eng = engine_core(cfg)
    pending = sorted(reqs, key=lambda r: r.arrival_ns)
    c = Collect()
    for t in checkpoints:
        while pending and pending[0].arrival_ns < t:
            eng.add_request(pending.pop(0))
        if t >= eng.now_ns:
            c.add(eng.advance_to(t))
            eng.check_invariants()
        while pending and pending[0].arrival_ns == eng.now_ns and rng.random() < 0.5:
            eng.add_request(pending.pop(0))  # arriving exactly now: still joins the pass starting now
    for r in pending:
        eng.add_request(r)
    c.add(eng.advance_to(MAX_TIME_NS))
    eng.check_invariants()
    assert eng.next_event_ns() is None and eng.num_unfinished == 0
    return c.result(len(reqs))


def event_driven(cfg, reqs):
    """Host that jumps from one next_event_ns to the next and checks nothing visible happens earlier."""
    eng = engine_core(cfg)
    pending = sorted(reqs, key=lambda r: r.arrival_ns)
    c = Collect()
    stalls = 0
    for _ in range(100_000):
        te = eng.next_event_ns()
        ta = pending[0].arrival_ns if pending else None
        if te is None and ta is None:
            break
        if ta is not None and (te is None or ta <= te):
            c.add(eng.advance_to(ta))
            while pending and pending[0].arrival_ns == ta:
                eng.add_request(pending.pop(0))
            continue
        assert te > eng.now_ns
        if te - 1 > eng.now_ns:
            quiet = eng.advance_to(te - 1)
            assert not (quiet.first_tokens or quiet.completed or quiet.events or quiet.preempted), te
            c.passes += quiet.passes
        before = (eng.passes, eng.busy_until_ns, eng.num_running, transfers(eng))
        out = eng.advance_to(te)
        c.add(out)
        after = (eng.passes, eng.busy_until_ns, eng.num_running, transfers(eng))
        if out.passes or after != before or eng._inflight is not None:  # a pass, or a decode leg's reservation
            stalls = 0
        else:  # an idle engine found its waiting requests kept out by reserved KV: once, then it knows
            stalls += 1
            assert stalls == 1 and transfers(eng), te
    else:  # pragma: no cover
        raise AssertionError("event-driven host made no progress")
    eng.check_invariants()
    return c.result(len(reqs))


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads(), st.randoms(use_true_random=False))
def test_fast_forward_equals_stepwise(work, rng):
    cfg, reqs, checkpoints = work
    ref = stepwise(cfg, reqs)
    ff = fast_forward(cfg, reqs, checkpoints, rng)
    assert ff[0] == ref[0]  # every request: admission, first token, every token time, completion, hits
    assert ff[1] == ref[1]  # KV event batches, in order, with their timestamps
    assert ff[2:] == ref[2:]
    ev = event_driven(cfg, reqs)
    assert ev[:4] == ref[:4]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads(hybrid=1.0), st.randoms(use_true_random=False))
def test_fast_forward_equals_stepwise_with_kv_groups(work, rng):
    # hybrid KV cache groups (full attention, sliding windows, state layers in one pool): the same contract,
    # with speculative decoding on a third of them
    cfg, reqs, checkpoints = work
    if cfg.kv_groups and rng.random() < 0.33:
        cfg = msgspec.structs.replace(cfg, decode_speedup_ratio=1.0, speculative=SpeculativeConfig(
            method="mtp", num_speculative_tokens=rng.randint(1, 3), seed=rng.randint(0, 3)))
    ref = stepwise(cfg, reqs)
    assert ff_equal(cfg, reqs, checkpoints, rng, ref)


@st.composite
def speculative_workloads(draw):
    """``workloads`` on an engine that decodes speculatively (bursts of 1 .. k + 1 tokens)."""
    cfg, reqs, checkpoints = draw(workloads())
    k = draw(st.integers(1, 4))
    rates = draw(st.one_of(st.none(), st.floats(0, 1), st.lists(st.floats(0, 1), min_size=1, max_size=k)))
    spec = SpeculativeConfig(method=draw(st.sampled_from(["mtp", "eagle", "ngram"])), num_speculative_tokens=k,
                             acceptance_rates=rates, seed=draw(st.integers(0, 3)))
    cfg = msgspec.structs.replace(cfg, decode_speedup_ratio=1.0, speculative=spec)
    return cfg, reqs, checkpoints


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(speculative_workloads(), st.randoms(use_true_random=False))
def test_fast_forward_equals_stepwise_with_speculative_decoding(work, rng):
    # decode runs and look-ahead read the rank's draws ahead; they must use exactly the draws stepping uses
    cfg, reqs, checkpoints = work
    ref = stepwise(cfg, reqs)
    assert ff_equal(cfg, reqs, checkpoints, rng, ref)


def ff_equal(cfg, reqs, checkpoints, rng, ref) -> bool:
    ff = fast_forward(cfg, reqs, checkpoints, rng)
    assert ff[0] == ref[0]
    assert ff[1] == ref[1]
    assert ff[2:] == ref[2:]
    ev = event_driven(cfg, reqs)
    assert ev[:4] == ref[:4]
    return True


def test_long_run_with_eviction_and_preemption_matches_stepwise():
    rng = random.Random(11)
    cfg = EngineConfig(num_gpu_blocks=60, block_size=8, max_num_seqs=6, max_num_batched_tokens=96)
    shared = [list(range(s * 100, s * 100 + 8 * rng.randint(1, 6))) for s in range(4)]
    reqs = []
    t = 0
    for i in range(120):
        t += rng.randint(0, 60) * MS
        prompt = shared[rng.randrange(4)] + [10_000 + i * 50 + k for k in range(rng.randint(1, 40))]
        reqs.append(Request(request_id=f"q{i}", token_ids=prompt, max_tokens=rng.randint(1, 150), arrival_ns=t))
    ref = stepwise(cfg, reqs)
    ff = fast_forward(cfg, reqs, sorted(rng.randrange(t) for _ in range(30)), rng)
    assert ff == ref
    summ = ref[0]
    assert sum(v[6] for v in summ.values()) > 0, "the workload should preempt"
    assert any(v[4] for v in summ.values()), "the workload should hit cached prefixes"


def test_next_event_is_exact_during_a_decode_run():
    cfg = EngineConfig(num_gpu_blocks=64, block_size=16)
    eng = VllmEngineCore(cfg)
    rec = eng.add_request(Request(request_id="a", token_ids=list(range(20)), max_tokens=40))
    eng.advance_to(1)  # the prefill pass is in flight
    t_first = eng.next_event_ns()
    out = eng.advance_to(t_first)
    assert out.first_tokens == [("a", t_first)]
    # the next visible change is the store of block 1 (positions 16..31), filled by decode pass 12
    t_store = eng.next_event_ns()
    quiet = eng.advance_to(t_store - 1)
    assert not quiet.events and quiet.passes == 11
    out = eng.advance_to(t_store)
    assert len(out.events) == 1 and out.events[0].ts_ns == t_store
    assert rec.token_times_ns[-1] == t_store and rec.output_tokens == 13
    # from here on every reported time is exactly a store (blocks 2 at 48 tokens) or the completion
    seen = []
    while (t := eng.next_event_ns()) is not None:
        out = eng.advance_to(t)
        kinds = [("store", e.ts_ns) for e in out.events] + [("done", r.completion_ns) for r in out.completed]
        assert kinds and all(ts == t for _, ts in kinds)
        seen += [k for k, _ in kinds]
    assert seen == ["store", "done"] and rec.output_tokens == 40 and rec.completion_ns == rec.token_times_ns[-1]


@pytest.mark.parametrize("extra", [
    {},
    {"speculative": SpeculativeConfig(method="mtp", num_speculative_tokens=2, acceptance_rates=0.5)},
    {"kv_groups": [KvGroupSpec(kind="full_attention", layers=2),
                   KvGroupSpec(kind="sliding_window", layers=2, window=32)]},
], ids=["plain", "speculative", "hybrid"])
def test_a_steady_decode_batch_is_committed_by_decode_runs(extra):
    """The fast path really runs: a batch that only decodes is committed as runs, not scheduled pass by pass
    (reports cannot show it: stepping gives the same bytes, only slower)."""
    eng = VllmEngineCore(EngineConfig(num_gpu_blocks=512, block_size=16, **extra))
    for i in range(4):
        eng.add_request(Request(request_id=f"r{i}", token_ids=list(range(i * 100, i * 100 + 40)), max_tokens=300))
    eng.advance_to(MAX_TIME_NS)
    assert eng.num_unfinished == 0
    assert eng.run_passes > 0.8 * eng.passes, (eng.run_passes, eng.passes)


def test_zero_duration_passes_are_reported_one_nanosecond_later():
    eng = VllmEngineCore(EngineConfig(num_gpu_blocks=64, block_size=4, speedup_ratio=0))
    rec = eng.add_request(Request(request_id="a", token_ids=list(range(6)), max_tokens=3, arrival_ns=500))
    assert eng.next_event_ns() == 501
    out = eng.advance_to(501)
    assert rec.token_times_ns == [500, 500, 500] and [r.request_id for r in out.completed] == ["a"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_lru_and_lineage_evict_the_same_blocks(work):
    # sequences release their blocks tail first, so LRU never evicts a block before its cached children
    cfg, reqs, _ = work
    lru = stepwise(msgspec.structs.replace(cfg, eviction_policy="lru"), reqs)
    lineage = stepwise(msgspec.structs.replace(cfg, eviction_policy="lineage"), reqs)
    assert lru == lineage


def test_hybrid_look_ahead_stops_where_a_freed_block_may_admit_a_waiting_request():
    # a request waits for blocks while one decodes; the window frees a block before a pass: the look-ahead must not
    # jump past that pass (found by the explore profile: the waiting request's first token came before the horizon)
    cfg = EngineConfig(num_gpu_blocks=6, block_size=4, max_num_seqs=2, max_num_batched_tokens=13, kv_groups=[
        KvGroupSpec(kind="full_attention", layers=1), KvGroupSpec(kind="sliding_window", layers=1, window=3)])
    z = [0] * 12
    reqs = [Request(request_id="r0", token_ids=z + [1000], max_tokens=1, arrival_ns=36 * MS),
            Request(request_id="r1", token_ids=z + [1100], max_tokens=1),
            Request(request_id="r2", token_ids=z + [1200], max_tokens=1),
            Request(request_id="r3", token_ids=z + list(range(1300, 1307)), max_tokens=6)]
    assert event_driven(cfg, reqs)[:4] == stepwise(cfg, reqs)[:4]


def test_hybrid_look_ahead_sees_a_preemption_in_a_completing_pass():
    # r0 completes in the pass that preempts r1, which makes the pass shorter: the look-ahead must not promise
    # the completion at the end of the pass as if both decoded (found by the explore profile)
    cfg = EngineConfig(num_gpu_blocks=3, block_size=1, max_num_seqs=2, max_num_batched_tokens=2, kv_groups=[
        KvGroupSpec(kind="full_attention", layers=1), KvGroupSpec(kind="sliding_window", layers=1, window=2)])
    reqs = [Request(request_id="r0", token_ids=[1000], max_tokens=2),
            Request(request_id="r1", token_ids=[1100], max_tokens=2)]
    assert event_driven(cfg, reqs)[:4] == stepwise(cfg, reqs)[:4]


def test_a_decode_leg_lands_an_align_state_block_uncached_even_when_its_prompt_is_cached():
    # the whole 1-block prompt is cached here (r0 computed it); the leg's align state block lands uncached, so its
    # cached prefix stops before that block (found by the explore profile: the engine's holdings lost count)
    cfg = EngineConfig(num_gpu_blocks=3, block_size=1, max_num_seqs=1, max_num_batched_tokens=1,
                       enable_chunked_prefill=False, kv_groups=[KvGroupSpec(kind="full_attention", layers=1),
                                                                KvGroupSpec(kind="state", layers=1)])
    reqs = [Request(request_id="r0", token_ids=[1], max_tokens=1),
            Request(request_id="r1", token_ids=[1], max_tokens=1, arrival_ns=3 * MS, kv_transfer=TRANSFERS[0])]
    ref = stepwise(cfg, reqs)
    assert event_driven(cfg, reqs)[:4] == ref[:4]
