"""The public embedding contract, exercised as an external host would: through kvemu's face and the modules it names.

Everything used here is documented in docs/embedding.md and must stay stable.
"""

import pickle

import pytest

import kvemu
from kvemu import (
    BlocksStored,
    CustomPolicy,
    InvalidArgument,
    ManualClock,
    QueueEntry,
    QueueRejected,
    RouterEvent,
    RoutingCore,
    SchedulerError,
    SessionAffinity,
    WorkerSpec,
    seconds_to_ns,
    sibling_group_key,
)
from kvemu.affinity import AffinityMode, Hold, Wait
from kvemu.eligibility import AffinityTarget
from kvemu.errors import (
    BlockNotFound,
    BookingFailed,
    DuplicateWorker,
    NoEndpoints,
    ParentBlockNotFound,
    PinnedWorkerNotAllowed,
    PinnedWorkerOverloaded,
    ResourceExhausted,
    UnknownWorker,
)
from kvemu.queue import DoNotQueue, QueueLimits

S = seconds_to_ns


def cluster(workers=3, dp=2, **kw):
    clock = ManualClock()
    core = RoutingCore(block_size=16, clock=clock, seed=1, **kw)
    for w in range(1, workers + 1):
        core.add_worker(WorkerSpec(worker_id=w, dp_size=dp, block_size=16))
    return clock, core


def cache(core, worker, rank, req, n):
    core.apply_event(RouterEvent(worker_id=worker, dp_rank=rank, data=BlocksStored(req.seq_hashes[:n], req.local_hashes[:n])))


def serve(core, affinity, session, tokens, request_id, builder=None):
    """The host's per-request lifecycle: select with affinity, dispatch (accepted), commit, book."""
    req = core.prepare(tokens, request_id=request_id, session_id=session)
    result = core.select_with_affinity(req, builder or core.eligibility(), affinity, session)
    assert not isinstance(result, Wait)
    selection, hold = result
    lease = affinity.commit(hold, selection.key)  # only after the worker accepted the dispatch
    core.book(request_id, selection, req)
    return selection, lease


def test_public_names_are_exported():
    for name in kvemu.__all__:
        assert hasattr(kvemu, name), name


def test_selection_under_allow_list_availability_and_dp_rank():
    clock, core = cluster()
    req = core.prepare(list(range(160)))
    cache(core, 3, 1, req, 10)
    best = core.select(req)
    assert best.key == (3, 1) and best.overlap_blocks == 10
    allowed = core.select(req, core.eligibility().allow([1, 2]).build())
    assert allowed.worker_id in (1, 2) and allowed.overlap_blocks == 0
    down = core.select(req, core.eligibility().set_available(3, False, dp_rank=1).build())
    assert down.key != (3, 1)
    pinned = core.select(req, core.eligibility().pin(2, 1).build())
    assert pinned.key == (2, 1) and pinned.reason == "pinned"
    with pytest.raises(NoEndpoints, match="valid ranks 0..1"):
        core.eligibility().pin(2, 5).build()


def test_affinity_lifecycle_with_virtual_ttl():
    clock, core = cluster()
    affinity = SessionAffinity.with_manual_clock(clock, ttl_secs=60)
    tokens = list(range(64))
    first, lease = serve(core, affinity, "chat", tokens, "r1")
    tokens += list(range(1000, 1064))
    clock.advance(S(1))
    second, lease2 = serve(core, affinity, "chat", tokens, "r2")
    assert second.key == first.key and second.reason == "affinity"
    core.free("r1")
    affinity.release(lease)
    clock.advance(S(3600))  # a live lease keeps the binding however long
    assert affinity.query_target("chat") == first.key
    core.free("r2")
    affinity.release(lease2)  # idle from now
    affinity.advance_clock(clock.now_ns() + S(59))
    assert affinity.query_target("chat") == first.key
    assert affinity.advance_clock(clock.now_ns() + S(1)) == 1
    assert affinity.query_target("chat") is None


def test_concurrent_session_requests_wait_for_the_initializer():
    clock, core = cluster()
    affinity = SessionAffinity.with_manual_clock(clock, ttl_secs=60)
    req = core.prepare(list(range(32)))
    selection, hold = core.select_with_affinity(req, core.eligibility(), affinity, "s")
    assert hold.kind == "initialize"
    assert isinstance(core.select_with_affinity(req, core.eligibility(), affinity, "s"), Wait)
    affinity.commit(hold, selection.key)
    selection2, hold2 = core.select_with_affinity(req, core.eligibility(), affinity, "s")
    assert hold2.kind == "bound" and selection2.key == selection.key


def test_rejected_dispatch_drops_the_hold_and_the_next_request_reselects():
    clock, core = cluster()
    affinity = SessionAffinity.with_manual_clock(clock, ttl_secs=60)
    req = core.prepare(list(range(32)))
    selection, hold = core.select_with_affinity(req, core.eligibility(), affinity, "s")
    affinity.drop(hold)  # the worker rejected the dispatch: nothing is bound, nothing booked
    assert affinity.query_target("s") is None and len(core.load) == 0
    _, hold2 = core.select_with_affinity(req, core.eligibility(), affinity, "s")
    assert isinstance(hold2, Hold) and hold2.kind == "initialize"


def test_fallback_when_the_bound_target_is_ineligible():
    clock, core = cluster()
    hard = SessionAffinity.with_manual_clock(clock, ttl_secs=60)
    first, _ = serve(core, hard, "s", list(range(64)), "r1")
    builder = core.eligibility().set_available(first.worker_id, False)
    moved, lease = serve(core, hard, "s", list(range(64)), "r2", builder)
    assert moved.worker_id != first.worker_id
    assert hard.query_target("s") == moved.key  # hard mode re-initialised the binding
    soft = SessionAffinity.with_manual_clock(clock, ttl_secs=60, mode=AffinityMode.SOFT)
    a, _ = serve(core, soft, "t", list(range(64)), "r3")
    b, _ = serve(core, soft, "t", list(range(64)), "r4", core.eligibility().set_available(a.worker_id, False))
    assert b.worker_id != a.worker_id and soft.query_target("t") == b.key  # soft mode followed


def test_sibling_group_sub_agents_share_one_binding():
    clock, core = cluster()
    affinity = SessionAffinity.with_manual_clock(clock, ttl_secs=60)
    group = sibling_group_key("planner-session")
    a, _ = serve(core, affinity, group, list(range(48)), "child-a")
    b, _ = serve(core, affinity, group, list(range(500, 548)), "child-b")
    assert a.key == b.key
    parent, _ = serve(core, affinity, "planner-session", list(range(900, 948)), "parent")
    assert affinity.query_target("planner-session") == parent.key  # the parent keeps its own key


def test_worker_removal_invalidates_bindings_and_the_next_request_rebinds():
    clock, core = cluster()
    affinity = SessionAffinity.with_manual_clock(clock, ttl_secs=60)
    first, lease = serve(core, affinity, "s", list(range(32)), "r1")
    assert core.remove_worker(first.worker_id) == ["r1"]
    assert affinity.invalidate_worker(first.worker_id) == ["s"]
    assert affinity.release(lease) is False
    again, _ = serve(core, affinity, "s", list(range(32)), "r2")
    assert again.worker_id != first.worker_id and affinity.query_target("s") == again.key


def test_separate_prefill_and_decode_tables():
    clock = ManualClock()
    prefill = RoutingCore(block_size=16, clock=clock, pool="prefill")
    decode = RoutingCore(block_size=16, clock=clock, pool="decode")
    for w in (1, 2):
        prefill.add_worker(WorkerSpec(worker_id=w, worker_type="prefill"))
    for w in (11, 12):
        decode.add_worker(WorkerSpec(worker_id=w, worker_type="decode"))
    p_aff = SessionAffinity.with_manual_clock(clock, ttl_secs=60, pool="prefill", is_member=lambda w: w in prefill.registry)
    d_aff = SessionAffinity.with_manual_clock(clock, ttl_secs=60, pool="decode", is_member=lambda w: w in decode.registry)
    p, _ = serve(prefill, p_aff, "s", list(range(32)), "r1")
    d, _ = serve(decode, d_aff, "s", list(range(32)), "r1")
    assert p.worker_id in (1, 2) and d.worker_id in (11, 12)
    assert p_aff.query_target("s").worker_id == p.worker_id and d_aff.query_target("s").worker_id == d.worker_id
    with pytest.raises(InvalidArgument, match="worker 11 is not in the prefill pool"):
        p_aff.commit(p_aff.try_acquire("other"), (11, 0))


def test_custom_policy_may_ignore_the_advisory_affinity():
    def lowest_id(ctx, rows, costs, rng):
        assert ctx.affinity_target is not None  # it is told about the binding...
        return min(range(len(rows)), key=lambda i: rows[i].key)  # ...and ignores it

    clock, core = cluster(policy=CustomPolicy("lowest-id", scorers=(), picker=lowest_id))
    affinity = SessionAffinity.with_manual_clock(clock, ttl_secs=60, mode="soft")
    hold = affinity.try_acquire("s")
    affinity.commit(hold, (3, 1))
    selection, lease = serve(core, affinity, "s", list(range(32)), "r1")
    assert selection.key == (1, 0) and selection.reason == "policy"
    assert affinity.query_target("s") == AffinityTarget(1, 0)  # soft binding followed the dispatch


def test_errors_carry_what_they_name_and_survive_pickling():
    """Hosts branch on attributes, not on messages; sweeps ship errors across processes by pickle."""
    clock, core = cluster(workers=2)
    seen = []

    def caught(kind, fn):
        with pytest.raises(kind) as e:
            fn()
        seen.append(e.value)
        return e.value

    e = caught(PinnedWorkerNotAllowed, lambda: core.eligibility().allow([2]).pin(1, 0).build())
    assert (e.worker_id, e.dp_rank) == (1, 0) and isinstance(e, SchedulerError)
    e = caught(PinnedWorkerOverloaded,
               lambda: kvemu.EligibilityBuilder(core.registry, overloaded=lambda k: True).pin(2, 1).build())
    assert (e.worker_id, e.dp_rank) == (2, 1)
    e = caught(NoEndpoints, lambda: core.eligibility().pin(2, 5).build())
    assert (e.worker_id, e.dp_rank, e.reason, e.dp_start, e.dp_end) == (2, 5, "dp_rank_unavailable", 0, 2)
    affinity = SessionAffinity.with_manual_clock(clock, ttl_secs=60, max_entries=1)
    serve(core, affinity, "s", list(range(32)), "r1")
    e = caught(PinnedWorkerNotAllowed, lambda: affinity.try_acquire("s", AffinityTarget(9, 0)))
    assert (e.worker_id, e.session_id) == (9, "s") and e.affinity_target.worker_id in (1, 2)
    e = caught(ResourceExhausted, lambda: affinity.try_acquire("t"))
    assert (e.resource, e.limit, e.session_id) == ("session_affinity", 1, "t")
    e = caught(InvalidArgument, lambda: affinity.join_initializing("s", (1, 0)))
    assert e.session_id == "s"
    e = caught(BookingFailed, lambda: core.book("r1", core.select(core.prepare(list(range(32)))),
                                                core.prepare(list(range(32)))))
    assert e.request_id == "r1" and (e.worker_id, e.dp_rank) == core.load.booked_rank("r1")
    e = caught(DuplicateWorker, lambda: core.add_worker(WorkerSpec(worker_id=1)))
    assert e.worker_id == 1
    e = caught(UnknownWorker, lambda: core.remove_worker(42))
    assert e.worker_id == 42
    e = caught(InvalidArgument, lambda: WorkerSpec(worker_id=3, dp_size=0))
    assert (e.field, e.worker_id) == ("dp_size", 3)
    e = caught(ParentBlockNotFound, lambda: core.apply_event(
        RouterEvent(worker_id=1, dp_rank=1, data=BlocksStored([5], [6], parent_hash=77))))
    assert (e.worker_id, e.dp_rank, e.block_hash) == (1, 1, 77)
    e = caught(BlockNotFound, lambda: core.apply_event(
        RouterEvent(worker_id=2, dp_rank=0, data=kvemu.BlocksRemoved([8, 9]))))
    assert (e.worker_id, e.block_hash, e.block_hashes) == (2, 8, (8, 9))
    queue = kvemu.PolicyQueue(classes=[kvemu.QueueClass(busy_threshold=0)], limits=QueueLimits(requests_per_worker=1),
                              prefill_tokens=lambda key: 1)
    queue.push(QueueEntry("q1", ranks=[(1, 0)], arrival_ns=0), num_workers=1)
    e = caught(QueueRejected, lambda: queue.push(QueueEntry("q2", ranks=[(1, 0)], arrival_ns=0), num_workers=1))
    assert (e.request_id, e.policy_class, e.resource, e.current, e.limit) == ("q2", "default", "requests", 1, 1)
    e = caught(DoNotQueue, lambda: queue.push(QueueEntry("q3", ranks=[(1, 0)], arrival_ns=0), do_not_queue=True))
    assert e.request_id == "q3"
    for err in seen:
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.__dict__ == err.__dict__
    with pytest.raises(TypeError, match="no attribute"):
        NoEndpoints("x", colour="red")  # a misspelt attribute is a bug at the raise site, not silence



def test_a_host_with_a_queue_acquires_affinity_first_and_queues_on_the_bound_rank():
    """The documented order: hold first (kept while queued), then the queue on the candidates it allows."""
    clock, core = cluster(workers=1, dp=2)
    affinity = SessionAffinity.with_manual_clock(clock, ttl_secs=60)
    load = {(1, 0): 0, (1, 1): 0}
    queue = kvemu.PolicyQueue(classes=[kvemu.QueueClass(busy_threshold=0)], prefill_tokens=load.__getitem__)
    first, _ = serve(core, affinity, "s", list(range(32)), "r1")
    load[first.key] = 32  # its prefill keeps the bound rank busy
    hold, candidates = core.acquire_affinity(core.eligibility(), affinity, "s")
    assert hold.kind == "bound" and core.selectable(candidates) == (first.key,)
    assert queue.should_queue(core.selectable(candidates), pin=first.key)  # the other rank is idle: no matter
    queue.push(kvemu.QueueEntry("r2", ranks=[first.key], pin=first.key, arrival_ns=0, payload=hold))
    assert affinity.active_leases("s") == 2  # the queued request holds its lease
    assert isinstance(core.acquire_affinity(core.eligibility(), affinity, "new"), tuple)
    assert isinstance(core.acquire_affinity(core.eligibility(), affinity, "new"), Wait)  # its initializer is out
    assert queue.pop_ready() is None
    load[first.key] = 0
    assert queue.pop_ready().payload is hold
