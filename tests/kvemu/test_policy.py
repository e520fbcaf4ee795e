"""Custom policies: filters → scorers → picker after eligibility; affinity is advisory for them."""

import pytest

from kvemu.errors import InvalidArgument, NoEndpoints
from kvemu.policy import CustomPolicy, overlap_scorer, random_policy, round_robin_policy
from kvemu.registry import WorkerSpec
from kvemu.routing_core import RoutingCore


def core_with(policy, workers=3, dp=1):
    core = RoutingCore(block_size=4, policy=policy, seed=11)
    for w in range(1, workers + 1):
        core.add_worker(WorkerSpec(worker_id=w, dp_size=dp))
    return core


def test_custom_policy_may_ignore_the_advisory_affinity_target():
    seen = []

    def picker(ctx, rows, costs, rng):
        seen.append(ctx.affinity_target)
        return max(range(len(rows)), key=lambda i: rows[i].worker_id)  # always the highest id

    core = core_with(CustomPolicy("highest", scorers=(), picker=picker))
    req = core.prepare(list(range(8)))
    sel = core.select(req, core.eligibility().affinity((1, 0)).build())
    assert sel.key == (3, 0) and sel.reason == "policy"
    assert seen == [(1, 0)]  # it was told about the target


def test_filters_scorers_and_picker_compose():
    core = core_with(CustomPolicy("cache-only", filters=[lambda ctx, row: row.worker_id != 2],
                                  scorers=[overlap_scorer]))
    req = core.prepare(list(range(8)))
    core.index.store(2, req.local_hashes, req.seq_hashes)  # best cache, but filtered out
    core.index.store(3, req.local_hashes[:1], req.seq_hashes[:1])
    assert core.select(req).key == (3, 0)


def test_filters_rejecting_everything_is_no_endpoints():
    core = core_with(CustomPolicy("none", filters=[lambda ctx, row: False]))
    with pytest.raises(NoEndpoints, match="policy 'none': its filters rejected all 3"):
        core.select(core.prepare([1, 2, 3, 4]))


def test_bad_picker_result_is_a_typed_error():
    core = core_with(CustomPolicy("bad", picker=lambda ctx, rows, costs, rng: 7))
    with pytest.raises(InvalidArgument, match="picker returned 7"):
        core.select(core.prepare([1, 2, 3, 4]))


def test_round_robin_cycles_through_ranks():
    core = core_with(round_robin_policy(), workers=2, dp=2)
    req = core.prepare([1, 2, 3, 4])
    assert [core.select(req).key for _ in range(5)] == [(1, 0), (1, 1), (2, 0), (2, 1), (1, 0)]


def test_random_policy_is_seeded():
    core1, core2 = core_with(random_policy()), core_with(random_policy())
    req = core1.prepare([1, 2, 3, 4])
    assert [core1.select(req).key for _ in range(20)] == [core2.select(req).key for _ in range(20)]
    assert len({core1.select(req).key for _ in range(60)}) == 3


def test_pins_bypass_custom_policies():
    core = core_with(CustomPolicy("highest", picker=lambda ctx, rows, costs, rng: len(rows) - 1))
    sel = core.select(core.prepare([1, 2, 3, 4]), core.eligibility().pin(1, 0).build())
    assert sel.key == (1, 0) and sel.reason == "pinned"


def test_a_lone_picker_reads_the_same_rows_and_a_round_robin_pick_evaluates_no_detail(monkeypatch):
    """A picker with no filters or scorers gets rows built on first access, equal to the eager rows; round robin
    reads none, so its selection evaluates only the chosen rank in detail."""
    import kvemu.selector as selector

    def scored(ctx, rows, costs, rng):  # filters/scorers present: the eager path
        seen["eager"] = (list(rows), list(costs))
        return 1

    def lone(ctx, rows, costs, rng):
        seen["lazy"] = (list(rows), list(costs))
        assert rows[1:] == seen["lazy"][0][1:] and rows.index(rows[2]) == 2
        return 1

    seen: dict = {}
    for picker, filters in ((scored, [lambda ctx, row: True]), (lone, [])):
        core = core_with(CustomPolicy("p", filters=filters, scorers=(), picker=picker), workers=3, dp=2)
        req = core.prepare(list(range(8)))
        core.index.store(2, req.local_hashes, req.seq_hashes)
        core.load.add("busy", (3, 1), req.seq_hashes[:1], 5)
        assert core.select(req).key == (1, 1)
    assert seen["lazy"] == seen["eager"] and [r.worker_id for r in seen["lazy"][0]] == [1, 1, 2, 2, 3, 3]
    assert seen["lazy"][0][2].overlap_blocks == 2 and seen["lazy"][0][5].active_prefill_tokens == 5

    widths = []
    real = selector.evaluate
    monkeypatch.setattr(selector, "evaluate", lambda ranks, **kw: widths.append((len(ranks), kw.get("detail"))) or real(ranks, **kw))
    core = core_with(round_robin_policy(), workers=3, dp=2)
    core.select(core.prepare(list(range(8))))
    assert (6, True) not in widths and (1, True) in widths
