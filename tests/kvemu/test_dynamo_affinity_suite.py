"""Dynamo's offline-replay affinity suite, held against kvemu's ``Lifecycle``.

Each test mirrors one test of ``lib/mocker/src/replay/offline/extensions/kv_router/affinity_tests.rs`` in
ai-dynamo/dynamo (facts read there, no code copied). Dynamo's placement policy maps onto the lifecycle:

==========================  =====================================================================
Dynamo                      kvemu (``Replay`` below)
==========================  =====================================================================
``place`` -> Immediate      ``Lifecycle.submit`` sends the request's ``Dispatch`` at once
``place`` -> Queued         the request waits: in the policy queue, or for its session's initializer
``dispatch_committed``      the worker accepts (``on_ack``): the hold is committed, waiters wake
``dispatch_aborted``        the request is cancelled while dispatched: load and hold are freed
``request_terminal``        first token and ``Finished``: the prefill load and the lease are freed
``advance_clock``           ``ManualClock.advance_to`` then ``Lifecycle.poll``
released placements         ``Dispatch`` messages sent during the call
``scheduler_id``            the rank (one worker with DP 2: ranks 0 and 1; a second worker: 2 and 3)
==========================  =====================================================================

The cluster is Dynamo's: block size 16, one worker with two DP ranks and ``max_num_batched_tokens`` 16,
temperature 0, prefill tokens tracked, ``router_queue_threshold`` 0.5 when a queue policy is given (a rank
is busy while one 64-token prompt is in prefill there), session affinity with a TTL of 1.25 s.
"""

from __future__ import annotations

import pytest

from kvemu import (
    BlocksStored,
    InvalidArgument,
    ManualClock,
    RouterConfig,
    RouterEvent,
    RoutingCore,
    SessionAffinity,
    WorkerSpec,
    seconds_to_ns,
    sibling_group_key,
)
from kvemu.clock import MAX_TIME_NS
from kvemu.lifecycle import AFFINITY, QUEUED, Lifecycle, LifecycleSettings
from kvemu.hooks import Hooks
from kvemu.records import EngineFacts
from kvemu.messages import Abort, ClientRequest, Dispatch, DispatchAck, Finished, TokenBatch

MS = 1_000_000
PROMPT = [7] * 64


class Replay:
    """Dynamo's ``placement(queue_policy)`` fixture, driven through kvemu's lifecycle."""

    def __init__(self, queue_policy: str | None = None, *, limit_per_worker: int | None = None) -> None:
        self.clock = ManualClock()
        config = RouterConfig(router_temperature=0.0, router_track_prefill_tokens=True,
                              router_queue_threshold=0.5 if queue_policy else None,
                              router_queue_policy=queue_policy or "fcfs",
                              router_queue_limit_per_worker=limit_per_worker)
        self.core = RoutingCore(block_size=16, config=config, clock=self.clock, seed=1)
        self.add_worker(0)
        self.affinity = SessionAffinity.with_manual_clock(self.clock, ttl_secs=1.25)
        self.sent: list[tuple[int, Dispatch | Abort]] = []
        self.ended: dict[str, object] = {}
        self.hooks = Hooks()
        self.routed: list = []
        self.accepted = 0
        self.hooks.subscribe(self.routed.append, "routed")
        self.hooks.subscribe(self._count_accepted, "dispatch_accepted")
        self.queue = self.core.policy_queue()
        self.lc = Lifecycle(self.core, send=lambda w, m: self.sent.append((w, m)), clock=self.clock,
                            hooks=self.hooks, affinity=self.affinity, queue=self.queue,
                            settings=LifecycleSettings(dispatch_timeout_s=1e6, startup_grace_s=0.0,
                                                       request_deadline_s=None))

    def _count_accepted(self, event) -> None:
        self.accepted += 1

    def add_worker(self, worker_id: int) -> None:
        self.core.add_worker(WorkerSpec(worker_id=worker_id, dp_size=2, block_size=16, max_num_batched_tokens=16))

    @staticmethod
    def scheduler_id(key: tuple[int, int]) -> int:
        """Dynamo's scheduler index of a rank: worker w's ranks are 2w and 2w + 1."""
        return 2 * key[0] + key[1]

    def _dispatches(self, since: int) -> list[tuple[str, int]]:
        return [(m.request_id, self.scheduler_id((w, m.dp_rank))) for w, m in self.sent[since:]
                if isinstance(m, Dispatch)]

    def _at(self, now_ms: float) -> None:
        t = seconds_to_ns(now_ms / 1000)
        if t > self.clock.now_ns():
            self.clock.advance_to(t)

    def place(self, rid: str, session: str, now_ms: float = 0.0, tokens=PROMPT, **kw) -> int | None:
        """Submit; the rank it was placed on at once, or ``None`` when it waits ("Queued")."""
        self._at(now_ms)
        start = len(self.sent)
        self.lc.submit(ClientRequest(request_id=rid, tokens=list(tokens), max_tokens=8, session_id=session, **kw),
                       lambda rec: self.ended.__setitem__(rec.request_id, rec))
        placed = dict(self._dispatches(start))
        return placed.get(rid)

    def key(self, rid: str) -> tuple[int, int]:
        return self.lc.flights[rid].key  # type: ignore[return-value]

    def occupy(self, *sessions: str) -> list[int]:
        """Place and commit one request per session (ids "1", "2", ...): each keeps a rank busy."""
        ranks = []
        for n, session in enumerate(sessions, 1):
            ranks.append(self.place(str(n), session))
            self.commit(str(n))
        assert None not in ranks
        return ranks

    def commit(self, rid: str, now_ms: float = 0.0) -> list[tuple[str, int]]:
        self._at(now_ms)
        start = len(self.sent)
        self.lc.on_ack(self.key(rid)[0], DispatchAck(request_id=rid, accepted=True))
        return self._dispatches(start)

    def complete(self, rid: str, now_ms: float = 0.0) -> list[tuple[str, int]]:
        """Dynamo's ``request_terminal``: the released placements."""
        self._at(now_ms)
        start = len(self.sent)
        f = self.lc.flights.get(rid)
        if f is not None and f.key is not None:
            now = self.clock.now_ns()
            self.lc.on_tokens(f.key[0], TokenBatch(request_id=rid, times_ns=[now]))
            self.lc.on_finished(f.key[0], Finished(request_id=rid, times_ns=[now],
                                                   engine=EngineFacts(cached_tokens=0, admitted_ns=now)))
        return self._dispatches(start)

    def abort(self, rid: str, now_ms: float = 0.0) -> list[tuple[str, int]]:
        """Dynamo's ``dispatch_aborted``: the dispatched request goes away before the worker took it."""
        self._at(now_ms)
        start = len(self.sent)
        assert self.lc.cancel(rid, "dispatch_aborted")
        return self._dispatches(start)

    def advance(self, now_ms: float) -> list[tuple[str, int]]:
        self._at(now_ms)
        start = len(self.sent)
        self.lc.poll(self.clock.now_ns())
        return self._dispatches(start)

    def pending(self) -> int:
        """Dynamo's ``router.pending_count()``: queued plus waiting for a session's initializer."""
        return sum(1 for f in self.lc.flights.values() if f.stage in (QUEUED, AFFINITY))

    def cache_on_rank(self, tokens, rank: int, worker_id: int = 0) -> None:
        prepared = self.core.prepare(list(tokens))
        self.core.apply_event(RouterEvent(worker_id=worker_id, dp_rank=rank,
                                          data=BlocksStored(prepared.seq_hashes, prepared.local_hashes)))

    def binding_reused(self) -> list[bool]:
        """Per routing decision, whether it reused the session's binding (Dynamo's ``binding_reused``)."""
        return [e.details.reason == "affinity" for e in self.routed]


@pytest.mark.parametrize("commit_before_arrival", [True, False])
def test_affinity_wspt_ignores_cache_on_another_dp_rank(commit_before_arrival):
    """Mirrors ``affinity_wspt_ignores_cache_on_another_dp_rank``: a session-bound request queues on its
    bound rank and WSPT weighs it by the cache there, not by a copy of its prompt on the other DP rank, so
    the short request goes first and both run on the bound rank."""
    r = Replay("wspt")
    bound = r.place("1", "conversation")
    assert bound is not None
    if commit_before_arrival:
        r.commit("1")
    r.cache_on_rank(PROMPT, 1 - bound)
    assert r.place("2", "conversation") is None  # long, cached on the other rank only
    assert r.place("3", "conversation", tokens=[9] * 16) is None  # short
    if not commit_before_arrival:
        r.commit("1")
    assert (r.queue.get("2").cached_tokens, r.queue.get("2").cost) == (0, 64)
    assert r.complete("1") == [("3", bound)]
    r.commit("3")
    assert r.complete("3") == [("2", bound)]


@pytest.mark.parametrize("commit_before_arrival", [True, False])
def test_affinity_cache_bucket_ignores_cache_on_another_dp_rank(commit_before_arrival):
    """Mirrors ``affinity_cache_bucket_ignores_cache_on_another_dp_rank``: the queued entry of a bound
    request counts no cached tokens (cost = the whole prompt) when its prompt is cached only on the other
    DP rank. kvemu's queue has no uncached-ISL buckets (Dynamo puts it in the ``uncached`` class), so the
    snapshot the bucket is chosen from is what is checked."""
    r = Replay("wspt")
    bound = r.place("1", "conversation")
    if commit_before_arrival:
        r.commit("1")
    r.cache_on_rank(PROMPT, 1 - bound)
    assert r.place("2", "conversation") is None
    if not commit_before_arrival:
        r.commit("1")
    assert r.advance(0.0) == []
    entry = r.queue.get("2")
    assert entry.ranks == ((0, bound),) and entry.cached_tokens == 0 and entry.cost == 64


def test_initialization_waits_for_dispatch_then_releases_same_worker_and_dp():
    """Mirrors ``initialization_waits_for_dispatch_then_releases_same_worker_and_dp``: a second request of a
    session being initialized waits (no queue needed) until the first is accepted, then runs on the same
    worker and DP rank, reusing the binding."""
    r = Replay()
    first = r.place("1", "conversation")
    assert r.place("2", "conversation") is None and r.lc.flights["2"].stage == AFFINITY
    assert r.advance(0.0) == []
    assert r.commit("1") == [("2", first)]
    r.commit("2")
    r.complete("1", 20.0)
    r.complete("2", 25.0)
    assert r.accepted == 2  # Dynamo's post_dispatch_checks
    assert r.affinity.stats.hits == 1
    assert r.ended["1"].dp_rank == r.ended["2"].dp_rank


@pytest.mark.parametrize("queue_policy", [None, "fcfs"])
def test_committed_group_reaches_waiters_behind_another_initializer(queue_policy):
    """Mirrors ``committed_group_reaches_waiters_behind_another_initializer``: a session's waiter wakes when
    its own session commits, whatever another session's initializer does; with a queue and its bound rank
    busy it waits in the queue holding its lease on the binding, and runs there when the rank frees."""
    r = Replay(queue_policy)
    r.place("1", "still-initializing")
    bound = r.place("2", "committed")
    assert bound is not None
    assert r.place("3", "still-initializing") is None
    assert r.place("4", "committed") is None
    released = r.commit("2")
    if queue_policy is not None:
        assert released == [], "the bound rank is still full"
        assert r.lc.flights["4"].stage == QUEUED and r.lc.flights["4"].hold.kind == "bound"
        assert r.affinity.active_leases("committed") == 2  # the hidden waiter holds its lease
        released = r.complete("2", 2_000.0)
    assert released == [("4", bound)]
    r.commit("4", 2_000.0)
    assert r.affinity.stats.hits == 1


def test_failed_dispatch_releases_native_slots_and_initialization():
    """Mirrors ``failed_dispatch_releases_native_slots_and_initialization``: an aborted dispatch frees its
    load and its initialization without publishing a binding; the waiting request then initializes the
    session itself. (kvemu wakes it in the same call; Dynamo at the next ``advance_clock``.)"""
    r = Replay()
    r.place("1", "conversation")
    assert r.place("2", "conversation") is None
    released = r.abort("1")
    assert r.core.load.booked_rank("1") is None and r.ended["1"].failure == "dispatch_aborted"
    assert [m.request_id for _, m in r.sent if isinstance(m, Abort)] == ["1"]  # Dynamo's dispatch_aborts == 1
    assert len(released) == 1 and released[0][0] == "2"
    assert len(r.core.load) == 1 and r.core.load.booked_rank("2") is not None  # only the waiter's own load
    r.commit("2")
    r.complete("2", 1.0)
    assert r.affinity.stats.hits == 0, "an aborted dispatch must not publish a binding"
    assert r.affinity.stats.binds == 1


def test_virtual_ttl_starts_at_last_terminal_and_accepts_fractional_seconds():
    """Mirrors ``virtual_ttl_starts_at_last_terminal_and_accepts_fractional_seconds``: active leases keep a
    binding through any virtual time; the 1.25 s idle TTL counts from the last finished request, so a
    request 1.249 s later reuses the binding and one 1.25 s later re-selects."""
    r = Replay()
    r.place("1", "conversation", 0.0)
    r.commit("1")
    r.place("2", "conversation", 5_000.0)
    r.commit("2")
    r.complete("1", 5_000.0)
    r.complete("2", 5_100.0)
    r.place("3", "conversation", 6_349.0)
    r.commit("3")
    r.complete("3", 6_400.0)
    r.place("4", "conversation", 7_650.0)
    r.commit("4")
    assert r.binding_reused() == [False, True, True, False]


def test_lcfs_waits_for_the_native_initialization_owner():
    """Mirrors ``lcfs_waits_for_the_native_initialization_owner``: the initializer keeps its initialization
    while it queues, so its later sibling waits for it outside the queue (LCFS cannot run the sibling
    first); once bound, the sibling queues on the busy bound rank and runs there after the initializer."""
    r = Replay("lcfs")
    r.occupy("busy-a", "busy-b")
    assert r.place("3", "siblings", 1.0) is None
    assert r.place("4", "siblings", 2.0) is None
    assert len(r.queue) == 1 and r.pending() == 2
    released = r.complete("1", 3.0)
    assert [rid for rid, _ in released] == ["3"], "the initializer keeps its initialization through queueing"
    r.commit("3", 3.0)
    assert r.advance(3.0) == [], "bound busy rank must retain the sibling in the policy queue"
    assert r.complete("3", 4.0) == [("4", released[0][1])]
    r.commit("4", 4.0)


def test_canceling_a_queued_initializer_wakes_its_waiting_sibling():
    """Mirrors ``canceling_a_queued_initializer_wakes_its_waiting_sibling``: cancelling a waiter and then the
    queued initializer leaves one request, which takes over the initialization and runs when a rank frees."""
    r = Replay("wspt")
    r.occupy("busy-a", "busy-b")
    for rid in ("3", "4", "5"):
        assert r.place(rid, "waiting") is None
    assert r.pending() == 3
    assert r.lc.cancel("5") and r.lc.cancel("3")
    assert r.pending() == 1 and r.lc.flights["4"].stage == QUEUED and r.lc.flights["4"].hold.kind == "initialize"
    assert r.advance(0.0) == []
    released = r.complete("1")
    assert [rid for rid, _ in released] == ["4"] and r.pending() == 0
    r.commit("4")


def test_affinity_waiters_observe_cache_at_binding_readiness():
    """Mirrors ``affinity_waiters_observe_cache_at_binding_readiness``: a waiter enters the queue when the
    binding is published and its cost is measured then, with the cache the bound rank holds at that time
    (the whole prompt: cost 1)."""
    r = Replay("wspt")
    bound = r.place("1", "conversation")
    assert r.place("2", "conversation") is None
    assert len(r.queue) == 0
    r.cache_on_rank(PROMPT, bound)
    r.commit("1")
    assert r.advance(0.0) == []
    entry = r.queue.get("2")
    assert (entry.cached_tokens, entry.cost) == (64, 1)


def test_affinity_waiters_use_normal_queue_admission_limits():
    """Mirrors ``affinity_waiters_use_normal_queue_admission_limits``: waiters woken by the binding go
    through the queue's normal admission; the one past the limit is rejected (``queue_rejected``, HTTP 429)
    and the others stay queued. (Dynamo counts its two DP ranks as workers for the per-worker limit; kvemu
    counts workers, so the limit is 2 per worker here to make the same 2-of-2.)"""
    r = Replay("wspt", limit_per_worker=2)
    bound = r.place("1", "conversation")
    r.cache_on_rank(PROMPT, 1 - bound)
    for rid in ("2", "3", "4"):
        assert r.place(rid, "conversation") is None
    r.commit("1")
    failure = r.ended["4"].failure
    assert failure.startswith("queue_rejected: ") and "2 queued requests reached the limit 2" in failure
    assert r.pending() == 2 and len(r.queue) == 2


def test_removed_affinity_worker_retries_queue_admission_and_waiters():
    """Mirrors ``removed_affinity_worker_retries_queue_admission_and_waiters``: requests queued on a
    session bound to a worker that is removed wait (no worker to go to) and, once a worker is added, start
    admission over: the first re-binds the session on the new worker, the other follows it there."""
    r = Replay("wspt", limit_per_worker=2)
    r.place("1", "conversation")
    r.commit("1")
    for rid in ("2", "3"):
        assert r.place(rid, "conversation") is None
    r.core.remove_worker(0)
    r.affinity.invalidate_worker(0)
    r.lc.worker_lost(0)
    assert r.pending() == 2
    assert r.complete("1", 1.0) == [] and r.pending() == 2
    assert r.advance(1.0) == [] and r.pending() == 2
    r.add_worker(1)
    start = len(r.sent)
    r.lc.worker_added()
    released = r._dispatches(start)
    assert len(released) == 1 and released[0][1] >= 2
    first = released[0][0]
    r.commit(first, 1.0)
    assert r.advance(1.0) == []
    released = r.complete(first, 1.0)
    assert len(released) == 1 and released[0][0] != first and released[0][1] >= 2
    assert r.pending() == 0


def test_queued_affinity_does_not_block_another_idle_rank():
    """Mirrors ``queued_affinity_does_not_block_another_idle_rank``: a request queued on its busy bound rank
    does not hold back another session's request whose bound rank frees."""
    r = Replay("fcfs")
    busy, freeing = r.occupy("busy", "freeing")
    assert busy != freeing
    assert r.place("3", "busy", 1.0) is None
    assert r.place("4", "freeing", 2.0) is None
    assert r.complete("2", 3.0) == [("4", freeing)], "an available bound rank must make progress"
    r.commit("4", 3.0)
    assert r.complete("1", 4.0) == [("3", busy)]
    r.commit("3", 4.0)


def test_new_arrival_to_idle_affinity_rank_bypasses_other_rank_backlog():
    """Mirrors ``new_arrival_to_idle_affinity_rank_bypasses_other_rank_backlog``: a new request whose bound
    rank is idle runs at once, although another rank's lane has a backlog."""
    r = Replay("fcfs")
    busy, freeing = r.occupy("busy", "freeing")
    assert busy != freeing
    assert r.complete("2", 1.0) == []
    assert r.place("3", "busy", 2.0) is None
    assert r.place("4", "freeing", 3.0) == freeing
    r.commit("4", 3.0)


def test_initialized_siblings_do_not_block_a_new_session_on_an_idle_rank():
    """Mirrors ``initialized_siblings_do_not_block_a_new_session_on_an_idle_rank``: once the siblings'
    session is bound, its queued waiter sits in the bound rank's lane and does not block a new session's
    request from the other rank when that one frees."""
    r = Replay("fcfs")
    busy, _ = r.occupy("busy", "freeing")
    for rid, session in (("3", "siblings"), ("4", "siblings"), ("5", "new-session")):
        assert r.place(rid, session, float(rid)) is None
    initialized = r.complete("2", 6.0)
    assert [rid for rid, _ in initialized] == ["3"]
    r.commit("3", 6.0)
    assert r.advance(6.0) == []
    assert r.complete("1", 7.0) == [("5", busy)], "a sibling's pin must not block another rank"
    r.commit("5", 7.0)


def test_aborted_initializer_unblocks_its_rank_despite_another_bound_backlog():
    """Mirrors ``aborted_initializer_unblocks_its_rank_despite_another_bound_backlog``: when an initializer's
    dispatch is aborted, its session's waiter initializes the session on the rank it freed, although
    another session's request is queued on the other rank."""
    r = Replay("fcfs")
    r.occupy("busy")
    aborted = r.place("2", "aborted")
    assert r.place("3", "busy", 1.0) is None
    assert r.place("4", "aborted", 2.0) is None
    released = r.abort("2", 3.0) + r.advance(3.0)
    assert released == [("4", aborted)]
    r.commit("4", 3.0)


def test_oversized_affinity_clock_returns_error_without_advancing():
    """Mirrors ``oversized_affinity_clock_returns_error_without_advancing``: a time too large for the clock
    (or whose TTL deadline would overflow it) is rejected and moves neither the clock nor the table; a
    sane time afterwards works."""
    r = Replay()
    for now_ms in (1.7976931348623157e308, 1e22):
        with pytest.raises(InvalidArgument, match="outside the clock range") as e:
            r.place("1", "session", now_ms)
        assert e.value.field == "seconds" and r.clock.now_ns() == 0 and not r.lc.flights
    with pytest.raises(InvalidArgument, match="exceeds the clock maximum"):
        r.clock.advance_to(MAX_TIME_NS + 1)
    with pytest.raises(InvalidArgument, match="would exceed the clock maximum") as e:
        r.affinity.advance_clock(MAX_TIME_NS - seconds_to_ns(1.25) + 1)
    assert e.value.field == "t_ns" and r.clock.now_ns() == 0
    assert r.place("2", "session", 1.0) is not None
    r.commit("2", 1.0)
    assert r.affinity.query_target("session") is not None


def test_sibling_group_uses_conversation_ancestry():
    """Mirrors ``sibling_group_uses_conversation_ancestry_and_play_namespace`` as far as kvemu has the
    notions: children of one parent share one binding key, children of another parent do not, and the
    parent keeps its own session key; the lifecycle binds a child by its parent. kvemu has no play
    namespace or lineage schema (a host puts its play in the parent id), so Dynamo's errors for a request
    without agentic identity or with ambiguous lineage have no counterpart."""
    first, sibling = sibling_group_key("parent"), sibling_group_key("parent")
    assert first == sibling
    assert first != sibling_group_key("play-2/parent")
    assert first != "parent"  # the parent's own key
    r = Replay()
    a = r.place("a", "child-a", parent_session_id="parent")
    r.commit("a")
    b = r.place("b", "child-b", parent_session_id="parent")
    assert a == b and r.affinity.query_target(first) is not None and r.affinity.query_target("parent") is None


@pytest.mark.parametrize("topology", ["aggregated", "disaggregated"])
def test_canonical_replay_reuses_native_cache_in_aggregated_and_disaggregated_dp(tmp_path, topology):
    """Mirrors ``canonical_replay_reuses_native_cache_in_aggregated_and_disaggregated_dp``: a whole virtual
    run with DP 2 and session affinity (TTL 3600 s) sends a session's second turn to the same worker and
    rank as its first, in the aggregated pool and in each disaggregated pool, reusing the binding and the
    first turn's cache."""
    import json

    from harness.run.runner import run_scenario
    from harness.scenario import parse_scenario

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in (
        {"timestamp": 0, "input_length": 64, "output_length": 2, "hash_ids": [1, 2, 3, 4], "session_id": "conversation"},
        {"delay": 100, "input_length": 64, "output_length": 2, "hash_ids": [1, 2, 3, 4], "session_id": "conversation"},
    )))
    pool = "workers: 2, dp_size: 2, engine: {block_size: 16, num_gpu_blocks: 64}"
    cluster = f"{{{pool}}}" if topology == "aggregated" else f"{{prefill: {{{pool}}}, decode: {{{pool}}}}}"
    scenario = parse_scenario(f"""
name: canonical-{topology}
cluster: {cluster}
router: {{policy: kv, affinity: {{enabled: true, ttl_secs: 3600}}}}
workload: {{kind: trace, trace: {trace}, trace_block_size: 16}}
run: {{mode: virtual, seed: 0}}
""")
    run_scenario(scenario, tmp_path / "out")
    first, second = (json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines())
    assert first["failure"] is None and second["failure"] is None
    assert (second["worker_id"], second["dp_rank"]) == (first["worker_id"], first["dp_rank"])
    assert second["routing_reason"] == "affinity" and first["routing_reason"] != "affinity"
    if topology == "disaggregated":
        assert second["prefill_worker_id"] == first["prefill_worker_id"]
    assert second["predicted_overlap_blocks"] > 0 or second["engine_cached_tokens"] > 0


def test_a_session_queued_on_a_rank_that_goes_down_rebinds_at_once():
    """Not in Dynamo's suite: the removed-worker behaviour above, for one rank going down (the router's
    ``rank_down``: the rank joins the lifecycle's unavailable set, its bindings are invalidated). The request
    queued on the bound rank does not wait for that rank: it starts admission over and re-binds."""
    r = Replay("fcfs")
    bound, other = r.occupy("conversation", "busy")
    assert r.place("3", "conversation", 1.0) is None and r.queue.get("3").ranks == ((0, bound),)
    r.lc.unavailable.add((0, bound))
    r.affinity.invalidate_worker(0, bound)
    start = len(r.sent)
    r.lc.capacity_changed()
    assert r._dispatches(start) == [] and r.queue.get("3").ranks == ((0, other),)  # other rank busy: it waits there
    assert r.complete("2", 2.0) == [("3", other)]
    r.commit("3", 2.0)
    assert r.affinity.query_target("conversation") == (0, other)
