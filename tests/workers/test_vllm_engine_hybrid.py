"""Hybrid KV cache groups (``kv_groups``): vLLM's hybrid KV cache manager in the vLLM-flavour engine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvemu.errors import InvalidArgument
from kvemu.kv_events import BlockStored
from kvemu.wire.codec import decode_batch, encode_batch, profile_for
from workers.blocks import BlockPool
from workers.config import EngineConfig, KvCacheGroup, KvGroupSpec
from workers.vllm.hybrid import SPEC_KIND, HybridKV, max_blocks
from workers.request import Request
from workers.sequence import SeqState
from workers.vllm.engine import VllmEngineCore
from kvemu.records import EngineRecord

from tests.engine_runs import run_to_end, steps

FULL = KvGroupSpec(kind="full_attention", layers=4)


def swa(window: int, layers: int = 4) -> KvGroupSpec:
    return KvGroupSpec(kind="sliding_window", layers=layers, window=window)


def cfg(groups, **kw) -> EngineConfig:
    base = dict(num_gpu_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, kv_groups=groups)
    base.update(kw)
    return EngineConfig(**base)


def req(rid: str, tokens, max_tokens: int = 4, arrival_ns: int = 0) -> Request:
    return Request(request_id=rid, token_ids=list(tokens), max_tokens=max_tokens, arrival_ns=arrival_ns)


# ------------------------------------------------------------------------------------------------ config


def test_groups_follow_vllms_layer_grouping():
    # vLLM's docstring example: 10 full + 20 sliding-window layers -> 3 groups of 10 (1 full, 2 sliding window)
    c = cfg([KvGroupSpec(kind="full_attention", layers=10), swa(128, 20)], num_gpu_blocks=100)
    assert c.kv_cache_groups == [KvCacheGroup("full_attention", None, 10), KvCacheGroup("sliding_window", 128, 10),
                                 KvCacheGroup("sliding_window", 128, 10)]
    assert c.kv_group_size == 10 and c.pool_blocks == 100 * 30 // 10
    # gpt-oss: 12 sliding + 13 full -> max < 1.5 min, so groups of 13 (the sliding group padded)
    g = cfg([swa(128, 12), KvGroupSpec(kind="full_attention", layers=13)], num_gpu_blocks=130)
    assert [x.kind for x in g.kv_cache_groups] == ["sliding_window", "full_attention"]
    assert g.kv_group_size == 13 and g.pool_blocks == 130 * 25 // 13
    # one kind: one group, the plain pool size
    assert cfg([FULL]).pool_blocks == 64 and len(cfg([FULL]).kv_cache_groups) == 1
    assert EngineConfig().kv_cache_groups == [] and EngineConfig().pool_blocks == EngineConfig().num_gpu_blocks


@pytest.mark.parametrize("kw, field", [
    (dict(kv_groups=[KvGroupSpec(kind="full_attention", layers=1)], backend="sglang"), "kv_groups"),
    (dict(kv_groups=[FULL, swa(8)], eviction_policy="lineage"), "eviction_policy"),
    (dict(kv_groups=[FULL, FULL]), "kv_groups"),
    (dict(kv_groups=[]), "kv_groups"),
])
def test_bad_kv_groups_are_refused(kw, field):
    with pytest.raises(InvalidArgument) as exc:
        EngineConfig(**kw)
    assert exc.value.field == field


def test_a_window_is_required_exactly_for_sliding_window():
    with pytest.raises(InvalidArgument):
        KvGroupSpec(kind="sliding_window", layers=2)
    with pytest.raises(InvalidArgument):
        KvGroupSpec(kind="state", layers=2, window=8)


# ------------------------------------------------------------------------------------------------ lookup


def _seq(n_blocks: int, bs: int = 4) -> SeqState:
    r = req("q", range(n_blocks * bs + 1))
    return SeqState(r, EngineRecord(request_id="q", dp_rank=0, arrival_ns=0, isl=len(r.token_ids), max_tokens=4),
                    bs, 0)


def _pool_with(seq: SeqState, cached: dict[int, list[int]]) -> BlockPool:
    """A pool caching, for each group, the given block positions of ``seq`` (inactive)."""
    pool = BlockPool(1000, 4, groups=max(cached, default=0) + 1, native=False)  # (it writes the pure tables' dict)
    for g, positions in cached.items():
        for i in positions:
            pool.cached[seq.hashes[i] + (g << 64)] = -1
    return pool


@pytest.mark.parametrize("full, window, expect", [
    (range(10), [6, 7, 8], 9),  # the window's 2 blocks before the hit point: 7, 8 -> 9 blocks
    (range(10), [2, 3], 4),  # further left
    (range(10), [0], 1),  # no full run: the run from block 0 counts
    (range(10), [1, 5, 8], 0),  # no two adjacent blocks, none from block 0
    (range(5), [6, 7, 8], 0),  # the full attention prefix stops at 5: the window must end by it
    (range(5), [2, 3, 7, 8], 4),
])
def test_sliding_window_hit_needs_the_window_before_the_hit_point(full, window, expect):
    seq = _seq(12)
    hyb = HybridKV([KvCacheGroup("full_attention", None, 1), KvCacheGroup("sliding_window", 8, 1)], 4, True, 64)
    assert hyb.targets == [0, 2]  # ceil((8 - 1) / 4)
    pool = _pool_with(seq, {0: list(full), 1: window})
    hit, taken, inactive = hyb.lookup(pool, seq, 10)
    assert hit == expect
    assert taken == inactive == (hit + min(2, hit) if hit else 0)


def test_hits_are_a_fixed_point_over_every_group():
    # group 1 (window 8: 2 blocks) allows 8, group 2 (a state checkpoint: 1 block) then allows 6, group 1 again 4
    seq = _seq(12)
    groups = [KvCacheGroup("full_attention", None, 1), KvCacheGroup("sliding_window", 8, 1), KvCacheGroup("state", None, 1)]
    hyb = HybridKV(groups, 4, True, 64)
    pool = _pool_with(seq, {0: list(range(10)), 1: [2, 3, 6, 7], 2: [3, 5]})
    assert hyb.lookup(pool, seq, 10)[0] == 4
    # a state group needs a checkpoint exactly at the hit point
    pool = _pool_with(seq, {0: list(range(10)), 1: [2]})  # (the state group is group 1 here)
    assert HybridKV([groups[0], groups[2]], 4, True, 64).lookup(pool, seq, 10)[0] == 3


# ------------------------------------------------------------------------------------------------ engine


def test_a_sliding_window_group_frees_blocks_that_left_the_window():
    # block size 4, window 6: before a pass after n computed tokens, blocks wholly before n - 5 are freed
    eng = VllmEngineCore(cfg([FULL, swa(6)], max_num_batched_tokens=8))
    eng.add_request(req("a", range(30), max_tokens=8))
    held = []
    for res in steps(eng):
        seq = next(iter(eng.scheduler.running), None)
        if seq is None:
            break
        n = seq.computed
        usage = eng.group_usage()
        held.append((n, usage[0][2], usage[1][2]))
        before = n - res.prefill_tokens - res.decodes  # computed before the pass (one request)
        assert seq.glo[1] == max(0, (before - 5) // 4)
    # full attention holds every block; the window at most ceil((6 - 1 + 8) / 4) + 1 = 5
    assert held[-1][1] == -(-held[-1][0] // 4) and all(w <= 5 for _, _, w in held)
    assert any(w < f for _, f, w in held)
    # freed window blocks stay cached (evictable), in both groups
    pool = eng.pool
    a = eng._seqs["a"] if "a" in eng._seqs else None
    assert a is None and pool.num_inactive == 2 * (37 // 4)


@pytest.mark.parametrize("mode, prompt, hit", [
    ("all", 40, 36),  # a checkpoint after every block; the last prompt token is always computed: 9 blocks
    ("align", 40, 0),  # the one checkpoint is at 40 (the pass's end), past the 39 tokens a lookup may hit
    ("align", 41, 40),  # the prefill is cut at 40, the prompt's last block boundary, which caches the state there
])
def test_prefix_hits_reuse_every_group(mode, prompt, hit):
    eng = VllmEngineCore(cfg([FULL, swa(6), KvGroupSpec(kind="state", layers=4, cache_mode=mode)]))
    first = run_to_end(eng, [req("a", range(prompt), max_tokens=2)])
    assert first["a"].engine.cached_tokens == 0
    second = run_to_end(eng, [req("b", range(prompt), max_tokens=2, arrival_ns=eng.now_ns)])
    assert second["b"].engine.cached_tokens == hit


def test_events_name_their_group_kind_and_window_and_encode_by_version():
    eng = VllmEngineCore(cfg([FULL, swa(6)]))
    eng.add_request(req("a", range(9), max_tokens=1))
    res = eng.step(0)
    events = res.events.batch().events
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in events] == [
        (0, "full_attention", None), (1, "sliding_window", 6)]
    assert events[0].block_hashes == events[1].block_hashes and events[0].token_ids == events[1].token_ids
    batch = res.events.batch()
    assert decode_batch(encode_batch(batch, profile_for("0.22"))).events == events
    older = decode_batch(encode_batch(batch, profile_for("0.20"))).events
    assert [(e.group_idx, e.kv_cache_spec_kind) for e in older] == [(0, None), (1, None)]


def test_a_hybrid_model_holds_more_concurrent_requests_in_the_same_memory():
    # 8 layers: all full attention vs 2 full + 6 sliding-window (window 8) in the same memory
    plain = VllmEngineCore(EngineConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=32, max_num_batched_tokens=64))
    hybrid = VllmEngineCore(cfg([KvGroupSpec(kind="full_attention", layers=2), swa(8, 6)], max_num_seqs=32,
                            max_num_batched_tokens=64))
    assert hybrid.pool.num_blocks == 64 * 8 // 2

    def peak(eng: VllmEngineCore) -> int:
        for i in range(32):
            eng.add_request(req(f"r{i}", [i] * 3 + list(range(60)), max_tokens=20))
        most = 0
        while (t := eng.next_event_ns()) is not None:
            eng.advance_to(t)
            most = max(most, eng.num_running)
        return most

    assert peak(hybrid) > 2 * peak(plain)


def test_requests_that_can_never_fit_every_group_are_refused():
    from workers.admission import RequestRejected
    c = cfg([FULL, swa(6)], num_gpu_blocks=8, max_num_batched_tokens=8)  # 16 pool blocks
    assert c.pool_blocks == 16
    assert max_blocks(c, 32) == 8 + 5  # full: 8 blocks; window: at most ceil((6 - 1 + 8) / 4) + 1
    eng = VllmEngineCore(c)
    with pytest.raises(RequestRejected):
        eng.add_request(req("long", range(60), max_tokens=5))  # 64 KV tokens: 16 + 5 blocks
    eng.add_request(req("ok", range(40), max_tokens=5))  # 44 KV tokens: 11 + 5 (more than the plain 32)
    assert run_to_end(eng, [])["ok"].output_tokens == 5


def test_a_scenario_with_kv_groups_needs_group_aware_kv_events():
    from harness.scenario.loading import ScenarioError, parse_scenario
    text = ("cluster:\n  kv_events_version: '{v}'\n  engine:\n    kv_groups:\n"
            "      - {{kind: full_attention, layers: 8}}\n      - {{kind: sliding_window, layers: 24, window: 128}}\n")
    with pytest.raises(ScenarioError, match="group_idx"):
        parse_scenario(text.format(v="0.19"))
    for v in ("0.20", "0.22", "0.33"):
        assert len(parse_scenario(text.format(v=v)).cluster.engine.config(1).kv_cache_groups) == 4


# ------------------------------------------------------------------------------------------------ router


@pytest.mark.parametrize("seed", range(8))
def test_the_router_scores_what_the_engine_would_hit_in_every_group(seed):
    # a hybrid engine under eviction pressure; its router-model events feed a routing core (and its vLLM 0.22 wire
    # events, converted, another), whose overlap for any prompt (capped as the engine caps its lookup) is then
    # exactly the engine's own hybrid hit
    import random

    from kvemu.config import RouterConfig
    from kvemu.hashing import local_block_hashes
    from kvemu.router_events import RouterEvent
    from kvemu.routing_core import PreparedRequest, RoutingCore
    from kvemu.wire.convert import convert_event

    rng = random.Random(seed)
    groups = [[FULL, swa(6)], [swa(9), FULL], [FULL, KvGroupSpec(kind="state", layers=4)],
              [FULL, swa(6), KvGroupSpec(kind="state", layers=4)],
              [KvGroupSpec(kind="full_attention", layers=8), swa(6)],  # two full-attention groups
              [swa(6), KvGroupSpec(kind="full_attention", layers=8)],
              [FULL, KvGroupSpec(kind="state", layers=4, cache_mode="all")]][seed % 7]
    eng = VllmEngineCore(cfg(groups, num_gpu_blocks=24, max_num_batched_tokens=16))
    core = RoutingCore(block_size=4)
    wire = RoutingCore(block_size=4)
    old = RoutingCore(block_size=4)  # vLLM 0.20 bytes (group_idx, no kind): the kinds from the engine's config
    kinds = [(SPEC_KIND[g.kind], g.window) for g in eng.config.kv_cache_groups]
    prefixes = [list(range(p * 100, p * 100 + rng.randint(4, 40))) for p in range(3)]
    prompts = [rng.choice(prefixes) + [1000 + i] * rng.randint(1, 8) for i in range(30)]
    reqs = [req(f"r{i}", p, max_tokens=rng.randint(1, 6), arrival_ns=i * 20_000_000) for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    while (t := eng.next_event_ns()) is not None:
        for batch in eng.advance_to(t).events:
            for data in batch.router_batch().events:
                core.apply_event(RouterEvent(worker_id=1, data=data))
            for ev in batch.batch().events:
                converted = convert_event(ev, worker_id=1, dp_rank=0, block_size=4)
                assert converted is not None
                wire.apply_event(converted)
            for ev in decode_batch(encode_batch(batch.batch(), profile_for("0.20"))).events:
                assert getattr(ev, "kv_cache_spec_kind", None) is None
                converted = convert_event(ev, worker_id=1, dp_rank=0, block_size=4, groups=kinds)
                assert converted is not None
                old.apply_event(converted)
    assert eng.pool.log == [] and eng.pool.num_inactive
    hits = 0
    for p in prefixes + prompts:
        seq = _seq(0)
        seq.prompt, seq.prompt_len, seq.hashes = p, len(p), []
        seq.block_locals = []
        limit = (len(p) - 1) // 4
        hit = eng.hybrid.lookup(eng.pool, seq, limit)[0]
        local = local_block_hashes(p, 4)[:limit]
        seen = core.overlaps(PreparedRequest(len(p), local, RouterConfig())).get((1, 0), 0)
        assert seen == hit, (p, seen, hit)
        assert wire.overlaps(PreparedRequest(len(p), local, RouterConfig())).get((1, 0), 0) == hit
        assert old.overlaps(PreparedRequest(len(p), local, RouterConfig())).get((1, 0), 0) == hit
        hits += hit
    assert hits


@st.composite
def cached_groups(draw):
    n = draw(st.integers(0, 14))
    kinds = draw(st.lists(st.sampled_from(["full_attention", "sliding_window", "state"]), min_size=1, max_size=4))
    groups = [KvCacheGroup(k, draw(st.integers(2, 13)) if k == "sliding_window" else None, 1) for k in kinds]
    cached = {g: draw(st.sets(st.integers(0, n - 1), max_size=n)) if n else set() for g in range(len(groups))}
    return groups, cached, n, draw(st.integers(0, n))


@settings(max_examples=300, deadline=None)
@given(cached_groups())
def test_the_hit_is_the_longest_length_every_group_accepts(case):
    # vLLM's fixed point equals the brute-force definition: the largest k where every full-attention group has
    # blocks 0..k-1 and every other group the ceil((W - 1) / bs) blocks before k (all of 0..k-1 when fewer)
    groups, cached, n, limit = case
    hyb = HybridKV(groups, 4, True, 64)
    seq = _seq(n)
    pool = _pool_with(seq, cached)

    def accepts(k: int) -> bool:
        for g in range(len(groups)):
            lo = 0 if hyb.targets[g] == 0 else max(0, k - hyb.targets[g])
            if not set(range(lo, k)) <= cached[g]:
                return False
        return True

    assert hyb.lookup(pool, seq, limit)[0] == max(k for k in range(limit + 1) if accepts(k))


def test_without_prefix_caching_a_state_group_holds_one_block_per_request():
    eng = VllmEngineCore(cfg([FULL, KvGroupSpec(kind="state", layers=4)], enable_prefix_caching=False,
                         max_num_batched_tokens=8))
    for i in range(3):
        eng.add_request(req(f"r{i}", range(i * 50, i * 50 + 21), max_tokens=6))
    for _ in steps(eng):
        usage = eng.group_usage()
        running = eng.scheduler.running
        assert usage[1][2] == len(running)  # one state block each
        assert usage[0][2] == sum(-(-q.computed // 4) for q in running)
    assert eng.pool.free == eng.pool.num_blocks  # nothing cached, everything back


def test_preemption_gives_back_every_groups_blocks():
    # a pool too small for all: requests are preempted and recomputed; the invariants hold after every pass
    eng = VllmEngineCore(cfg([FULL, swa(6), KvGroupSpec(kind="state", layers=4)], num_gpu_blocks=12,
                         max_num_batched_tokens=16, max_num_seqs=4))
    reqs = [req(f"r{i}", range(i * 100, i * 100 + 14), max_tokens=20) for i in range(4)]
    done = {}
    for res in steps(eng, reqs):
        for rec in res.completed:
            done[rec.request_id] = rec
    assert len(done) == 4 and sum(r.engine.preemptions for r in done.values()) > 0
    assert eng.pool.num_active_blocks == 0 and eng.group_usage() == [(g.kind, g.window, 0) for g in eng.hybrid.groups]


def test_a_decode_pool_may_run_the_prefill_pools_kv_groups():
    from harness.scenario.loading import ScenarioError, parse_scenario
    groups = "kv_groups: [{kind: full_attention, layers: 8}, {kind: sliding_window, layers: 24, window: 128}]"
    text = f"cluster:\n  prefill: {{workers: 1, engine: {{{groups}}}}}\n  decode: {{workers: 1, engine: {{{groups}}}}}\n"
    assert len(parse_scenario(text).cluster.decode.engine.config(1).kv_cache_groups) == 4
    with pytest.raises(ScenarioError, match="same model"):  # a decode leg lands the groups its prefill leg computed
        parse_scenario(text.replace("window: 128}]}}\n  decode", "window: 64}]}}\n  decode"))


@pytest.mark.parametrize("mode", ["full_prompt", "destination_missing"])
def test_a_decode_leg_lands_what_each_group_still_holds(mode):
    # 1 full-attention + 1 sliding-window (window 6) + 2 state layers, 30-token prompt in blocks of 4: full
    # attention carries all 8 blocks, the window the blocks its first pass reads (from (30 - 6) // 4 = 6), the
    # state its running block; the transfer moves, per layer, the prompt, the window's 6 tokens, one 4-token page
    from kvemu.transfer import KvTransfer
    groups = [KvGroupSpec(kind="full_attention", layers=1), swa(6, 1), KvGroupSpec(kind="state", layers=2)]
    eng = VllmEngineCore(cfg(groups, num_gpu_blocks=40))
    xfer = KvTransfer(source_worker_id=9, bandwidth_gbps=1e-3, bytes_per_token=300, mode=mode)
    r = Request(request_id="leg", token_ids=list(range(30)), max_tokens=3, kv_transfer=xfer)
    eng.add_request(r)
    eng.step(0)
    seq = eng._seqs["leg"]
    assert eng.hybrid.held(seq) == [8, 2, 1, 1]  # (2 state groups of 1 layer; align mode: one block each)
    tokens = (1 * (30 if mode == "full_prompt" else 32) + 1 * (6 if mode == "full_prompt" else 8) + 2 * 4) // 4
    ready = eng.scheduler.transfers[0][0]
    assert ready == round(tokens * 300 / 1e-3)
    done = run_to_end(eng, [])
    assert done["leg"].output_tokens == 3 and eng.pool.num_active_blocks == 0
    # its prompt's full blocks were cached on arrival: a second leg of the same prompt finds full attention's
    # blocks up to the window's first block here
    eng.add_request(Request(request_id="again", token_ids=list(range(30)), max_tokens=2, kv_transfer=xfer,
                            arrival_ns=eng.now_ns))
    eng.step(eng.next_pass_start_ns())
    again = eng._seqs["again"]
    assert again.n_full == 6 and eng.hybrid.held(again) == [8, 2, 1, 1]
    assert run_to_end(eng, [])["again"].output_tokens == 2


@pytest.mark.parametrize("version, as_bytes", [("0.20", True), ("0.21", True), ("0.22", False), ("0.33", False)])
def test_in_memory_delivery_of_hybrid_events_says_only_what_the_version_can(version, as_bytes):
    # before vLLM 0.22 the events carry no group kind: an in-memory bus sends such a hybrid batch as its bytes, so
    # the router sees what it would over ZeroMQ (kv_wire_check gives the same report)
    from kvemu.runtime.kv_bus import MemoryKvBus
    from kvemu.router_events import EventBatch

    bus = MemoryKvBus(vllm_version=version)
    got = []
    bus.connect(lambda wid, rank, seq, payload: got.append(payload))
    pub = bus.publisher(1, 0)
    eng = VllmEngineCore(cfg([FULL, swa(6)]))
    eng.add_request(req("a", range(9), max_tokens=1))
    assert pub._publish_now(eng.step(0).events)
    assert isinstance(got[0], bytes) is as_bytes and isinstance(got[0], EventBatch) is not as_bytes


# ------------------------------------------------------------------------------------------------ Mamba align mode


def state(mode: str | None = None) -> KvGroupSpec:
    return KvGroupSpec(kind="state", layers=4, cache_mode=mode)


def test_state_cache_mode_defaults_to_align_and_belongs_to_state_groups():
    assert state().mode == "align" and state("all").mode == "all" and FULL.mode is None
    assert [g.cache_mode for g in cfg([FULL, state()]).kv_cache_groups] == [None, "align"]
    with pytest.raises(InvalidArgument) as exc:
        KvGroupSpec(kind="sliding_window", layers=2, window=8, cache_mode="align")
    assert exc.value.field == "kv_groups.cache_mode"
    # a chunk under one block is never scheduled: a token budget under one block could never prefill
    with pytest.raises(InvalidArgument) as exc:
        cfg([FULL, state()], max_num_batched_tokens=3, max_num_seqs=1)
    assert exc.value.field == "max_num_batched_tokens"
    assert cfg([FULL, state("all")], max_num_batched_tokens=3, max_num_seqs=1).kv_groups
    assert cfg([FULL, state()], max_num_batched_tokens=3, max_num_seqs=1, enable_prefix_caching=False).kv_groups


@pytest.mark.parametrize("mode, budget, chunks", [
    ("align", 64, [28, 2]),  # cut at the prompt's last block boundary (28 of 30 tokens)
    ("align", 10, [8, 8, 8, 4, 2]),  # whole blocks, then the cut at 28, then the rest
    ("all", 10, [10, 10, 10]),
])
def test_align_mode_cuts_prefill_chunks_at_block_boundaries(mode, budget, chunks):
    eng = VllmEngineCore(cfg([FULL, state(mode)], max_num_batched_tokens=budget, max_num_seqs=1))
    eng.add_request(req("a", range(30), max_tokens=2))
    got = []
    for res in steps(eng):
        got.append(res.prefill_tokens)
        if len(got) == len(chunks):
            break
    assert got == chunks


@st.composite
def align_workloads(draw):
    bs = draw(st.sampled_from([2, 4]))
    budget = draw(st.integers(1, 24))
    blocks = draw(st.integers(4, 24))
    reqs = [req(f"r{i}", range(1000 * i, 1000 * i + draw(st.integers(1, 30))), max_tokens=draw(st.integers(1, 16)),
                arrival_ns=draw(st.integers(0, 5)) * 10_000_000) for i in range(draw(st.integers(1, 5)))]
    return bs, budget, blocks, reqs


@settings(max_examples=150, deadline=None)
@given(align_workloads())
def test_align_mode_checkpoints_only_where_a_pass_ends_on_a_block_boundary(work):
    # every state block a pass stores is the state at the pass's end for its request, on a block boundary; each
    # such pass end is cached right after the pass; a fresh request's prefill chunks before the prompt's last block
    # boundary are whole blocks and stop there; a request holds at most 2 state blocks
    bs, budget, blocks, reqs = work
    eng = VllmEngineCore(cfg([FULL, swa(5), state()], block_size=bs, num_gpu_blocks=blocks, max_num_batched_tokens=max(
        budget, 4), max_num_seqs=4))
    if any(max_blocks(eng.config, len(r.token_ids) + r.max_tokens) > eng.pool.num_blocks for r in reqs):
        return
    owner: dict[int, tuple[str, int]] = {}
    seqs: dict[str, SeqState] = {}
    for r in reqs:
        eng.add_request(r)
    while (s := eng.next_pass_start_ns()) is not None:
        seqs.update(eng._seqs)
        before = {rid: (q.computed, q.n_out) for rid, q in seqs.items()}
        res = eng.step(s)
        eng.check_invariants()
        ends: dict[str, int] = {}  # this pass's end, per request in it
        for rid, q in seqs.items():
            for i, h in enumerate(q.ensure_hashes(q.n_full)):
                owner[h] = (rid, i)
            c0, out0 = before[rid]
            if q.computed and q.computed != c0:
                end = ends[rid] = q.computed
                if not out0 and end < q.prompt_len:  # a fresh request's prefill chunk
                    last = q.prompt_len - q.prompt_len % bs
                    assert c0 >= last or (end % bs == 0 and end <= last)  # (past the last boundary: any chunk)
                if end % bs == 0:
                    assert eng.pool.is_cached(q.hashes[end // bs - 1] + (2 << 64))
        if res.events is not None:
            for ev in res.events.batch().events:
                if isinstance(ev, BlockStored) and ev.group_idx == 2:
                    for h in ev.block_hashes:
                        rid, i = owner[h]
                        assert ends.get(rid) == (i + 1) * bs
        assert all(n <= 2 for q in eng.scheduler.running for n in eng.hybrid.held(q)[2:])
    assert eng.pool.num_active_blocks == 0


def test_align_mode_holds_the_state_read_and_the_state_written():
    # a 2-block hit: the request reads the checkpoint at 8 and writes a new state block; the older one goes before
    # the next pass, cached (a checkpoint, evictable), so one state block is held while it decodes within a block
    eng = VllmEngineCore(cfg([FULL, state()], max_num_batched_tokens=64))
    run_to_end(eng, [req("a", range(9), max_tokens=1)])  # cut at 8: the state there is cached
    eng.add_request(req("b", range(9), max_tokens=3, arrival_ns=eng.now_ns))
    res = eng.step(eng.next_pass_start_ns())
    b = eng._seqs["b"]
    assert b.record.engine.cached_tokens == 8 and eng.hybrid.held(b)[1] == 2 and res.prefill_tokens == 1
    eng.step(eng.next_pass_start_ns())
    assert eng.hybrid.held(b)[1] == 1


# ------------------------------------------------------------------------------------------------ pass timing


def _gaps(eng: VllmEngineCore, prompt: int, out: int) -> list[int]:
    rec = run_to_end(eng, [req("a", range(prompt), max_tokens=out)])["a"]
    return [b - a for a, b in zip(rec.token_times_ns, rec.token_times_ns[1:])]


def test_decode_timing_counts_each_layers_context():
    # 2 full-attention + 6 sliding-window layers (window 8), plain pool of 64 blocks of 4 tokens: a decode with
    # context c reads (2c + 6 min(c, 8)) / 8 tokens' worth; state layers read none
    hyb = HybridKV([], 4, True, 64, [KvGroupSpec(kind="full_attention", layers=2), swa(8, 6)])
    assert hyb.decode_kv([4, 8]) == 12  # under the window: the plain sum
    assert hyb.decode_kv([100, 40]) == (2 * 100 + 6 * 8 + 2 * 40 + 6 * 8) // 8
    hyb = HybridKV([], 4, True, 64, [KvGroupSpec(kind="full_attention", layers=1), swa(8, 1), state()])
    assert hyb.decode_kv([30]) == (30 + 8) // 6  # (4 state layers)


def test_a_window_model_decodes_as_the_plain_one_within_its_window_and_faster_beyond():
    plain = VllmEngineCore(EngineConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64))
    groups = [KvGroupSpec(kind="full_attention", layers=2), swa(64, 6)]
    wide = VllmEngineCore(cfg(groups))
    assert _gaps(wide, 20, 12) == _gaps(plain, 20, 12)  # every context under 64 tokens
    narrow = VllmEngineCore(cfg([KvGroupSpec(kind="full_attention", layers=2), swa(8, 6)]))
    got = _gaps(narrow, 100, 12)
    timer = plain.timer
    assert got == [timer.decode_ns((2 * c + 6 * 8) // 8, 1) for c in range(101, 112)]  # context: computed + 1
    assert sum(got) < sum(_gaps(VllmEngineCore(EngineConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)),
                                100, 12))


def test_the_router_takes_group_kinds_from_the_registration_when_events_name_none():
    # vLLM 0.20 bytes name no group kind: a hybrid worker announces its groups when it registers (from its engine
    # config), so the router's intake judges every group; the sliding window's blocks, freed and evicted, then
    # stop the hit where the engine stops it
    from kvemu.config import RouterConfig
    from kvemu.hashing import local_block_hashes
    from kvemu.messages import Register
    from kvemu.registry import WorkerSpec
    from kvemu.routing_core import PreparedRequest, RoutingCore
    from kvemu.runtime.kv_ingest import KvIngest

    eng = VllmEngineCore(cfg([FULL, swa(6)], num_gpu_blocks=24, max_num_batched_tokens=16))
    kinds = [(SPEC_KIND[g.kind], g.window) for g in eng.config.kv_cache_groups]
    cores = {}
    for name, groups in (("told", kinds), ("blind", [])):
        core = cores[name] = RoutingCore(block_size=4)
        core.add_worker(WorkerSpec(worker_id=1, block_size=4))
        ingest = KvIngest(core, replay_on_connect=False)
        ingest.add_worker(Register(worker_id=1, block_size=4, kv_groups=groups))
        assert ingest.streams[(1, 0)].groups == (groups or None)
        cores[name] = (core, ingest)
    reqs = [req(f"r{i}", list(range(i % 3 * 100, i % 3 * 100 + 30)) + [1000 + i], max_tokens=3,
                arrival_ns=i * 20_000_000) for i in range(12)]
    reqs += [req(f"f{i}", range(5000 + 100 * i, 5000 + 100 * i + 20), max_tokens=2, arrival_ns=(12 + i) * 20_000_000)
             for i in range(4)]  # later prompts evict the oldest released blocks: the windows' first
    for r in reqs:
        eng.add_request(r)
    seq_no = 0
    while (t := eng.next_event_ns()) is not None:
        for batch in eng.advance_to(t).events:
            payload = encode_batch(batch.batch(), profile_for("0.20"))
            for _core, ingest in cores.values():
                ingest.intake(1, 0, seq_no, payload)
            seq_no += 1
    differ = 0
    for p in [list(range(k * 100, k * 100 + 30)) + [7] for k in range(3)]:
        seq = _seq(0)
        seq.prompt, seq.prompt_len, seq.hashes, seq.block_locals = p, len(p), [], []
        hit = eng.hybrid.lookup(eng.pool, seq, (len(p) - 1) // 4)[0]
        local = local_block_hashes(p, 4)[: (len(p) - 1) // 4]
        told, blind = (c.overlaps(PreparedRequest(len(p), local, RouterConfig())).get((1, 0), 0)
                       for c, _ in cores.values())
        assert told == hit and blind >= hit
        differ += blind != hit
    assert differ  # without the kinds the router scores blocks the window no longer holds
