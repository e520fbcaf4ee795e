"""Default selector: the cost formula, argmin with uniform ties, softmax, pins, affinity, overrides."""

import math
import random
from collections import Counter

import pytest

from kvemu.config import RouterConfig, RouterOverrides
from kvemu.load import LoadTracker
from kvemu.registry import WorkerSpec
from kvemu.routing_core import RoutingCore
from kvemu.selector import TierHits, evaluate, pick_argmin, pick_softmax


def cost_of(**kw):
    defaults = dict(isl=128, block_size=16, overlaps={}, seq_hashes=list(range(8)), config=RouterConfig())
    defaults.update(kw)
    defaults.setdefault("load", LoadTracker())
    return evaluate([(1, 0)], **defaults).costs[0]


def worked_example_core() -> RoutingCore:
    core = RoutingCore(block_size=16, seed=3)
    core.add_worker(WorkerSpec(worker_id=1))  # A
    core.add_worker(WorkerSpec(worker_id=2))  # B
    return core


def test_worked_example_52_vs_36():
    core = worked_example_core()
    req = core.prepare(list(range(128)))
    core.index.store(1, req.local_hashes[:6], req.seq_hashes[:6])
    core.load.add("a", (1, 0), range(10_000, 10_040), 32)  # A: P=32, 40 active decode blocks
    core.load.add("b", (2, 0), range(20_000, 20_020), 0)  # B: 20 active decode blocks
    sel = core.select(req)
    assert sel.evaluation.costs == [52.0, 36.0]
    assert sel.key == (2, 0) and sel.reason == "cost"
    assert sel.overlap_blocks == 0 and sel.prefill_tokens == 128 and sel.required_blocks == 8
    # selection is side-effect free: nothing was booked
    assert core.load.rank((2, 0)).active_requests == 1


def test_classic_formula_with_defaults():
    load = LoadTracker()
    load.add("x", (1, 0), [0, 1, 2, 99], 48)  # first three request blocks already active
    cost = evaluate(
        [(1, 0)], isl=160, block_size=16, overlaps={(1, 0): 4}, seq_hashes=list(range(10)),
        load=load, config=RouterConfig(),
    ).costs[0]
    # (P + isl)/bs - D + active decode + additional = (48+160)/16 - 4 + 4 + (10-3)
    assert cost == pytest.approx(13 - 4 + 4 + 7)


def test_no_load_entry_charges_isl_and_all_blocks():
    assert cost_of(overlaps={(1, 0): 3}) == pytest.approx(8 - 3 + 8)


def test_prefill_scale_credit_and_request_weight():
    load = LoadTracker()
    load.add("x", (1, 0), [], 32)
    cfg = RouterConfig(prefill_load_scale=2.0, overlap_score_credit=0.5, decode_active_request_weight=3.0)
    # raw = (32 + 128)/16 = 10; credit = 0.5*4 = 2; adjusted 8 → 16; decode 8; requests 1*3
    assert cost_of(load=load, overlaps={(1, 0): 4}, config=cfg) == pytest.approx(16 + 8 + 3)


def test_adjusted_prefill_floors_at_zero_and_untracked_prefill():
    assert cost_of(overlaps={(1, 0): 8}, config=RouterConfig(overlap_score_credit=5.0)) == pytest.approx(8)
    assert cost_of(config=RouterConfig(router_track_prefill_tokens=False)) == pytest.approx(8)


def test_credit_decay_penalises_prefill_backlog():
    load = LoadTracker()
    load.add("x", (1, 0), [], 160)
    cfg = RouterConfig(overlap_score_credit_decay=1.0)
    ev = evaluate([(1, 0), (2, 0)], isl=128, block_size=16, overlaps={(1, 0): 8, (2, 0): 8},
                  seq_hashes=list(range(8)), load=load, config=cfg)
    # rank 1: factor 1/(1 + 1*((160-0)/16)/8) = 1/2.25 → credit 8/2.25
    assert ev.costs[0] == pytest.approx(max(0, (160 + 128) / 16 - 8 / 2.25) + 8)
    assert ev.costs[1] == pytest.approx(max(0, 128 / 16 - 8) + 8)


def test_lower_tiers_and_shared_cache():
    cfg = RouterConfig(shared_cache_multiplier=0.5)
    tiers = TierHits(host={(1, 0): 2}, disk={(1, 0): 4}, shared={(1, 0): 2})
    ev = evaluate([(1, 0)], isl=128, block_size=16, overlaps={(1, 0): 1}, seq_hashes=list(range(8)),
                  load=LoadTracker(), config=cfg, tiers=tiers)
    # credit = 1 + 0.75*2 + 0.25*4 + 0.5*2 = 4.5; effective = 1 + 1.5 + 1 = 3.5 → cached 56
    assert ev.costs[0] == pytest.approx(8 - 4.5 + 8)
    assert ev.effective_overlap_blocks[0] == pytest.approx(3.5) and ev.cached_tokens[0] == 56


def test_decode_pool_special_case():
    cfg = RouterConfig(router_track_prefill_tokens=False, overlap_score_credit=1.0)
    ev = evaluate([(1, 0)], isl=128, block_size=16, overlaps={(1, 0): 3}, seq_hashes=list(range(8)),
                  load=LoadTracker(), config=cfg, decode_pool=True)
    assert ev.costs[0] == pytest.approx(8 - 3)


def test_preferred_taints_multiply_cost():
    core = RoutingCore(block_size=16)
    core.add_worker(WorkerSpec(worker_id=1, taints=frozenset({"fast"})))
    core.add_worker(WorkerSpec(worker_id=2))
    req = core.prepare(list(range(128)), preferred_taints={"fast": 1.0})
    sel = core.select(req)
    assert sel.evaluation.costs[0] == pytest.approx(16 * math.exp(-math.tanh(1.0)))
    assert sel.evaluation.costs[1] == pytest.approx(16)
    assert sel.key == (1, 0)


def test_argmin_ties_are_uniform_and_order_independent():
    rng = random.Random(1)
    costs = [5.0, 3.0, 9.0, 3.0, 3.0, 4.0]
    counts = Counter(pick_argmin(costs, rng) for _ in range(30_000))
    assert set(counts) == {1, 3, 4}
    for i in (1, 3, 4):
        assert counts[i] / 30_000 == pytest.approx(1 / 3, abs=0.02)
    reversed_counts = Counter(pick_argmin(costs[::-1], rng) for _ in range(30_000))
    for i in (1, 2, 4):
        assert reversed_counts[i] / 30_000 == pytest.approx(1 / 3, abs=0.02)


def test_argmin_without_ties_never_draws():
    class NoDraw(random.Random):
        def randrange(self, *a):  # pragma: no cover - must not be called
            raise AssertionError("drew a random number without a tie")

    assert pick_argmin([4.0, 1.0, 2.0], NoDraw()) == 1


def test_softmax_matches_the_normalised_formula():
    rng = random.Random(7)
    costs = [10.0, 12.0, 20.0]
    t = 0.5
    w = [math.exp(-(c - 10) / (10 * t)) for c in costs]
    expected = [x / sum(w) for x in w]
    n = 40_000
    counts = Counter(pick_softmax(costs, t, rng) for _ in range(n))
    for i in range(3):
        assert counts[i] / n == pytest.approx(expected[i], abs=0.015)
    assert Counter(pick_softmax([3.0, 3.0], 1.0, rng) for _ in range(2000))[0] == pytest.approx(1000, abs=150)
    assert pick_softmax([1e308, -1e308, 0.0], 1.0, random.Random(0)) in (0, 1, 2)  # overflowing span


def test_temperature_override_per_request():
    core = worked_example_core()
    core.load.add("a", (1, 0), range(100), 0)
    cold = core.prepare(list(range(128)))
    assert {core.select(cold).key for _ in range(50)} == {(2, 0)}
    hot = core.prepare(list(range(128)), overrides=RouterOverrides(router_temperature=50.0))
    picks = Counter(core.select(hot).key for _ in range(400))
    assert picks[(1, 0)] > 50 and picks[(2, 0)] > 50
    assert core.select(hot).reason == "softmax"


def test_legacy_overlap_score_weight_zero_disables_credit():
    cfg = RouterConfig().with_overrides(RouterOverrides(overlap_score_weight=0.0))
    assert cfg.prefill_load_scale == 0.0 and cfg.overlap_score_credit == 0.0


def test_pin_and_affinity_return_directly():
    core = worked_example_core()
    core.load.add("a", (1, 0), range(100), 0)
    req = core.prepare(list(range(128)))
    pinned = core.select(req, core.eligibility().pin(1, 0).build())
    assert pinned.key == (1, 0) and pinned.reason == "pinned" and pinned.cost == pytest.approx(8 + 100 + 8)
    aff = core.select(req, core.eligibility().affinity((1, 0)).build())
    assert aff.key == (1, 0) and aff.reason == "affinity"
    # ineligible affinity target: normal selection over everyone
    normal = core.select(req, core.eligibility().affinity((1, 0)).set_available(1, False).build())
    assert normal.key == (2, 0) and normal.reason == "cost"


def test_same_seed_same_choices():
    def run(seed):
        core = RoutingCore(block_size=4, seed=seed)
        for w in range(4):
            core.add_worker(WorkerSpec(worker_id=w, dp_size=2))
        return [core.select(core.prepare([i, i + 1, i + 2, i + 3])).key for i in range(50)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_invalid_config_names_the_field():
    with pytest.raises(ValueError, match=r"^overlap_score_credit must be >= 0, got -1$"):
        RouterConfig(overlap_score_credit=-1)
    with pytest.raises(ValueError, match=r"^router_ttl_secs must be a finite number, got inf$"):
        RouterConfig(router_ttl_secs=float("inf"))
    with pytest.raises(ValueError, match=r"^router_queue_policy must be 'fcfs' or 'lcfs' or 'wspt'"):
        RouterConfig(router_queue_policy="sjf")
    with pytest.raises(ValueError, match="router_config_override.router_temperature"):
        RouterOverrides(router_temperature=float("nan"))
