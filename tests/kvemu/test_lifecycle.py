"""The request lifecycle driven directly, as a simulation host drives it: no event loop, no transport."""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvemu import ManualClock, RoutingCore, SessionAffinity
from kvemu.lifecycle import (AFFINITY, DISPATCHED, ENDED, QUEUED, RUNNING, TRANSITIONS, WAITING, Lifecycle,
                             LifecycleSettings)
from kvemu.registry import WorkerSpec
from kvemu.hooks import Hooks
from kvemu.records import EngineFacts
from kvemu.messages import Abort, ClientRequest, Dispatch, DispatchAck, Finished, RequestFailed, TokenBatch

MS = 1_000_000


class Host:
    """A minimal host: a manual clock, a routing core with some workers, a log of sends and ends."""

    def __init__(self, workers=(1, 2), *, grace_s=0.0, timeout_s=1.0, retry_limit=3, affinity=False, deadline_s=None):
        self.clock = ManualClock()
        self.core = RoutingCore(block_size=4, clock=self.clock)
        for w in workers:
            self.core.add_worker(WorkerSpec(worker_id=w))
        self.sent: list[tuple[int, Dispatch]] = []
        self.ended: dict[str, object] = {}
        self.deadlines: list[int] = []
        self.hooks = Hooks()
        self.events = []
        self.hooks.subscribe(self.events.append)
        self.affinity = SessionAffinity(self.clock, ttl_secs=60) if affinity else None
        self.lc = Lifecycle(self.core, send=lambda w, m: self.sent.append((w, m)), clock=self.clock, hooks=self.hooks,
                            settings=LifecycleSettings(retry_limit, timeout_s, grace_s, deadline_s), affinity=self.affinity,
                            on_deadline=self.deadlines.append)

    def submit(self, rid, tokens=(1, 2, 3, 4, 5, 6, 7, 8), **kw):
        def on_end(record):
            assert rid not in self.ended, f"{rid} ended twice"
            self.ended[rid] = record
        return self.lc.submit(ClientRequest(request_id=rid, tokens=list(tokens), max_tokens=2, **kw), on_end)

    def last(self, rid):
        return next((w, m) for w, m in reversed(self.sent) if m.request_id == rid)

    def advance(self, ns):
        self.clock.advance(ns)
        self.lc.poll(self.clock.now_ns())

    def complete(self, rid, worker=None):
        w, _ = self.last(rid)
        w = worker if worker is not None else w
        now = self.clock.now_ns()
        self.lc.on_ack(w, DispatchAck(request_id=rid, accepted=True))
        self.lc.on_tokens(w, TokenBatch(request_id=rid, times_ns=[now + 1]))
        self.lc.on_finished(w, Finished(request_id=rid, times_ns=[now + 2],
                                        engine=EngineFacts(cached_tokens=0, admitted_ns=now)))


def test_dispatch_accept_stream_finish_frees_everything():
    h = Host()
    rec = h.submit("a")
    (w, msg), = h.sent
    assert msg.request_id == "a" and h.lc.flights["a"].stage == DISPATCHED
    assert h.core.load.booked_rank("a") == (w, 0)  # booked before the acknowledgement
    h.complete("a")
    assert h.ended["a"] is rec and rec.failure is None and rec.output_tokens == 2 and rec.attempts == 1
    assert len(h.core.load) == 0 and not h.lc.flights
    assert [e.kind for e in h.events] == ["request_arrived", "routed", "dispatch_accepted", "first_token", "tokens",
                                          "tokens", "completed"]


def test_refusals_exclude_the_rank_and_retries_run_out():
    h = Host(workers=(1, 2), retry_limit=1)
    h.submit("a")
    first, _ = h.sent[0]
    h.lc.on_ack(first, DispatchAck(request_id="a", accepted=False, reason="busy"))
    second, _ = h.sent[1]
    assert second != first and h.core.load.booked_rank("a") == (second, 0)
    h.lc.on_ack(second, DispatchAck(request_id="a", accepted=False, reason="busy"))
    rec = h.ended["a"]
    assert rec.failure == "retries_exhausted: busy" and rec.attempts == 2 and len(h.core.load) == 0
    assert len(h.sent) == 2


def test_dispatch_timeout_is_a_deadline_the_host_polls():
    h = Host(workers=(1,), timeout_s=1.0, retry_limit=0)
    h.submit("a")
    assert h.lc.next_deadline_ns() == 1_000 * MS and h.deadlines == [1_000 * MS]
    h.advance(999 * MS)
    assert "a" not in h.ended
    h.advance(1 * MS)
    assert h.ended["a"].failure == "retries_exhausted: dispatch_timeout" and len(h.core.load) == 0
    assert [e.details.reason for e in h.events if e.kind == "dispatch_rejected"] == ["dispatch_timeout"]
    assert h.lc.next_deadline_ns() is None


def test_an_acknowledged_dispatch_leaves_no_deadline_behind():
    h = Host(workers=(1,))
    h.submit("a")
    h.lc.on_ack(1, DispatchAck(request_id="a", accepted=True))
    assert h.lc.next_deadline_ns() is None
    h.advance(5_000 * MS)
    assert h.lc.flights["a"].stage == RUNNING


def test_replies_from_another_worker_are_ignored():
    h = Host(workers=(1, 2))
    h.submit("a")
    w, _ = h.sent[0]
    other = 3 - w
    h.lc.on_failed(other, RequestFailed(request_id="a", reason="spoofed"))
    h.lc.on_ack(other, DispatchAck(request_id="a", accepted=False))
    h.lc.on_finished(other, Finished(request_id="a", times_ns=[5], engine=EngineFacts(cached_tokens=0, admitted_ns=0)))
    assert "a" not in h.ended and h.lc.flights["a"].stage == DISPATCHED and len(h.sent) == 1
    h.complete("a")
    assert h.ended["a"].failure is None


def test_a_lost_worker_reruns_what_streamed_nothing_and_fails_what_did():
    h = Host(workers=(1, 2))
    h.submit("a")
    h.submit("b", tokens=range(100, 108))
    by = {m.request_id: w for w, m in h.sent}
    assert by["a"] != by["b"]
    h.lc.on_ack(by["b"], DispatchAck(request_id="b", accepted=True))
    h.lc.on_tokens(by["b"], TokenBatch(request_id="b", times_ns=[1]))
    lost = by["b"]
    h.core.remove_worker(lost)
    h.lc.worker_lost(lost)
    assert h.ended["b"].failure == "worker_lost"
    h.core.remove_worker(by["a"])
    h.lc.worker_lost(by["a"])
    assert h.ended["a"].failure.startswith("no_endpoints")  # retried, but nobody is left
    assert len(h.core.load) == 0 and not h.lc.flights


def test_startup_grace_waits_for_a_first_worker_then_gives_up():
    h = Host(workers=(), grace_s=2.0)
    h.submit("a")
    assert h.sent == [] and h.deadlines == [2_000 * MS]
    h.core.add_worker(WorkerSpec(worker_id=7))
    h.lc.worker_added()
    assert h.sent[0][0] == 7
    h2 = Host(workers=(), grace_s=2.0)
    h2.submit("a")
    h2.advance(2_000 * MS)
    assert h2.ended["a"].failure.startswith("no_endpoints")


def test_stop_ends_every_stage_with_the_reason():
    h = Host(workers=(1,), grace_s=0)
    h.submit("a")
    h.submit("b", tokens=range(50, 58))
    h.lc.on_ack(1, DispatchAck(request_id="b", accepted=True))
    h.lc.stop("router_restart")
    assert {r: rec.failure for r, rec in h.ended.items()} == {"a": "router_restart", "b": "router_restart"}
    assert len(h.core.load) == 0
    assert h.submit("c").failure == "router_restart"


def test_stop_ends_waiting_and_affinity_waiting_requests_with_the_reason():
    h = Host(workers=(), grace_s=2.0)
    h.submit("w")  # waiting for a first worker
    h.lc.stop("router_restart")
    assert h.ended["w"].failure == "router_restart"
    h = Host(workers=(1,), affinity=True)
    h.submit("a", session_id="s")
    h.submit("b", session_id="s", tokens=range(9, 17))  # waits for a's binding
    h.lc.stop("router_restart")
    assert {r: rec.failure for r, rec in h.ended.items()} == {"a": "router_restart", "b": "router_restart"}
    assert [e.request_id for e in h.events if e.kind == "completed"] == []


def test_a_session_binding_is_committed_only_after_acceptance():
    h = Host(workers=(1, 2), affinity=True)
    h.submit("a", session_id="s")
    assert h.affinity.query_target("s") is None  # held, not bound
    h.submit("b", session_id="s", tokens=range(9, 17))  # waits for the first turn's binding
    assert len(h.sent) == 1
    w, _ = h.sent[0]
    h.lc.on_ack(w, DispatchAck(request_id="a", accepted=True))
    assert h.affinity.query_target("s").worker_id == w
    assert [x for x, m in h.sent if m.request_id == "b"] == [w]  # the waiter followed the binding
    h.complete("a")
    h.complete("b")
    assert h.ended["a"].failure is None and h.ended["b"].failure is None
    assert h.affinity.active_leases("s") == 0


def test_cancel_frees_what_each_stage_holds_and_aborts_on_the_worker():
    h = Host(workers=(1,), affinity=True)
    h.submit("run", session_id="s")
    w, _ = h.last("run")
    h.lc.on_ack(w, DispatchAck(request_id="run", accepted=True))
    h.submit("wait", session_id="s", tokens=range(9, 17))  # bound session: dispatched to the same worker
    h.submit("new", session_id="t", tokens=range(20, 28))  # its binding is held until acceptance
    assert h.affinity.active_leases("s") == 2 and len(h.core.load) == 3  # a lease and a hold
    for rid in ("run", "wait", "new"):
        assert h.lc.cancel(rid)
        assert h.ended[rid].failure == "cancelled"
        assert h.sent[-1] == (1, Abort(request_id=rid))
    assert len(h.core.load) == 0 and h.affinity.active_leases("s") == 0
    assert h.affinity.query_target("t") is None  # the held binding was dropped, not committed
    assert not h.lc.cancel("run") and not h.lc.cancel("unknown")
    h.lc.on_finished(1, Finished(request_id="run", times_ns=[5]))  # a late reply of the aborted one: ignored
    assert h.ended["run"].failure == "cancelled"
    waiting = Host(workers=(), grace_s=5.0)
    waiting.submit("w")
    assert waiting.lc.cancel("w", "client_disconnected") and waiting.ended["w"].failure == "client_disconnected"
    assert waiting.sent == [] and waiting.lc.next_deadline_ns() is None


class LifecycleMachine(RuleBasedStateMachine):
    """Random interleavings of replies, losses, timeouts and stops: each request ends once, nothing leaks."""

    def __init__(self):
        super().__init__()
        self.h = Host(workers=(1, 2, 3), timeout_s=1.0, retry_limit=2, affinity=True, deadline_s=3.0)
        self.h.lc.transitions = []
        self.n = 0
        self.alive = {1, 2, 3}

    def _open(self, stage):
        return sorted(r for r, f in self.h.lc.flights.items() if f.stage == stage)

    @rule(session=st.sampled_from([None, "s", "t"]))
    def submit(self, session):
        self.n += 1
        self.h.submit(f"r{self.n}", tokens=range(self.n, self.n + 8), session_id=session)

    @precondition(lambda self: self._open(DISPATCHED))
    @rule(data=st.data(), accept=st.booleans(), wrong=st.booleans())
    def ack(self, data, accept, wrong):
        rid = data.draw(st.sampled_from(self._open(DISPATCHED)))
        w = self.h.lc.flights[rid].key[0] + (10 if wrong else 0)
        self.h.lc.on_ack(w, DispatchAck(request_id=rid, accepted=accept, reason=None if accept else "busy"))

    @precondition(lambda self: self._open(RUNNING))
    @rule(data=st.data(), how=st.sampled_from(["tokens", "finish", "fail"]))
    def reply(self, data, how):
        rid = data.draw(st.sampled_from(self._open(RUNNING)))
        w = self.h.lc.flights[rid].key[0]
        t = self.h.clock.now_ns()
        if how == "tokens":
            self.h.lc.on_tokens(w, TokenBatch(request_id=rid, times_ns=[t]))
        elif how == "finish":
            self.h.lc.on_finished(w, Finished(request_id=rid, times_ns=[t],
                                              engine=EngineFacts(cached_tokens=0, admitted_ns=t)))
        else:
            self.h.lc.on_failed(w, RequestFailed(request_id=rid, reason="engine_error"))

    @precondition(lambda self: len(self.alive) > 1)
    @rule(data=st.data())
    def lose_worker(self, data):
        w = data.draw(st.sampled_from(sorted(self.alive)))
        self.alive.discard(w)
        self.h.core.remove_worker(w)
        if self.h.affinity is not None:
            self.h.affinity.invalidate_worker(w)
        self.h.lc.worker_lost(w)

    @precondition(lambda self: self.h.lc.flights)
    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(sorted(self.h.lc.flights)))
        f = self.h.lc.flights[rid]
        held = f.key if f.stage in (DISPATCHED, RUNNING) else None
        before = len(self.h.sent)
        assert self.h.lc.cancel(rid)
        assert self.h.ended[rid].failure == "cancelled"
        aborts = [(w, m) for w, m in self.h.sent[before:] if isinstance(m, Abort)]  # then others may be woken
        assert aborts == ([(held[0], Abort(request_id=rid))] if held is not None else [])

    @rule(ms=st.integers(0, 1500))
    def time_passes(self, ms):
        self.h.advance(ms * MS)

    @invariant()
    def every_request_is_open_or_ended_once(self):
        open_ = set(self.h.lc.flights)
        assert not open_ & set(self.h.ended)
        assert open_ | set(self.h.ended) == {f"r{i}" for i in range(1, self.n + 1)}
        booked = {r for r in open_ if self.h.lc.flights[r].stage in (DISPATCHED, RUNNING)}
        assert {r for r in booked if self.h.core.load.booked_rank(r) is not None} == booked
        assert len(self.h.core.load) == len(booked)

    @invariant()
    def no_request_outlives_its_deadline(self):
        now = self.h.clock.now_ns()
        assert all(now - f.record.arrival_ns < 3_000 * MS for f in self.h.lc.flights.values())
        expired = [r for r, rec in self.h.ended.items() if rec.failure == "deadline_exceeded"]
        assert all(self.h.ended[r].completion_ns is None for r in expired)
        if expired:
            event("a request expired")

    @invariant()
    def every_stage_change_is_in_the_table(self):
        for before, after in self.h.lc.transitions:
            assert after in TRANSITIONS[before], (before, after)
            event(f"{before} -> {after}")
        self.h.lc.transitions.clear()
        assert all(f.stage != ENDED for f in self.h.lc.flights.values())

    def teardown(self):
        open_ = set(self.h.lc.flights)
        self.h.lc.stop("test_over")
        assert not self.h.lc.flights and len(self.h.core.load) == 0
        assert all(self.h.ended[r].failure == "test_over" for r in open_)
        for s in ("s", "t"):
            assert self.h.affinity.active_leases(s) == 0


TestLifecycleMachine = LifecycleMachine.TestCase
TestLifecycleMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_a_request_whose_worker_goes_quiet_fails_at_its_deadline_and_frees_everything():
    h = Host(workers=(1, 2), affinity=True, deadline_s=30.0, timeout_s=5.0)
    h.submit("a", session_id="s")
    w, _ = h.sent[0]
    h.lc.on_ack(w, DispatchAck(request_id="a", accepted=True))
    h.lc.on_tokens(w, TokenBatch(request_id="a", times_ns=[h.clock.now_ns()]))
    assert h.deadlines[0] == 30_000 * MS and h.affinity.active_leases("s") == 1
    h.advance(29_999 * MS)
    assert "a" not in h.ended
    h.advance(1 * MS)
    rec = h.ended["a"]
    assert rec.failure == "deadline_exceeded" and rec.completion_ns is None and rec.output_tokens == 1
    assert len(h.core.load) == 0 and h.affinity.active_leases("s") == 0
    assert [e.record.failure for e in h.events if e.kind == "failed"] == ["deadline_exceeded"]
    h.lc.on_finished(w, Finished(request_id="a", times_ns=[h.clock.now_ns()],
                                        engine=EngineFacts(cached_tokens=0, admitted_ns=0)))
    assert len(h.sent) == 1 and h.lc.next_deadline_ns() is None  # the late reply changes nothing


def test_an_unacknowledged_or_queued_request_fails_at_its_deadline_without_a_retry():
    h = Host(workers=(1,), affinity=True, deadline_s=2.0, timeout_s=5.0)
    h.submit("a", session_id="s")
    h.advance(2_000 * MS)
    assert h.ended["a"].failure == "deadline_exceeded" and len(h.sent) == 1 and len(h.core.load) == 0
    h.submit("b", session_id="s")  # the session can bind again: the dropped hold left nothing behind
    assert len(h.sent) == 2
    idle = Host(workers=(), grace_s=10.0, deadline_s=2.0)
    idle.submit("c")  # waits for a first worker
    idle.advance(2_000 * MS)
    assert idle.ended["c"].failure == "deadline_exceeded" and not idle.lc._waiting


def test_a_reused_request_id_is_not_failed_by_its_predecessors_deadline():
    h = Host(workers=(1,), deadline_s=10.0, timeout_s=60.0)
    h.submit("a")
    h.lc.on_finished(1, Finished(request_id="a", times_ns=[h.clock.now_ns()],
                                        engine=EngineFacts(cached_tokens=0, admitted_ns=0)))
    assert h.ended.pop("a").failure is None
    h.advance(5_000 * MS)
    h.submit("a")
    h.advance(5_000 * MS)  # the first "a"'s deadline
    assert "a" not in h.ended and "a" in h.lc.flights
    h.advance(5_000 * MS)
    assert h.ended["a"].failure == "deadline_exceeded"


def test_a_worker_is_reported_unresponsive_after_dispatches_in_a_row_time_out_and_an_ack_resets_it():
    h = Host(workers=(1,), timeout_s=1.0, retry_limit=5)
    told = []
    h.lc.on_unresponsive = lambda wid, n: told.append((wid, n))
    h.lc.settings.max_unacked = 2
    h.submit("a")
    h.advance(1_000 * MS)  # a timed out (and, excluded from its only worker, failed)
    assert h.lc.unacked == {1: 1} and told == []
    h.submit("b")
    h.lc.on_ack(1, DispatchAck(request_id="b", accepted=True))  # an answer resets the count
    assert h.lc.unacked == {}
    h.submit("c")
    h.submit("d")
    h.advance(1_000 * MS)
    assert told == [(1, 2)]


@pytest.mark.parametrize("reason", ["busy", None])
def test_refusal_reason_is_reported(reason):
    h = Host(workers=(1,), retry_limit=0)
    h.submit("a")
    h.lc.on_ack(1, DispatchAck(request_id="a", accepted=False, reason=reason))
    assert [e.details.reason for e in h.events if e.kind == "dispatch_rejected"] == [reason or "rejected"]


def test_a_pin_that_disagrees_with_the_session_binding_fails_as_pinned_worker_not_allowed():
    """Dynamo rejects it as PinnedWorkerNotAllowed (HTTP 400); the binding and the load are left as they were."""
    from kvemu.http.errors import failure_status

    h = Host(workers=(1, 2), affinity=True)
    h.submit("a", session_id="s")
    bound, _ = h.sent[0]
    h.complete("a")
    other = 3 - bound
    h.submit("b", session_id="s", worker_id=other)
    rec = h.ended["b"]
    assert rec.failure.startswith("pinned_worker_not_allowed: ") and f"worker {other}" in rec.failure
    assert failure_status(rec.failure) == 400
    assert len(h.sent) == 1 and len(h.core.load) == 0 and not h.lc.flights
    assert h.affinity.query_target("s") == (bound, 0) and h.affinity.active_leases("s") == 0
    h.submit("c", session_id="s", worker_id=bound)  # a pin that agrees is served on the binding
    assert h.last("c")[0] == bound


def test_an_affinity_table_refusal_fails_the_request_instead_of_escaping():
    """A session id the table refuses (too long for it) or a full table ends the request with a typed reason;
    before, the error escaped the lifecycle's transition."""
    from kvemu.http.errors import failure_status

    h = Host(workers=(1,), affinity=True)
    h.lc.affinity = h.affinity = SessionAffinity(h.clock, ttl_secs=60, max_session_id_bytes=8, max_entries=1)
    h.submit("a", session_id="much-too-long")
    assert h.ended["a"].failure.startswith("invalid_argument: ") and failure_status(h.ended["a"].failure) == 400
    h.submit("b", session_id="s1")
    h.submit("c", session_id="s2")
    assert h.ended["c"].failure.startswith("resource_exhausted: ") and failure_status(h.ended["c"].failure) == 503
    assert len(h.sent) == 1 and not h.core.load.booked_rank("c")


def test_a_dispatch_that_does_not_encode_fails_the_request_locally_and_never_charges_the_worker():
    """#27: vLLM's ``priority`` of 10**30 made the ``Dispatch`` unencodable; the request stayed booked and
    dispatched, timed out as unacknowledged, and three of them got a healthy worker removed."""
    from kvemu.messages import encode

    h = Host(workers=(1,), timeout_s=1.0, retry_limit=3)
    told = []
    h.lc.on_unresponsive = lambda wid, n: told.append((wid, n))
    h.lc._send = lambda w, m: (encode(m), h.sent.append((w, m)))  # as a ZeroMQ end sends: the bytes first
    for rid in ("a", "b", "c"):
        rec = h.submit(rid, engine_priority=10**30)
        assert h.ended[rid] is rec and rec.failure.startswith("encode_failed: OverflowError")
    assert h.sent == [] and not h.lc.flights and len(h.core.load) == 0  # nothing booked, nothing held
    assert h.lc.next_deadline_ns() is None
    h.advance(10_000 * MS)
    assert h.lc.unacked == {} and told == []  # the worker is not charged
    h.submit("ok")  # and it still serves
    assert len(h.sent) == 1
    h.complete("ok")
    assert h.ended["ok"].failure is None


def test_a_refused_duplicate_id_does_not_mark_the_open_request_failed_in_the_recorder():
    from harness.report.recorder import Recorder

    h = Host(workers=(1,))
    rec = Recorder(h.hooks)
    h.submit("a")
    dup = h.lc.submit(ClientRequest(request_id="a", tokens=[1, 2], max_tokens=1), lambda r: None)
    assert dup.failure == "duplicate_request_id" and h.lc.flights["a"].stage == DISPATCHED
    h.complete("a")
    assert h.ended["a"].failure is None and rec.records["a"].failure is None
    assert rec.failures["duplicate_request_id"] == 1


def test_a_stage_change_outside_the_transition_table_is_refused():
    h = Host(workers=(), grace_s=5.0)  # no worker yet: the request waits for a first one
    h.submit("a")
    f = h.lc.flights["a"]
    with pytest.raises(AssertionError, match="no lifecycle transition waiting -> running"):
        h.lc._enter(f, RUNNING)  # a request that was never dispatched cannot be running
    assert f.stage == WAITING
    assert TRANSITIONS[ENDED] == frozenset() and RUNNING in TRANSITIONS[DISPATCHED]
    assert all(RUNNING not in TRANSITIONS[s] for s in (WAITING, QUEUED, AFFINITY, RUNNING))


def test_an_accepted_request_without_a_first_token_in_time_runs_elsewhere_and_its_worker_is_reported():
    """#43: a worker that accepts and never produces a token held the request to its 3,600 s deadline. With
    ``first_token_timeout_s`` the attempt ends at the bound (the worker is told to abort it), the request runs on
    another worker, and a worker that never produced a first token is reported at once."""
    h = Host(workers=(1, 2), timeout_s=1.0, retry_limit=3)
    h.lc.settings.first_token_timeout_ns = 5_000 * MS
    stalled = []
    h.lc.on_stalled = lambda wid, n: stalled.append((wid, n))
    rec = h.submit("a")
    silent, _ = h.sent[0]
    h.lc.on_ack(silent, DispatchAck(request_id="a", accepted=True))
    assert h.lc.next_deadline_ns() == 5_000 * MS
    h.advance(4_999 * MS)
    assert h.lc.flights["a"].stage == RUNNING and stalled == []
    h.advance(1 * MS)
    assert (silent, Abort(request_id="a", reason="first_token_timeout")) in h.sent
    other, msg = h.sent[-1]
    assert other != silent and isinstance(msg, Dispatch) and stalled == [(silent, 1)]
    h.complete("a")
    assert h.ended["a"] is rec and rec.failure is None and rec.attempts == 2 and rec.worker_id == other


def test_a_first_token_timeout_that_may_not_retry_ends_with_its_reason_and_a_productive_worker_gets_slack():
    h = Host(workers=(1,), timeout_s=1.0, retry_limit=3)
    h.lc.settings.first_token_timeout_ns = 5_000 * MS
    h.lc.settings.max_unacked = 2
    stalled = []
    h.lc.on_stalled = lambda wid, n: stalled.append((wid, n))
    h.submit("ok")
    h.complete("ok")  # worker 1 produced a first token: it is no longer reported at its first timeout
    h.lc.submit(ClientRequest(request_id="a", tokens=[1, 2, 3, 4], max_tokens=2), lambda r: h.ended.update(a=r),
                can_retry=lambda: False)
    h.lc.on_ack(1, DispatchAck(request_id="a", accepted=True))
    h.advance(5_000 * MS)
    assert h.ended["a"].failure == "first_token_timeout" and stalled == [] and h.lc.stalls == {1: 1}
    h.submit("b")
    h.lc.on_ack(1, DispatchAck(request_id="b", accepted=True))
    h.advance(5_000 * MS)
    assert stalled == [(1, 2)]


def test_a_worker_on_probation_that_misses_its_first_ack_is_reported_at_once_and_costs_no_retry():
    """#43: fakes that heartbeat but never acknowledge each cost a real request a retry and ``dispatch_timeout``
    (4 of 10 failed with 8 of them). On probation (no dispatch acknowledged yet) a worker has the shorter bound,
    is reported at its first miss, and the request's retries are not spent on it."""
    h = Host(workers=(1, 2, 3, 4, 5), timeout_s=10.0, retry_limit=0)
    h.lc.settings.probation_ack_timeout_ns = 1_000 * MS
    told = []
    h.lc.on_unresponsive = lambda wid, n: told.append((wid, n))
    h.submit("a")
    for _ in range(4):  # four silent workers in a row: no retry left, yet the request goes on
        w, _ = h.sent[-1]
        h.advance(1_000 * MS)
        assert told[-1] == (w, 1) and "a" not in h.ended
    h.complete("a")
    assert h.ended["a"].failure is None and h.ended["a"].attempts == 5
    assert h.lc.proven == {h.ended["a"].worker_id}
    h.submit("b", worker_id=h.ended["a"].worker_id)  # a proven worker has the ordinary dispatch_timeout
    h.advance(1_000 * MS)
    assert "b" not in h.ended and h.lc.flights["b"].stage == DISPATCHED


def test_a_request_redispatched_to_a_worker_on_probation_that_is_then_removed_spends_no_retry():
    """The fakes of #43 miss their first ack together: a request retried onto one about to be removed with them
    lost its attempt to ``worker_lost`` (1 of 10 failed ``retries_exhausted: worker_lost``)."""
    h = Host(workers=(1, 2, 3, 4), timeout_s=10.0, retry_limit=0)
    h.lc.settings.probation_ack_timeout_ns = 1_000 * MS
    h.submit("a")
    first, _ = h.sent[-1]
    h.core.remove_worker(first)  # as the router removes a worker
    h.lc.worker_lost(first)
    assert "a" not in h.ended
    second, _ = h.sent[-1]
    h.core.remove_worker(second)
    h.lc.worker_lost(second)
    third, _ = h.sent[-1]
    assert len({first, second, third}) == 3 and "a" not in h.ended
    h.complete("a")
    assert h.ended["a"].failure is None
