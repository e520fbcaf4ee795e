"""Policy queue: busy rule, ordering policies and tiers, pin lanes, limits, DRR, and a model check."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvemu.errors import InvalidArgument
from kvemu.queue import DoNotQueue, PolicyQueue, QueueClass, QueueEntry, QueueLimits, QueueRejected

RANKS = [(1, 0), (2, 0)]


def make(policy="fcfs", threshold=100, classes=None, **kw):
    load = {k: 0 for k in RANKS + [(3, 0)]}
    q = PolicyQueue(
        classes=classes or [QueueClass(busy_threshold=threshold, policy=policy)],
        prefill_tokens=lambda k: load.get(k, 0),
        batched_capacity=lambda k: 1000,
        **kw,
    )
    return q, load


def entry(rid, t, **kw):
    kw.setdefault("ranks", RANKS)
    return QueueEntry(rid, arrival_ns=t, **kw)


def test_off_by_default_never_queues():
    q = PolicyQueue(prefill_tokens=lambda k: 10**9)
    assert not q.should_queue(RANKS)


def test_waits_only_when_every_eligible_rank_is_busy():
    q, load = make()
    load[(1, 0)] = 101
    assert not q.should_queue(RANKS)
    load[(2, 0)] = 101
    assert q.should_queue(RANKS)
    assert not q.should_queue([])  # no eligible rank: selection fails instead


def test_fraction_threshold_uses_or_semantics():
    q, load = make(classes=[QueueClass(busy_threshold=500, busy_threshold_frac=0.2)])
    load[(1, 0)] = 201  # > 0.2 × 1000 even though < 500
    assert q.is_busy((1, 0))


def test_backlog_blocks_newcomers_of_the_same_class():
    q, load = make()
    load[(1, 0)] = load[(2, 0)] = 200
    q.push(entry("a", 1))
    load[(1, 0)] = 0
    assert q.should_queue(RANKS)  # a free rank exists, but "a" is waiting


@pytest.mark.parametrize(
    "policy, expected",
    [("fcfs", ["a", "b", "c"]), ("lcfs", ["c", "b", "a"]), ("wspt", ["b", "c", "a"])],
)
def test_ordering_policies(policy, expected):
    q, load = make(policy)
    load[(1, 0)] = load[(2, 0)] = 200
    q.push(entry("a", 1, isl=1000))
    q.push(entry("b", 2, isl=100))
    q.push(entry("c", 3, isl=500))
    assert q.pop_ready() is None
    load[(1, 0)] = 0
    assert [e.request_id for e in q.drain_ready()] == expected


def test_tiers_beat_policy_and_priority_jump_bumps():
    q, load = make()
    load[(1, 0)] = load[(2, 0)] = 200
    q.push(entry("old", 1))
    q.push(entry("vip", 5, tier=1))
    q.push(entry("jumper", 3_000_000_000, priority_jump_s=5.0))  # arrived 3 s later, jumps 5 s
    load[(1, 0)] = 0
    assert [e.request_id for e in q.drain_ready()] == ["vip", "jumper", "old"]


def test_deadlines_first_within_a_tier():
    q, load = make()
    load[(1, 0)] = load[(2, 0)] = 200
    q.push(entry("plain", 1))
    q.push(entry("due-late", 2, deadline_ns=900))
    q.push(entry("due-soon", 3, deadline_ns=500))
    load[(2, 0)] = 0
    assert [e.request_id for e in q.drain_ready()] == ["due-soon", "due-late", "plain"]


def test_pin_lanes_have_their_own_head_of_line_blocking():
    q, load = make()
    load[(1, 0)] = load[(2, 0)] = 200
    q.push(entry("shared", 1))
    q.push(entry("pin1", 2, pin=(1, 0)))
    q.push(entry("pin2", 3, pin=(2, 0)))
    load[(2, 0)] = 0  # only rank 2 frees up
    assert [e.request_id for e in q.drain_ready()] == ["shared", "pin2"]
    assert len(q) == 1 and "pin1" in q
    load[(1, 0)] = 0
    assert q.pop_ready().request_id == "pin1"


def test_do_not_queue_and_limits_are_typed_and_leave_the_queue_unchanged():
    q, load = make(limits=QueueLimits(requests_per_worker=1))
    with pytest.raises(DoNotQueue, match="'x': every eligible rank is busy"):
        q.push(entry("x", 1), do_not_queue=True)
    q.push(entry("a", 1), num_workers=2)
    q.push(entry("b", 2), num_workers=2)  # reaches 2 = 1 × 2 workers: still accepted
    with pytest.raises(QueueRejected, match="2 queued requests reached the limit 1 per worker × 2 workers"):
        q.push(entry("c", 3), num_workers=2)
    assert len(q) == 2 and "c" not in q
    with pytest.raises(InvalidArgument, match="already queued"):
        q.push(entry("a", 4), num_workers=9)
    t, load = make(limits=QueueLimits(raw_isl_tokens_per_worker=100))
    t.push(entry("big", 1, isl=150))
    with pytest.raises(QueueRejected, match="raw ISL tokens"):
        t.push(entry("next", 2, isl=1))


def test_remove_cancels_a_waiting_request():
    q, load = make()
    load[(1, 0)] = load[(2, 0)] = 200
    q.push(entry("a", 1))
    q.push(entry("b", 2, pin=(1, 0)))
    assert q.remove("a").request_id == "a" and q.remove("a") is None
    assert q.remove("b").request_id == "b" and len(q) == 0
    load[(1, 0)] = 0
    assert q.pop_ready() is None


def test_drr_shares_dispatch_by_quantum():
    classes = [QueueClass(name="big", busy_threshold=0, quantum=1000),
               QueueClass(name="small", busy_threshold=0, quantum=1000)]
    q, load = make(classes=classes)
    load[(1, 0)] = load[(2, 0)] = 10
    for i in range(4):
        q.push(entry(f"B{i}", i, isl=1000, cls="big"))
        q.push(entry(f"s{i}", i, isl=250, cls="small"))
    load[(1, 0)] = 0
    order = [e.request_id for e in q.drain_ready()]
    # a 1000-token quantum buys one big request or four small ones per round
    assert order == ["B0", "s0", "s1", "s2", "s3", "B1", "B2", "B3"]


def test_unknown_class_and_bad_specs_name_the_field():
    q, _ = make()
    with pytest.raises(InvalidArgument, match="unknown queue class 'gold'; known: default"):
        q.should_queue(RANKS, "gold")
    with pytest.raises(InvalidArgument, match="policy must be .fcfs. or .lcfs. or .wspt."):
        QueueClass(policy="sjf")
    with pytest.raises(InvalidArgument, match="defined twice"):
        PolicyQueue(classes=[QueueClass(), QueueClass()], prefill_tokens=lambda k: 0)


class QueueMachine(RuleBasedStateMachine):
    """No request is lost or duplicated; dispatch order respects tiers and FCFS within a tier."""

    def __init__(self):
        super().__init__()
        self.load = {(1, 0): 200, (2, 0): 200}
        self.q = PolicyQueue(classes=[QueueClass(busy_threshold=100)], prefill_tokens=lambda k: self.load[k])
        self.waiting: dict[str, tuple] = {}  # id -> (tier, arrival, pin)
        self.done: list[str] = []
        self.n = 0

    @rule(tier=st.integers(0, 2), pin=st.sampled_from([None, (1, 0), (2, 0)]))
    def push(self, tier, pin):
        self.n += 1
        rid = f"r{self.n}"
        self.q.push(QueueEntry(rid, ranks=[(1, 0), (2, 0)], arrival_ns=self.n, tier=tier, pin=pin))
        self.waiting[rid] = (tier, self.n, pin)

    @rule(key=st.sampled_from([(1, 0), (2, 0)]), busy=st.booleans())
    def set_load(self, key, busy):
        self.load[key] = 200 if busy else 0

    @rule()
    def release(self):
        free = {k for k, v in self.load.items() if v <= 100}
        out = self.q.drain_ready()
        for lane in {(e.pin,) for e in out}:
            keys = [(-e.tier, e.arrival_ns) for e in out if (e.pin,) == lane]
            assert keys == sorted(keys), "a lane dispatched out of tier/FCFS order"
        for e in out:
            assert e.request_id in self.waiting, "dispatched twice or never queued"
            tier, arrival, pin = self.waiting.pop(e.request_id)
            assert pin is None or pin in free
            # nothing still waiting in the same lane was better ordered
            for other_tier, other_arrival, other_pin in self.waiting.values():
                if other_pin == pin:
                    assert (-other_tier, other_arrival) > (-tier, arrival)
            self.done.append(e.request_id)
        # whatever remains is blocked: its lane's targets are all busy
        for _tier, _arrival, pin in self.waiting.values():
            assert (pin is not None and pin not in free) or (pin is None and not free)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        assert self.q.remove(rid).request_id == rid
        del self.waiting[rid]

    @invariant()
    def nothing_lost(self):
        assert len(self.q) == len(self.waiting)
        assert all(rid in self.q for rid in self.waiting)
        assert len(set(self.done)) == len(self.done)


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
