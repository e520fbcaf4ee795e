"""The router actor on virtual time with scripted workers: every lifecycle path, no wall-clock sleeps."""

import anyio

from kvemu import ManualClock, RoutingCore, SessionAffinity
from kvemu.hashing import local_block_hashes, sequence_hashes
from kvemu.queue import PolicyQueue, QueueClass
from kvemu.hooks import Hooks
from kvemu.lifecycle import AFFINITY, DISPATCHED, QUEUED, RUNNING, WAITING
from kvemu.runtime.kv_bus import MemoryKvBus
from kvemu.runtime.loop import run_virtual
from kvemu.records import EngineFacts
from kvemu.messages import (
    ClientRequest,
    Deregister,
    Dispatch,
    DispatchAck,
    Draining,
    Finished,
    Heartbeat,
    RankDown,
    Register,
    RegisterAck,
    RequestFailed,
    TokenBatch,
)
from kvemu.runtime.router import Router, RouterSettings
from kvemu.runtime.transport import MemoryNetwork
from kvemu.kv_events import BlockStored, KVEventBatch

BS = 4


class ScriptedWorker:
    """A fake worker: answers dispatches by a policy, streams N tokens 10 ms apart, publishes KV events."""

    def __init__(self, net, bus, worker_id, dp_size=1, *, reject=False, block_size=BS, tokens=3, heartbeat=True):
        self.id = worker_id
        self.end = net.worker_end(worker_id)
        self.bus = bus
        self.dp_size = dp_size
        self.reject = reject
        self.block_size = block_size
        self.tokens = tokens
        self.heartbeat = heartbeat
        self.dispatched: list[Dispatch] = []
        self.ack: RegisterAck | None = None
        self.silent = False

    async def run(self, clock):
        self.end.send_nowait(Register(worker_id=self.id, dp_size=self.dp_size, block_size=self.block_size))
        async with anyio.create_task_group() as tg:
            if self.heartbeat:
                tg.start_soon(self._beat)

            def on_message(msg):
                if isinstance(msg, RegisterAck):
                    self.ack = msg
                    if not msg.accepted:
                        tg.cancel_scope.cancel()
                    return
                self.dispatched.append(msg)
                if self.silent:
                    return
                if self.reject:
                    self.end.send_nowait(DispatchAck(request_id=msg.request_id, accepted=False, reason="busy"))
                    return
                self.end.send_nowait(DispatchAck(request_id=msg.request_id, accepted=True))
                tg.start_soon(self._serve, msg, clock)

            await self.end.serve(on_message)

    async def _beat(self):
        while not self.silent:
            self.end.send_nowait(Heartbeat(worker_id=self.id))
            await anyio.sleep(1)

    async def _serve(self, msg, clock):
        locs = local_block_hashes(msg.tokens, BS)
        seqs = sequence_hashes(locs)
        n = len(locs)
        if n:
            batch = KVEventBatch(ts=0.0, events=[BlockStored(block_hashes=seqs, parent_block_hash=None,
                                                             token_ids=msg.tokens[: n * BS], block_size=BS)])
            self.bus.publisher(self.id, msg.dp_rank).publish(batch)
        times = []
        for _ in range(self.tokens):
            await anyio.sleep(0.01)
            if self.silent:
                return
            times.append(clock.now_ns())
            if len(times) == 1:
                self.end.send_nowait(TokenBatch(request_id=msg.request_id, times_ns=times[:1]))
        self.end.send_nowait(Finished(request_id=msg.request_id, times_ns=times[1:], dp_rank=msg.dp_rank))


def cluster(workers, *, affinity=False, queue=None, settings=None):
    clock = ManualClock()
    net = MemoryNetwork()
    bus = MemoryKvBus()
    core = RoutingCore(block_size=BS, clock=clock, seed=3)
    hooks = Hooks()
    events = []
    hooks.subscribe(events.append)
    aff = SessionAffinity.with_manual_clock(clock, ttl_secs=30) if affinity else None
    router = Router(guarded=False, core=core, end=net.router_end(), clock=clock, hooks=hooks, affinity=aff, queue=queue,
                    kv_replay=bus.replay, settings=settings or RouterSettings(heartbeat_timeout_s=3))
    bus.connect(router.kv_intake)
    ws = [ScriptedWorker(net, bus, **w) if isinstance(w, dict) else ScriptedWorker(net, bus, w) for w in workers]
    return clock, router, ws, events


def run(clock, router, workers, body):
    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(router.serve)
            for w in workers:
                tg.start_soon(w.run, clock)
            await router.wait_for_workers(sum(1 for w in workers if w.block_size == BS))
            out = await body()
            tg.cancel_scope.cancel()
        return out

    return run_virtual(main, clock)


def req(rid, tokens=None, **kw):
    return ClientRequest(request_id=rid, tokens=tokens or list(range(16)), max_tokens=3, **kw)


def kinds(events, rid):
    return [e.kind for e in events if e.request_id == rid]


def test_accepted_request_streams_and_completes():
    clock, router, ws, events = cluster([1, 2])

    async def body():
        return await router.handle(req("a"))

    res = run(clock, router, ws, body)
    assert res.failure is None and res.output_tokens == 3 and res.attempts == 1
    assert kinds(events, "a") == ["request_arrived", "routed", "dispatch_accepted", "first_token", "tokens",
                                  "tokens", "completed"]
    assert res.completion_ns - res.first_token_ns == 20_000_000  # 10 ms per token, virtual time
    assert len(router.core.load) == 0  # freed


def test_kv_events_make_the_next_identical_request_follow_the_cache():
    clock, router, ws, events = cluster([1, 2, 3])

    async def body():
        first = await router.handle(req("a"))
        second = await router.handle(req("b"))
        return first, second

    first, second = run(clock, router, ws, body)
    assert (second.worker_id, second.dp_rank) == (first.worker_id, first.dp_rank)
    routed = [e for e in events if e.kind == "routed" and e.request_id == "b"][0]
    assert routed.details.overlap_blocks == 4 and routed.details.best_overlap_blocks == 4
    assert router.kv_stats[first.worker_id].blocks_stored == 8  # the fake re-announces; the index dedups
    assert router.core.index.tree_size(first.worker_id, first.dp_rank) == 4


def test_rejected_dispatch_reselects_another_worker():
    clock, router, ws, events = cluster([dict(worker_id=1, reject=True), 2])

    async def body():
        return await router.handle(req("a", worker_id=None, allowed_worker_ids=[1, 2]))

    # force the first choice onto the rejecting worker through a warm cache
    res = run(clock, router, ws, body)
    assert res.failure is None and res.worker_id == 2
    rejected = [e for e in events if e.kind == "dispatch_rejected"]
    assert all(e.worker_id == 1 and e.details.reason == "busy" for e in rejected)
    assert res.attempts == len(rejected) + 1


def test_retries_exhausted_fails_with_reason():
    workers = [dict(worker_id=w, reject=True) for w in (1, 2, 3, 4)]
    clock, router, ws, events = cluster(workers, settings=RouterSettings(retry_limit=2))

    async def body():
        return await router.handle(req("a"))

    res = run(clock, router, ws, body)
    assert res.failure.split(":")[0] == "retries_exhausted" and res.attempts == 3
    assert kinds(events, "a")[-1] == "failed"
    tried = [e.worker_id for e in events if e.kind == "dispatch_rejected"]
    assert len(tried) == len(set(tried)) == 3  # a rank that refused is not asked again


def test_every_rank_refusing_ends_with_no_endpoints():
    clock, router, ws, events = cluster([dict(worker_id=1, reject=True)])

    async def body():
        return await router.handle(req("a"))

    res = run(clock, router, ws, body)
    # one routing: the second selection found no rank left, so it routed nothing (as requests.jsonl counts)
    assert res.failure.startswith("no_endpoints") and res.attempts == 1


def test_pin_and_allow_list_errors_are_reasons_not_crashes():
    clock, router, ws, events = cluster([1, 2])

    async def body():
        a = await router.handle(req("a", worker_id=9))
        b = await router.handle(req("b", worker_id=2, allowed_worker_ids=[1]))
        c = await router.handle(req("c", worker_id=2))
        d = await router.handle(ClientRequest(request_id="d", tokens=[], max_tokens=1))
        e = await router.handle(req("\x00e"))
        return a, b, c, d, e

    a, b, c, d, e = run(clock, router, ws, body)
    assert a.failure.startswith("no_endpoints")
    assert b.failure.startswith("pinned_worker_not_allowed")
    assert c.failure is None and c.worker_id == 2
    assert d.failure.startswith("invalid_request: tokens: the prompt is empty")
    assert e.failure.startswith("invalid_request: request_id must not start with a NUL")  # (peer replicas' keys)
    assert e.attempts == 0 and len(router.core.load) == 0


def test_affinity_wait_while_another_request_initialises_the_session():
    clock, router, ws, events = cluster([1, 2, 3], affinity=True)

    async def body():
        results = {}

        async def one(rid, tokens):
            results[rid] = await router.handle(req(rid, tokens, session_id="chat"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "a", list(range(16)))
            tg.start_soon(one, "b", list(range(100, 116)))  # different prompt: only affinity binds it
        return results

    results = run(clock, router, ws, body)
    assert results["a"].worker_id == results["b"].worker_id
    assert router.affinity.stats.waits >= 1 and router.affinity.stats.binds == 1
    assert [e.kind for e in events if e.kind.startswith("affinity")][:1] == ["affinity_bound"]


def test_sibling_group_requests_share_a_binding():
    clock, router, ws, events = cluster([1, 2, 3, 4], affinity=True)

    async def body():
        a = await router.handle(req("a", list(range(16)), parent_session_id="planner"))
        b = await router.handle(req("b", list(range(500, 516)), parent_session_id="planner"))
        return a, b

    a, b = run(clock, router, ws, body)
    assert (a.worker_id, a.dp_rank) == (b.worker_id, b.dp_rank)


def test_worker_removed_mid_stream_fails_streamed_requests_and_rebinds_sessions():
    clock, router, ws, events = cluster([1, 2], affinity=True)

    async def body():
        results = {}

        async def one(rid):
            results[rid] = await router.handle(req(rid, session_id="s"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "a")
            await anyio.sleep(0.015)  # first token is out, the stream is live
            victim = results.get("a") or next(e.worker_id for e in events if e.kind == "dispatch_accepted")
            next(w for w in ws if w.id == victim).silent = True  # stops heartbeats and tokens
        results["b"] = await router.handle(req("b", session_id="s"))
        return victim, results

    victim, results = run(clock, router, ws, body)
    assert results["a"].failure == "worker_lost"
    assert results["b"].failure is None and results["b"].worker_id != victim
    assert victim not in router.workers and router.core.overlaps(router.core.prepare(list(range(16)))) == {
        (results["b"].worker_id, results["b"].dp_rank): 4}
    assert any(e.kind == "worker_removed" and e.worker_id == victim for e in events)


def test_silent_worker_before_first_token_is_retried_elsewhere():
    clock, router, ws, events = cluster([dict(worker_id=1), dict(worker_id=2)], settings=RouterSettings(
        heartbeat_timeout_s=2, dispatch_timeout_s=1))
    ws[0].silent = True  # accepts nothing, never answers, stops heartbeating

    async def body():
        return await router.handle(req("a", allowed_worker_ids=[1, 2]))

    res = run(clock, router, ws, body)
    assert res.failure is None and res.worker_id == 2


def test_registration_refusals_change_nothing():
    clock, router, ws, events = cluster([1, dict(worker_id=5, block_size=16)])

    async def body():
        await anyio.sleep(0.1)
        return ws[1].ack

    ack = run(clock, router, ws, body)
    assert ack is not None and not ack.accepted and "block_size 16 but the router uses 4" in ack.reason
    assert sorted(router.workers) == [1] and 5 not in router.core.registry


def test_queue_holds_requests_until_capacity_frees():
    clock, router, ws, events = cluster([1])
    core = router.core
    router.queue = PolicyQueue(
        classes=[QueueClass(busy_threshold=0)],  # busy while any prefill is in flight
        prefill_tokens=lambda k: core.load.rank(k).active_prefill_tokens if core.load.rank(k) else 0,
    )

    async def body():
        results = {}

        async def one(rid, start):
            await anyio.sleep(start / 1000)
            results[rid] = await router.handle(req(rid, list(range(start, start + 16))))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "a", 0)
            tg.start_soon(one, "b", 1)
        return results

    results = run(clock, router, ws, body)
    assert results["a"].failure is None and results["b"].failure is None
    assert [e.request_id for e in events if e.kind == "queued"] == ["b"]
    # b was only dispatched after a's first token freed the prefill capacity
    first_a = next(e.time_ns for e in events if e.kind == "first_token" and e.request_id == "a")
    disp_b = next(e.time_ns for e in events if e.kind == "dispatch_accepted" and e.request_id == "b")
    assert disp_b >= first_a


def test_duplicate_request_ids_fail_cleanly():
    clock, router, ws, events = cluster([1])

    async def body():
        results = {}

        async def one(tag):
            results[tag] = await router.handle(req("same"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "x")
            tg.start_soon(one, "y")
        return results

    results = run(clock, router, ws, body)
    assert sorted(r.failure is None for r in results.values()) == [False, True]


def test_replies_are_accepted_only_from_the_worker_a_request_was_dispatched_to():
    clock, router, ws, events = cluster([1, 2])

    async def body():
        async with anyio.create_task_group() as tg:
            out = {}

            async def one():
                out["a"] = await router.handle(req("a", worker_id=1))

            tg.start_soon(one)
            await anyio.sleep(0.005)  # dispatched to worker 1 and accepted; worker 2 speaks for it
            ws[1].end.send_nowait(RequestFailed(request_id="a", reason="spoofed"))
            ws[1].end.send_nowait(Finished(request_id="a", times_ns=[1], dp_rank=0))
        return out["a"]

    rec = run(clock, router, ws, body)
    assert rec.failure is None and rec.worker_id == 1 and rec.output_tokens == 3
    assert "failed" not in kinds(events, "a")


def test_a_worker_that_never_acknowledges_is_removed_and_its_requests_go_elsewhere():
    """A peer that registers and heartbeats but never answers dispatches must not keep failing real requests:
    after ``max_unacked_dispatches`` timeouts in a row it is removed, and its requests re-select."""
    clock = ManualClock()
    net = MemoryNetwork()
    router = Router(guarded=False, core=RoutingCore(block_size=4, clock=clock), end=net.router_end(), clock=clock,
                    settings=RouterSettings(dispatch_timeout_s=1.0, max_unacked_dispatches=2, retry_limit=5))
    ended = {}
    good = net.worker_end(2)

    def on_good(msg):  # the real worker accepts and finishes whatever it gets
        if type(msg) is Dispatch:
            t = clock.now_ns()
            good.send_nowait(DispatchAck(request_id=msg.request_id, accepted=True))
            good.send_nowait(Finished(request_id=msg.request_id, times_ns=[t],
                                      engine=EngineFacts(cached_tokens=0, admitted_ns=t)))

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(router.serve)
            router.on_message(b"fake", Register(worker_id=1, block_size=4))  # registers, then stays silent
            good.send_nowait(Register(worker_id=2, block_size=4))
            tg.start_soon(good.serve, on_good)
            await anyio.sleep(0.01)
            for i in range(6):
                router.submit(ClientRequest(request_id=f"r{i}", tokens=[i + 1] * 8, max_tokens=1),
                              lambda rec: ended.__setitem__(rec.request_id, rec))

            with anyio.fail_after(30):
                while len(ended) < 6:
                    await anyio.sleep(0.1)
            tg.cancel_scope.cancel()

    run_virtual(main, clock)
    assert 1 not in router.workers and 2 in router.workers
    assert all(rec.failure is None and rec.worker_id == 2 for rec in ended.values())
    assert router.lifecycle.unacked[1] >= 2  # remembered: a re-registration is dropped at its next timeout
    assert 2 not in router.lifecycle.unacked


def test_a_dispatch_that_does_not_encode_fails_locally_and_never_fences_the_worker():
    """#27: three requests whose ``Dispatch`` could not be encoded (vLLM's priority 10**30) were left booked and
    dispatched, timed out as unacknowledged, and got a healthy worker removed. On a link that encodes as
    ZeroMQ does, they fail at once as ``encode_failed``, free their load, and the worker keeps serving."""
    clock = ManualClock()
    net = MemoryNetwork(wire_check=True)
    bus = MemoryKvBus()
    hooks = Hooks()
    events = []
    hooks.subscribe(events.append)
    router = Router(guarded=False, core=RoutingCore(block_size=BS, clock=clock, seed=3), end=net.router_end(), clock=clock,
                    hooks=hooks, kv_replay=bus.replay,
                    settings=RouterSettings(heartbeat_timeout_s=3, dispatch_timeout_s=1.0, max_unacked_dispatches=3))
    bus.connect(router.kv_intake)
    worker = ScriptedWorker(net, bus, 1)

    async def body():
        bad = [await router.handle(req(f"bad{i}", engine_priority=10**30)) for i in range(3)]
        held = (dict(router.lifecycle.flights), len(router.core.load))
        await anyio.sleep(15)  # past every dispatch timeout the old code left behind
        good = await router.handle(req("good"))
        return bad, held, good

    bad, held, good = run(clock, router, [worker], body)
    assert all(r.failure.startswith("encode_failed: OverflowError") for r in bad)
    assert held == ({}, 0) and [d.request_id for d in worker.dispatched] == ["good"]  # nothing held, nothing sent
    assert 1 in router.workers and router.lifecycle.unacked == {}
    assert not [e for e in events if e.kind in ("worker_fenced", "worker_removed")]
    assert good.failure is None and good.worker_id == 1


def test_control_messages_act_only_for_the_speaking_worker():
    """Draining, RankDown and Deregister from a worker's connection act on that worker; naming another is ignored."""
    clock, router, ws, events = cluster([1, {"worker_id": 2, "dp_size": 2}])

    async def body():
        ws[0].end.send_nowait(Deregister(worker_id=2, reason="not mine"))  # worker 1's connection names worker 2
        ws[0].end.send_nowait(RankDown(worker_id=2, dp_rank=1))
        await anyio.sleep(0.01)
        assert sorted(router.workers) == [1, 2] and router.rank_keys() == ((1, 0), (2, 0), (2, 1))
        ws[1].end.send_nowait(RankDown(worker_id=2, dp_rank=1))
        ws[0].end.send_nowait(Draining(worker_id=1))
        await anyio.sleep(0.01)
        fenced = [(e.worker_id, e.dp_rank, e.details.reason) for e in events if e.kind == "worker_fenced"]
        assert fenced == [(2, 1, "rank_down"), (1, None, "draining")]
        ws[1].end.send_nowait(Deregister(worker_id=2, reason="bye"))
        await anyio.sleep(0.01)
        removed = [(e.worker_id, e.details.reason) for e in events if e.kind == "worker_removed"]
        assert removed == [(2, "deregistered: bye")] and router.rank_keys() == ((1, 0),)

    run(clock, router, ws, body)


def test_host_reads_ranks_load_stages_and_sets_the_truth():
    """What a host (the harness, an autoscaler) reads of a router goes through its own methods, not its parts."""
    clock, router, ws, events = cluster([1, 2])
    probes = []

    def truth(hashes, ranks, chosen, session):
        probes.append((ranks, chosen))
        return 2, 3, "engine"

    router.truth = truth
    assert router.truth is truth

    async def body():
        assert router.rank_keys() == ((1, 0), (2, 0)) and router.in_flight == 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(router.handle, req("a"))
            await anyio.sleep(0.005)  # dispatched and acknowledged, no token yet
            key = next(k for k in router.rank_keys() if router.load.rank(k).active_requests)
            assert router.in_flight == 1 and router.requests_at({RUNNING}) == 1
            assert router.requests_at({WAITING, QUEUED, AFFINITY, DISPATCHED}) == 0
        assert router.in_flight == 0 and router.load.rank(key).active_requests == 0
        other = next(k for k in router.rank_keys() if k != key)
        assert router.indexed_blocks(key) == (4, None) and router.indexed_blocks(other) == (0, None)  # 16 tokens
        return key

    key = run(clock, router, ws, body)
    assert probes == [(((1, 0), (2, 0)), key)]
    done = next(e.record for e in events if e.kind == "completed")
    assert (done.truth_overlap_blocks, done.truth_best_overlap_blocks, done.regret_source) == (2, 3, "engine")
