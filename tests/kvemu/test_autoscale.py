"""The autoscaler's sans-IO parts: the governor's bounds, cooldown and removal choice, and the built-in policy."""

from hypothesis import given
from hypothesis import strategies as st

from kvemu.autoscale import (
    AutoscaleConfig,
    Governor,
    LoadSlaAutoscaler,
    MetricsSnapshot,
    Percentiles,
    PoolMetrics,
    RankKv,
    ScaleDecision,
)

S = 1_000_000_000


def pool(running, starting=0, active=None, blocks=0.0, queue=0, total=100):
    ids = tuple(range(running))
    active = active or {}
    return PoolMetrics(pool="aggregated", dp_size=1, running=running, starting=starting, draining=0, running_ids=ids,
                       router_queue=0, engine_waiting=queue, active_requests=sum(active.values()),
                       active_by_worker={w: active.get(w, 0) for w in ids},
                       kv=tuple(RankKv(worker_id=w, dp_rank=0, active_blocks=blocks, cached_blocks=0, total_blocks=total)
                                for w in ids))


def snap(p, ttft=None, now=10 * S):
    return MetricsSnapshot(now_ns=now, window_ns=S, managed_pool="aggregated", pools={"aggregated": p}, in_flight=0,
                           arrivals=0, completed=0, failed=0, ttft_ms=ttft, itl_ms=None, e2e_ms=None)


def add(n=1):
    return ScaleDecision(action="add", count=n, reason="more")


def remove(n=1, worker=None):
    return ScaleDecision(action="remove", count=n, worker_id=worker, reason="less")


def test_adds_are_clamped_at_max_and_removals_at_min():
    g = Governor(AutoscaleConfig(min_workers=2, max_workers=5, cooldown_s=0), "aggregated")
    [rec] = g.review(0, pool(3, starting=1), [add(3)])
    assert (rec.applied, rec.outcome, rec.detail) == (1, "clamped", "max_workers 5")
    [rec] = g.review(S, pool(3), [remove(2)])
    assert (rec.applied, rec.outcome, rec.detail, rec.worker_ids) == (1, "clamped", "min_workers 2", [0])
    [rec] = g.review(2 * S, pool(5), [add()])
    assert (rec.applied, rec.outcome) == (0, "refused")


def test_no_opposite_decision_within_the_cooldown():
    g = Governor(AutoscaleConfig(max_workers=9, cooldown_s=30), "aggregated")
    assert g.review(10 * S, pool(3), [add()])[0].outcome == "applied"
    rec = g.review(39 * S, pool(4), [remove()])[0]
    assert (rec.outcome, rec.detail) == ("refused", "cooldown: a worker was added at 10 s")
    assert g.review(39 * S, pool(4), [add()])[0].outcome == "applied"  # the same direction is not held back
    assert g.review(69 * S, pool(5), [remove()])[0].outcome == "applied"  # 30 s after the last add
    assert g.review(98 * S, pool(4), [add()])[0].outcome == "refused"


def test_removal_takes_the_least_busy_lowest_id_and_spares_protected_workers():
    g = Governor(AutoscaleConfig(max_workers=9, cooldown_s=0), "aggregated")
    p = pool(4, active={0: 3, 1: 1, 2: 1, 3: 0})
    assert g.review(0, p, [remove(2)])[0].worker_ids == [3, 1]
    assert g.review(0, p, [remove(2)], protected={3})[0].worker_ids == [1, 2]
    rec = g.review(0, p, [remove(worker=3)], protected={3})[0]
    assert (rec.outcome, rec.detail) == ("refused", "worker 3 is named by a later chaos event")
    assert g.review(0, p, [remove(worker=7)])[0].detail == "worker 7 is not running in pool aggregated"
    assert g.review(0, p, [ScaleDecision(action="add", pool="prefill")])[0].outcome == "refused"


def test_a_pool_below_its_floor_is_refilled_whatever_the_cooldown():
    g = Governor(AutoscaleConfig(min_workers=3, max_workers=9, cooldown_s=60), "aggregated")
    g.review(0, pool(4), [remove()])
    [refused, floor] = g.review(S, pool(1, starting=1), [add()])
    assert refused.outcome == "refused" and refused.detail.startswith("cooldown")
    assert (floor.action, floor.applied, floor.detail) == ("add", 1, "min_workers floor")


class Model:
    """A reference of the rules, kept apart from the governor's code: counts only."""

    def __init__(self, lo, hi, cooldown):
        self.lo, self.hi, self.cooldown = lo, hi, cooldown
        self.last = {"add": None, "remove": None}

    def step(self, now, size, removable, decisions):
        applied = []
        for action, n in decisions:
            other = self.last["remove" if action == "add" else "add"]
            if other is not None and now - other < self.cooldown:
                applied.append(0)
                continue
            room = self.hi - size if action == "add" else min(size - self.lo, removable)
            k = max(0, min(n, room))
            size += k if action == "add" else -k
            removable -= 0 if action == "add" else k
            if k:
                self.last[action] = now
            applied.append(k)
        floor = max(0, self.lo - size)
        if floor:
            self.last["add"] = now
        return applied, floor


ticks = st.lists(st.tuples(st.integers(0, 8), st.integers(0, 3),
                           st.lists(st.tuples(st.sampled_from(["add", "remove"]), st.integers(1, 4)), max_size=3)),
                 min_size=1, max_size=12)


@given(lo=st.integers(1, 4), span=st.integers(0, 4), cooldown=st.integers(0, 5), ticks=ticks)
def test_the_governor_follows_the_reference_rules(lo, span, cooldown, ticks):
    hi = lo + span
    g = Governor(AutoscaleConfig(min_workers=lo, max_workers=hi, cooldown_s=cooldown), "aggregated")
    model = Model(lo, hi, cooldown * S)
    for t, (running, starting, decisions) in enumerate(ticks):  # counts change between ticks (chaos, starts)
        now = t * S
        recs = g.review(now, pool(running, starting), [ScaleDecision(action=a, count=n) for a, n in decisions])
        expected, floor = model.step(now, running + starting, running, decisions)
        assert [r.applied for r in recs[:len(decisions)]] == expected
        assert sum(r.applied for r in recs[len(decisions):]) == floor
        size = running + starting + sum(r.applied if r.action == "add" else -r.applied for r in recs)
        assert size >= lo
        assert size <= max(hi, running + starting)  # never added past max_workers
        assert all(r.applied <= r.requested for r in recs)


def test_builtin_adds_for_the_worst_signal_counting_starting_workers():
    policy = LoadSlaAutoscaler(AutoscaleConfig(max_workers=20, target_queue_per_worker=2, max_scale_up=4))
    [d] = policy.decide(snap(pool(2, queue=10)))  # 5 per worker: 2.5x the target -> 5 workers
    assert (d.action, d.count) == ("add", 3) and d.reason.startswith("queue 5.00/worker (target 2)")
    assert policy.decide(snap(pool(2, starting=3, queue=10))) == []  # already on their way
    slow = Percentiles(p50=100.0, p90=1500.0, p99=2000.0, count=9)
    sla = LoadSlaAutoscaler(AutoscaleConfig(max_workers=20, target_ttft_ms=500, max_scale_up=2))
    [d] = sla.decide(snap(pool(2), ttft=slow))
    assert (d.count, d.reason.split(":")[0]) == (2, "p90 TTFT 1500.0 ms (target 500 ms)")


def test_builtin_removes_one_only_when_the_rest_stays_well_under_target():
    policy = LoadSlaAutoscaler(AutoscaleConfig(max_workers=20, min_workers=2, target_kv_usage=0.8,
                                               scale_down_below=0.6))
    # 4 ranks at 30% KV: 0.375 of target, 0.5 with 3 workers -> remove one
    assert [d.action for d in policy.decide(snap(pool(4, blocks=30)))] == ["remove"]
    assert policy.decide(snap(pool(4, blocks=40))) == []  # 0.5 now, 0.67 with 3 workers
    assert policy.decide(snap(pool(4, starting=1, blocks=1))) == []
    assert policy.decide(snap(pool(2, blocks=1))) == []  # at min_workers
