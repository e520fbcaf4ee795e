"""Session affinity on a manual clock: every state transition, hard/soft modes, waiters, overflow."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvemu.affinity import AffinityMode, Hold, SessionAffinity, Wait, sibling_group_key
from kvemu.clock import MAX_TIME_NS, ManualClock, WallClock, seconds_to_ns
from kvemu.eligibility import AffinityTarget
from kvemu.errors import InvalidArgument, PinnedWorkerNotAllowed, ResourceExhausted, SchedulerError

S = seconds_to_ns


def table(ttl=10, **kw):
    clock = ManualClock()
    events = []
    t = SessionAffinity.with_manual_clock(clock, ttl_secs=ttl, observer=events.append, **kw)
    return clock, t, events


def bind(t, session, target=(1, 0)):
    hold = t.try_acquire(session)
    assert isinstance(hold, Hold) and hold.kind == "initialize"
    return t.commit(hold, target)


def test_initialize_commit_then_bound():
    clock, t, events = table()
    lease = bind(t, "s")
    assert t.query_target("s") == AffinityTarget(1, 0)
    hold = t.try_acquire("s")
    assert hold.kind == "bound" and hold.target == (1, 0)
    assert t.active_leases("s") == 2
    assert [e.kind for e in events] == ["bound"]
    assert t.commit(hold, (1, 0)).bound and lease.bound


def test_lease_survives_ttl_many_times_over():
    clock, t, _ = table(ttl=10)
    bind(t, "s")
    clock.advance(S(10_000))
    assert t.expire() == 0
    assert t.query_target("s") == (1, 0)
    assert t.try_acquire("s").kind == "bound"


def test_idle_expiry_restarts_at_the_last_release():
    clock, t, events = table(ttl=10)
    a = bind(t, "s")
    b = t.commit(t.try_acquire("s"), (1, 0))
    clock.advance(S(5))
    t.release(a)  # one lease left: no expiry possible
    clock.advance(S(20))
    assert t.query_target("s") == (1, 0)
    t.release(b)  # last release at t=25 s: deadline 35 s
    clock.advance(S(9))
    assert t.expire() == 0 and t.query_target("s") == (1, 0)
    clock.advance(S(1))
    assert t.query_target("s") is None  # read-only view already says absent
    assert t.expire() == 1 and len(t) == 0
    assert [e.kind for e in events] == ["bound", "released", "expired"]


def test_expired_binding_reinitialises_lazily_on_acquire():
    clock, t, _ = table(ttl=10)
    t.release(bind(t, "s"))
    clock.advance(S(11))
    hold = t.try_acquire("s")  # no expire() call: evaluated at virtual time
    assert hold.kind == "initialize"
    t.commit(hold, (2, 1))
    assert t.query_target("s") == (2, 1) and t.stats.expirations == 1


def test_release_is_idempotent_and_stale_leases_are_ignored():
    clock, t, _ = table()
    lease = bind(t, "s")
    assert t.release(lease) is True
    assert t.release(lease) is False
    t.invalidate("s")
    lease2 = bind(t, "s")
    assert t.release(lease) is False and t.active_leases("s") == 1 and lease2.bound


def test_concurrent_requests_wait_then_see_the_binding():
    clock, t, _ = table()
    init = t.try_acquire("s")
    w = t.try_acquire("s")
    assert isinstance(w, Wait) and t.stats.waits == 1
    woke = []
    t.on_settled(w, lambda: woke.append(t.query_target("s")))
    t.commit(init, (3, 0))
    assert woke == [AffinityTarget(3, 0)]
    assert t.try_acquire("s").target == (3, 0)


def test_dropping_an_uncommitted_hold_wakes_waiters_and_frees_the_slot():
    clock, t, _ = table()
    init = t.try_acquire("s")
    w = t.try_acquire("s")
    woke = []
    t.on_settled(w, lambda: woke.append(True))
    t.drop(init)
    assert woke == [True] and len(t) == 0
    assert t.try_acquire("s").kind == "initialize"
    with pytest.raises(InvalidArgument, match="already committed or dropped"):
        t.commit(init, (1, 0))


def test_dropping_a_bound_hold_releases_its_lease():
    clock, t, _ = table(ttl=10)
    lease = bind(t, "s")
    hold = t.try_acquire("s")
    t.drop(hold)  # dispatch failed
    assert t.active_leases("s") == 1
    t.release(lease)
    clock.advance(S(10))
    assert t.query_target("s") is None


def test_join_initializing_binds_with_two_leases():
    clock, t, _ = table(ttl=10)
    init = t.try_acquire("s")
    joined = t.join_initializing("s", (4, 1))
    assert t.active_leases("s") == 2 and t.query_target("s") == (4, 1)
    own = t.commit(init, (4, 1))  # the initializer's reserved use
    t.release(own)
    t.release(joined)
    clock.advance(S(10))
    assert t.query_target("s") is None
    with pytest.raises(InvalidArgument, match="no pending initialization"):
        t.join_initializing("x", (1, 0))


def test_hard_mode_mismatch_invalidates_and_errors():
    clock, t, events = table(mode="hard")
    bind(t, "s", (1, 0))
    hold = t.try_acquire("s")
    with pytest.raises(InvalidArgument, match="hard-bound to worker 1 rank 0 but was dispatched to worker 2 rank 0"):
        t.commit(hold, (2, 0))
    assert t.query_target("s") is None and events[-1].kind == "invalidated"
    assert t.try_acquire("s").kind == "initialize"


def test_hard_mode_worker_only_binding_accepts_any_rank_of_the_worker():
    clock, t, _ = table(mode="hard")
    bind(t, "s", (1, None))
    assert t.commit(t.try_acquire("s"), (1, 3)).target == (1, None)


def test_soft_mode_follows_the_dispatch():
    clock, t, events = table(mode=AffinityMode.SOFT)
    bind(t, "s", (1, 0))
    lease = t.commit(t.try_acquire("s"), (2, 1))
    assert lease.target == (2, 1) and t.query_target("s") == (2, 1)
    bind(t, "w", (1, None))
    assert t.commit(t.try_acquire("w"), (3, 2)).target == (3, None)  # worker-only stays worker-only
    assert t.stats.rebinds == 2 and events[1].kind == "rebound"
    assert t.invalidate_worker(1) == []  # nothing is bound to worker 1 any more


def test_explicit_pin_must_agree_with_the_binding():
    clock, t, _ = table()
    bind(t, "s", (1, 0))
    with pytest.raises(PinnedWorkerNotAllowed,
                       match="explicit pin worker 2 rank None disagrees with its binding worker 1 rank 0") as e:
        t.try_acquire("s", (2, None))
    assert (e.value.worker_id, e.value.dp_rank, e.value.affinity_target, e.value.session_id) == (2, None, (1, 0), "s")
    assert isinstance(e.value, SchedulerError) and isinstance(e.value, InvalidArgument)
    with pytest.raises(PinnedWorkerNotAllowed, match="rank 1 disagrees"):
        t.try_acquire("s", (1, 1))
    assert t.active_leases("s") == 1  # rejections changed nothing
    assert t.try_acquire("s", (1, 0)).kind == "bound"
    assert t.try_acquire("s", (1, None)).kind == "bound"  # a worker-only pin agrees with a ranked binding
    bind(t, "w", (3, None))
    with pytest.raises(PinnedWorkerNotAllowed, match="rank 1 disagrees with its binding worker 3 rank None"):
        t.try_acquire("w", (3, 1))  # Dynamo: a worker-only binding cannot be narrowed to a rank
    init = t.try_acquire("p", (5, 1))
    with pytest.raises(InvalidArgument, match="pinned worker 5 rank 1"):
        t.commit(init, (5, 0))
    assert t.commit(init, (5, 1)).target == (5, 1)  # still open after the rejected commit


def test_invalidate_worker_drops_all_ranks_and_next_request_reselects():
    clock, t, _ = table()
    bind(t, "a", (1, 0))
    bind(t, "b", (1, 1))
    bind(t, "c", (2, 0))
    assert t.invalidate_worker(1) == ["a", "b"]
    assert t.query_target("a") is None and t.query_target("c") == (2, 0)
    assert t.try_acquire("a").kind == "initialize"


def test_invalidate_all_drops_every_entry_and_wakes_the_waiters():
    clock, t, events = table()
    bind(t, "a", (1, 0))
    bind(t, "b", (2, 0))
    init = t.try_acquire("c")
    woke = []
    t.on_settled(t.try_acquire("c"), lambda: woke.append(t.query_target("c")))
    events.clear()
    assert t.invalidate_all() == ["a", "b", "c"]
    assert len(t) == 0 and woke == [None] and t.stats.invalidations == 3
    assert [(e.kind, e.session) for e in events] == [("invalidated", "a"), ("invalidated", "b")]
    assert t.invalidate_worker(1) == [] and t.invalidate_all() == []
    assert t.commit(init, (3, 0)).bound is False  # the initializer's entry is gone: a detached lease
    assert t.try_acquire("a").kind == "initialize"


def test_invalidate_is_revision_checked():
    clock, t, _ = table()
    bind(t, "s")
    hold = t.try_acquire("s")
    assert t.invalidate("s", revision=hold.revision + 1) is False
    assert t.invalidate("s", revision=hold.revision, version=hold.version + 1) is False
    assert t.invalidate("s", revision=hold.revision, version=hold.version) is True
    assert t.commit(hold, (1, 0)).bound is False  # binding vanished: detached lease


def test_limits_are_typed_errors():
    clock, t, _ = table(max_entries=2, max_session_id_bytes=8)
    bind(t, "a")
    bind(t, "b")
    with pytest.raises(ResourceExhausted, match="full \\(2 entries\\)"):
        t.try_acquire("c")
    with pytest.raises(InvalidArgument, match="9 bytes exceeds max_session_id_bytes=8"):
        t.try_acquire("x" * 9)
    with pytest.raises(InvalidArgument, match="exceeds max_session_id_bytes"):
        t.try_acquire("é" * 5)  # 10 bytes in UTF-8


def test_full_table_reclaims_expired_entries_first():
    clock, t, _ = table(ttl=5, max_entries=1)
    t.release(bind(t, "a"))
    clock.advance(S(5))
    assert t.try_acquire("b").kind == "initialize"


def test_ttl_bounds_and_pool_membership():
    with pytest.raises(InvalidArgument, match="between 1 and 31536000"):
        SessionAffinity(ManualClock(), ttl_secs=0.5)
    clock = ManualClock()
    prefill = SessionAffinity(clock, ttl_secs=10, pool="prefill", is_member=lambda w: w < 10)
    with pytest.raises(InvalidArgument, match="worker 12 is not in the prefill pool"):
        prefill.commit(prefill.try_acquire("s"), (12, 0))


def test_overflow_rejections_leave_bindings_and_time_unchanged():
    with pytest.raises(InvalidArgument, match="exceeds the clock maximum"):
        SessionAffinity(ManualClock(MAX_TIME_NS - 5), ttl_secs=10)
    clock, t, _ = table(ttl=10)
    t.release(bind(t, "s"))
    before = (clock.now_ns(), t.query_target("s"), len(t))
    with pytest.raises(InvalidArgument, match="would exceed the clock maximum"):
        t.advance_clock(MAX_TIME_NS - S(5))
    with pytest.raises(InvalidArgument, match="before the current time"):
        t.advance_clock(-1)
    assert (clock.now_ns(), t.query_target("s"), len(t)) == before
    assert t.advance_clock(S(10)) == 1 and clock.now_ns() == S(10)


def test_sibling_group_key():
    key = sibling_group_key("parent-1")
    assert key.startswith("\x01sg:") and len(key) == 4 + 64
    assert key == sibling_group_key("parent-1") != sibling_group_key("parent-2")
    assert key == "\x01sg:" + __import__("blake3").blake3(b"parent-1").hexdigest()


def test_a_reaper_unless_the_composer_says_none_or_the_host_advances_the_clock():
    assert SessionAffinity(WallClock(), ttl_secs=100).reaper_interval_ns == S(30)
    assert SessionAffinity(WallClock(), ttl_secs=2).reaper_interval_ns == S(2)
    assert SessionAffinity(WallClock(), ttl_secs=2, reaper=False).reaper_interval_ns is None
    assert SessionAffinity(ManualClock(), ttl_secs=2, reaper=False).reaper_interval_ns is None
    clock, t, _ = table()
    assert t.reaper_interval_ns is None  # with_manual_clock: none


class AffinityMachine(RuleBasedStateMachine):
    """SessionAffinity against a tiny model: {session: (target, leases, deadline)} + initializing set."""

    SESSIONS = ["a", "b", "c"]
    TTL = 10

    def __init__(self):
        super().__init__()
        self.clock = ManualClock()
        self.t = SessionAffinity.with_manual_clock(self.clock, ttl_secs=self.TTL, max_entries=2)
        self.bound: dict[str, list] = {}  # session -> [target, leases, deadline, revision]
        self.init: dict[str, Hold] = {}
        self.leases: list = []

    def _live(self, s):
        b = self.bound.get(s)
        return b is not None and (b[1] > 0 or b[2] > self.clock.now_ns())

    def _entries(self):
        return len(self.init) + sum(1 for s in self.bound if self._live(s))

    @rule(s=st.sampled_from(SESSIONS))
    def acquire(self, s):
        if s in self.init:
            assert isinstance(self.t.try_acquire(s), Wait)
        elif self._live(s):
            hold = self.t.try_acquire(s)
            assert hold.kind == "bound" and hold.target == self.bound[s][0]
            self.bound[s][1] += 1
            self.leases.append(self.t.commit(hold, hold.target))
        else:
            self.bound.pop(s, None)
            if self._entries() >= 2:
                with pytest.raises(ResourceExhausted):
                    self.t.try_acquire(s)
                return
            hold = self.t.try_acquire(s)
            assert hold.kind == "initialize"
            self.init[s] = hold

    @precondition(lambda self: self.init)
    @rule(data=st.data(), w=st.integers(0, 2), commit=st.booleans())
    def settle(self, data, w, commit):
        s = data.draw(st.sampled_from(sorted(self.init)))
        hold = self.init.pop(s)
        if commit:
            self.leases.append(self.t.commit(hold, (w, 0)))
            self.bound[s] = [AffinityTarget(w, 0), 1, self.clock.now_ns() + seconds_to_ns(self.TTL), hold.revision]
        else:
            self.t.drop(hold)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        lease = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        b = self.bound.get(lease.session)
        ok = self.t.release(lease)
        assert ok == (b is not None and b[3] == lease.revision and b[1] > 0)
        if ok:
            b[1] -= 1
            b[2] = self.clock.now_ns() + seconds_to_ns(self.TTL)

    @rule(dt=st.integers(0, 15))
    def advance(self, dt):
        self.t.advance_clock(self.clock.now_ns() + seconds_to_ns(dt))
        for s in [s for s in self.bound if not self._live(s)]:
            del self.bound[s]

    @rule(w=st.integers(0, 2))
    def remove_worker(self, w):
        gone = self.t.invalidate_worker(w)
        expected = [s for s, b in self.bound.items() if b[0].worker_id == w]
        assert sorted(gone) == sorted(expected)
        for s in expected:
            del self.bound[s]

    @invariant()
    def targets_agree(self):
        for s in self.SESSIONS:
            expected = self.bound[s][0] if self._live(s) else None
            assert self.t.query_target(s) == expected
            if self._live(s):
                assert self.t.active_leases(s) == self.bound[s][1]


TestAffinityMachine = AffinityMachine.TestCase
TestAffinityMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
