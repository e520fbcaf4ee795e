"""Engine core behaviour: prefix reuse, chunked prefill, admission limits, preemption, KV events, DP ranks."""

from __future__ import annotations

import msgspec
import pytest

from kvemu.clock import MAX_TIME_NS
from kvemu.errors import InvalidArgument
from kvemu.hashing import local_block_hashes, sequence_hashes
from kvemu.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from workers.config import EngineConfig
from workers.vllm.engine import VllmEngineCore, StepResult
from workers.request import Request
from workers.mock_worker import MockWorker

from tests.engine_runs import steps


def req(rid: str, tokens, max_tokens: int = 4, arrival_ns: int = 0, **kw) -> Request:
    return Request(request_id=rid, token_ids=list(tokens), max_tokens=max_tokens, arrival_ns=arrival_ns, **kw)


def small(**kw) -> EngineConfig:
    base = dict(num_gpu_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    base.update(kw)
    return EngineConfig(**base)


class Ledger:
    """Replays KV event batches: a store must be new, a removal must name a stored block."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.stored = 0
        self.removed = 0

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert ev.block_size > 0 and ev.medium == "GPU"
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                if ev.parent_block_hash is not None:
                    assert ev.parent_block_hash in self.cached, "parent must be cached"
                for h in ev.block_hashes:
                    assert h not in self.cached, "BlockStored only for genuinely new blocks"
                    self.cached.add(h)
                self.stored += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert len(ev.block_hashes) == 1, "one BlockRemoved per evicted block"
                (h,) = ev.block_hashes
                assert h in self.cached
                self.cached.discard(h)
                self.removed += 1
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.cached.clear()


def run_steps(eng: VllmEngineCore, ledger: Ledger | None = None) -> list[StepResult]:
    """Reference driver: step at every pass start until nothing is left, checking invariants each pass."""
    out = []
    for r in steps(eng):
        out.append(r)
        if ledger is not None and r.kv_batch is not None:
            ledger.apply(r.kv_batch)
            assert ledger.cached == eng.pool.cached_hashes()
    return out


def records(eng: VllmEngineCore, reqs: list[Request], steps: list[StepResult]) -> dict:
    done = {r.request_id: r for s in steps for r in s.completed}
    assert set(done) == {r.request_id for r in reqs}
    return done


# ------------------------------------------------------------------------------------ prefix reuse


def test_prefix_hit_on_a_finished_request_skips_cached_blocks():
    eng = VllmEngineCore(small())
    led = Ledger()
    a = req("a", range(40), max_tokens=2)
    eng.add_request(a)
    steps = run_steps(eng, led)
    b = req("b", [*range(32), 900, 901, 902, 903, 904], max_tokens=2, arrival_ns=eng.busy_until_ns)
    rb = eng.add_request(b)
    first = eng.step(eng.next_pass_start_ns())
    assert rb.engine.cached_tokens == 32 and first.prefill_tokens == 5
    (stored,) = [e for e in first.kv_batch.events if isinstance(e, BlockStored)]
    a_hashes = sequence_hashes(local_block_hashes(list(range(40)), 4))
    b_hashes = sequence_hashes(local_block_hashes(list(b.token_ids), 4))
    assert stored.block_hashes == [b_hashes[8]] and stored.parent_block_hash == a_hashes[7]
    assert stored.token_ids == [900, 901, 902, 903]
    led.apply(first.kv_batch)
    run_steps(eng, led)
    assert led.cached == eng.pool.cached_hashes()
    assert steps[0].kv_batch.events[0].block_hashes == a_hashes  # prompt blocks carry the sequence hashes


def test_kv_usage_counts_the_blocks_requests_hold_and_not_the_merely_cached():
    eng = VllmEngineCore(small())
    assert eng.kv_usage == 0.0
    eng.add_request(req("a", range(40), max_tokens=8))
    eng.step(eng.next_pass_start_ns())  # the prompt's 10 full blocks are cached and held by "a"
    assert eng.kv_usage == eng.pool.num_active_blocks / 64 >= 10 / 64
    run_steps(eng)
    assert eng.kv_usage == 0.0 and eng.pool.cached_hashes()  # finished: still cached, no longer in use


def test_identical_prompt_recomputes_only_the_last_block():
    eng = VllmEngineCore(small())
    eng.add_request(req("a", range(40), max_tokens=1))
    run_steps(eng)
    rb = eng.add_request(req("b", range(40), max_tokens=1, arrival_ns=eng.busy_until_ns))
    r = eng.step(eng.next_pass_start_ns())
    assert rb.engine.cached_tokens == 36 and r.prefill_tokens == 4  # the last prompt token must be computed
    assert r.kv_batch is None  # the recomputed block exists already: no event


def test_active_prefix_is_shared_with_a_running_request():
    eng = VllmEngineCore(small())
    ra = eng.add_request(req("a", range(24), max_tokens=20))
    eng.step(0)
    rb = eng.add_request(req("b", [*range(16), 77, 78], max_tokens=2, arrival_ns=eng.busy_until_ns))
    eng.step(eng.busy_until_ns)
    assert rb.engine.cached_tokens == 16 and ra.engine.cached_tokens == 0
    a_hashes = sequence_hashes(local_block_hashes(list(range(24)), 4))
    assert all(eng.pool.active[h] == 2 for h in a_hashes[:4])


def test_prefix_caching_disabled_never_hits_nor_emits():
    eng = VllmEngineCore(small(enable_prefix_caching=False))
    eng.add_request(req("a", range(40), max_tokens=2))
    eng.add_request(req("b", range(40), max_tokens=2, arrival_ns=10**9))
    steps = run_steps(eng)
    done = {r.request_id: r for s in steps for r in s.completed}
    assert done["b"].engine.cached_tokens == 0
    assert all(s.kv_batch is None for s in steps)
    assert eng.pool.free == eng.pool.num_blocks and not eng.pool.cached_hashes()


def test_decode_blocks_hash_the_generated_tokens():
    eng = VllmEngineCore(small())
    outs = [500 + i for i in range(8)]
    eng.add_request(req("a", range(8), max_tokens=8, output_token_ids=outs))
    run_steps(eng)
    # KV exists for the prompt + 7 of the 8 generated tokens: blocks [0..7], [8..11]+[500..503] partly
    follow = [*range(8), *outs[:4], 1, 2, 3]
    rb = eng.add_request(req("b", follow, max_tokens=1, arrival_ns=eng.busy_until_ns))
    eng.step(eng.next_pass_start_ns())
    assert rb.engine.cached_tokens == 12


# ------------------------------------------------------------------------------- chunked prefill


def test_chunked_prefill_splits_a_prompt_across_passes():
    eng = VllmEngineCore(small(max_num_batched_tokens=32))
    rec = eng.add_request(req("a", range(100), max_tokens=2))
    steps = run_steps(eng)
    assert [s.prefill_tokens for s in steps[:4]] == [32, 32, 32, 4]
    assert [len(s.kv_batch.events[0].block_hashes) for s in steps[:4]] == [8, 8, 8, 1]
    assert rec.first_token_ns == steps[3].end_ns and steps[2].first_tokens == []
    assert rec.token_times_ns == [steps[3].end_ns, steps[4].end_ns]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    eng = VllmEngineCore(small(enable_chunked_prefill=False, max_num_batched_tokens=100))
    eng.add_request(req("a", range(60), max_tokens=2))
    eng.add_request(req("b", range(1000, 1060), max_tokens=2))
    first = eng.step(0)
    assert first.admitted == ["a"] and first.prefill_tokens == 60
    second = eng.step(first.end_ns)
    assert second.admitted == ["b"] and second.prefill_tokens == 60 and second.decodes == 1


def test_decodes_are_served_before_prefill_chunks():
    eng = VllmEngineCore(small(max_num_batched_tokens=16))
    eng.add_request(req("a", range(4), max_tokens=5))
    eng.step(0)
    eng.add_request(req("b", range(100, 140), max_tokens=1, arrival_ns=eng.busy_until_ns))
    s = eng.step(eng.busy_until_ns)
    assert s.decodes == 1 and s.prefill_tokens == 15 and s.tokens == ["a"]


def test_max_num_seqs_limits_running_requests():
    eng = VllmEngineCore(small(max_num_seqs=2))
    for i in range(3):
        eng.add_request(req(f"r{i}", range(10 * i, 10 * i + 6), max_tokens=3))
    s = eng.step(0)
    assert s.admitted == ["r0", "r1"] and eng.num_running == 2
    steps = [s, *run_steps(eng)]
    admitted_at = {rid: k for k, st in enumerate(steps) for rid in st.admitted}
    completed_at = {r.request_id: k for k, st in enumerate(steps) for r in st.completed}
    assert admitted_at["r2"] == completed_at["r0"] + 1


def test_priority_orders_the_waiting_queue():
    eng = VllmEngineCore(small(max_num_seqs=1))
    eng.add_request(req("low", range(8), max_tokens=1, priority=5))
    eng.add_request(req("high", range(100, 108), max_tokens=1, priority=0))
    assert eng.step(0).admitted == ["high"]


def test_request_is_not_scheduled_before_its_arrival():
    eng = VllmEngineCore(small())
    eng.add_request(req("a", range(8), max_tokens=1, arrival_ns=5_000))
    idle = eng.step(1_000)
    assert idle.idle and idle.duration_ns == 0
    assert eng.next_pass_start_ns() == 5_000
    assert eng.step(5_000).admitted == ["a"]


# ---------------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("mode", ["lifo", "fifo"])
def test_preemption_recomputes_without_losing_or_duplicating_tokens(mode):
    cfg = small(num_gpu_blocks=8, max_num_batched_tokens=16, preemption_mode=mode)
    eng = VllmEngineCore(cfg)
    led = Ledger()
    reqs = [req("a", range(8), max_tokens=14), req("b", range(100, 108), max_tokens=14)]
    for r in reqs:
        eng.add_request(r)
    steps = run_steps(eng, led)
    done = records(eng, reqs, steps)
    victim = "b" if mode == "lifo" else "a"
    assert done[victim].engine.preemptions >= 1
    assert done["a" if victim == "b" else "b"].engine.preemptions == 0
    preempted = [rid for s in steps for rid in s.preempted]
    assert preempted and set(preempted) == {victim}
    for rec in done.values():
        assert rec.output_tokens == 14 and len(rec.token_times_ns) == 14
        assert rec.token_times_ns == sorted(set(rec.token_times_ns))  # one token per pass, never twice
        assert rec.completion_ns == rec.token_times_ns[-1]
    # every pass gave each request at most one token, and the victim got none while it was out
    per_pass = [s.tokens for s in steps]
    assert all(len(t) == len(set(t)) for t in per_pass)
    assert sum(t.count(victim) for t in per_pass) == 14
    assert led.cached == eng.pool.cached_hashes()


def test_preempted_request_reuses_its_cached_blocks_on_recompute():
    cfg = small(num_gpu_blocks=8, max_num_batched_tokens=16)
    eng = VllmEngineCore(cfg)
    eng.add_request(req("a", range(8), max_tokens=14))
    eng.add_request(req("b", range(100, 108), max_tokens=14))
    steps = run_steps(eng)
    readmits = [k for k, s in enumerate(steps) if "b" in s.admitted]
    assert len(readmits) >= 2
    again = steps[readmits[1]]
    # b re-prefills prompt + its generated tokens, minus what is still cached
    assert again.prefill_tokens < 8 + 14


# ----------------------------------------------------------------------------------- KV events


def test_events_round_trip_through_msgpack_and_the_wire_codec():
    eng = VllmEngineCore(small(num_gpu_blocks=12))
    for i in range(5):
        prompt = [i % 2] * 12 + list(range(i * 50, i * 50 + 10))
        eng.add_request(req(f"r{i}", prompt, max_tokens=6, arrival_ns=i * 10**7))
    steps = run_steps(eng)
    batches = [s.kv_batch for s in steps if s.kv_batch is not None]
    kinds = {type(e) for b in batches for e in b.events}
    assert kinds == {BlockStored, BlockRemoved}
    try:
        from kvemu.wire import codec
    except ImportError:  # pragma: no cover - the codec is written separately
        codec = None
    for b in batches:
        assert b.data_parallel_rank == 0 and b.ts > 0
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(b), type=KVEventBatch) == b
        if codec is not None:
            assert codec.decode_batch(codec.encode_batch(b)) == b


def test_ledger_matches_pool_under_eviction_pressure():
    eng = VllmEngineCore(small(num_gpu_blocks=10, max_num_batched_tokens=16))
    led = Ledger()
    for i in range(12):
        prompt = [7] * (4 * (i % 3)) + list(range(i * 30, i * 30 + 9))
        eng.add_request(req(f"r{i}", prompt, max_tokens=5, arrival_ns=i * 3 * 10**7))
    run_steps(eng, led)
    assert led.removed > 0 and led.stored - led.removed == len(eng.pool.cached_hashes())


def test_reset_prefix_cache_emits_all_blocks_cleared():
    eng = VllmEngineCore(small())
    eng.add_request(req("a", range(12), max_tokens=30))
    eng.step(0)
    assert eng.reset_prefix_cache(eng.busy_until_ns) is None  # refused while a request holds blocks
    run_steps(eng)
    ev = eng.reset_prefix_cache(eng.busy_until_ns)
    assert ev.batch().events == [AllBlocksCleared()] and ev.batch().data_parallel_rank == 0
    assert not eng.pool.cached_hashes() and eng.pool.free == eng.pool.num_blocks


def test_record_token_times_can_be_turned_off():
    eng = VllmEngineCore(small(record_token_times=False))
    rec = eng.add_request(req("a", range(8), max_tokens=50))
    eng.advance_to(MAX_TIME_NS)
    assert rec.token_times_ns == [] and rec.output_tokens == 50 and rec.completion_ns > rec.first_token_ns


# ------------------------------------------------------------------------------------- DP ranks


def test_dp_ranks_share_no_blocks_and_tag_their_events():
    w = MockWorker(small(dp_size=2), worker_id=3, dp_start_rank=4)
    assert list(w.dp_ranks) == [4, 5]
    prompt = list(range(40))
    w.dispatch(req("a", prompt, max_tokens=3), dp_rank=4).raise_if_rejected()
    w.advance_to(10**10)
    rb = w.dispatch(req("b", prompt, max_tokens=3, arrival_ns=10**10), dp_rank=5).raise_if_rejected()
    rc = w.dispatch(req("c", prompt, max_tokens=3, arrival_ns=10**10), dp_rank=4).raise_if_rejected()
    results = w.advance_to(2 * 10**10)
    assert rb.engine.cached_tokens == 0 and rc.engine.cached_tokens == 36
    r4, r5 = results
    assert all(b.data_parallel_rank == 5 for b in r5.kv_batches) and r5.kv_batches
    assert all(b.data_parallel_rank == 4 for b in r4.kv_batches)
    c4, c5 = w.core(4).pool.cached_hashes(), w.core(5).pool.cached_hashes()
    assert set(sequence_hashes(local_block_hashes(prompt, 4))) <= c4 & c5
    assert w.core(4).pool is not w.core(5).pool and w.idle


# --------------------------------------------------------------------------------- driver rules


def test_step_refuses_time_going_backwards_and_in_flight_passes():
    eng = VllmEngineCore(small())
    eng.add_request(req("a", range(8), max_tokens=3))
    first = eng.step(0)
    with pytest.raises(InvalidArgument, match="now_ns must be an integer >= the end of the previous pass"):
        eng.step(first.end_ns - 1)
    eng.advance_to(first.end_ns + 1)  # starts the next pass, which is still running
    with pytest.raises(InvalidArgument, match="in flight"):
        eng.step(first.end_ns + 2)
    with pytest.raises(InvalidArgument, match="t_ns must be an integer"):
        eng.advance_to(first.end_ns)


def test_advance_to_leaves_a_pass_starting_at_t_for_requests_arriving_at_t():
    eng = VllmEngineCore(small())
    eng.add_request(req("a", range(8), max_tokens=1, arrival_ns=1_000))
    eng.advance_to(1_000)
    assert eng.num_running == 0  # the pass at 1000 has not started yet
    eng.add_request(req("b", range(100, 108), max_tokens=1, arrival_ns=1_000))
    out = eng.advance_to(MAX_TIME_NS)
    assert sorted(out.admitted) == [("a", 1_000), ("b", 1_000)]
    assert out.passes == 1
