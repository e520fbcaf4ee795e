"""The in-process cluster: each pool's router (and replicas) with its workers, wired for a mode; built from a
scenario by ``harness.run.factories``.

The mode only chooses the clock, the loop (``harness.run.mode``) and the wiring (``harness.run.wiring``, chosen once
per cluster); the router, worker and engine code is the same. Virtual: a ``ManualClock`` driven by the virtual loop, in-memory links carrying message
objects and an in-memory KV bus carrying router-model batches (``cluster.kv_wire_check`` makes both
carry the live bytes). Live: the wall clock on uvloop, ZeroMQ links on 127.0.0.1 and real KV-event
publishers and subscribers per rank.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import anyio

from kvemu.clock import NS_PER_MS, NS_PER_S, Clock
from kvemu.disagg import DECODE
from kvemu.hooks import HookEvent, HookKind, Hooks
from kvemu.messages import ClientRequest
from kvemu.records import RequestRecord
from kvemu.replica_front import Front, ReplicaFrontDoor
from kvemu.runtime.kv_bus import FeedTap, into_stream
from kvemu.runtime.replica_link import ReplicaEnds
from kvemu.runtime.replica_sync_bus import MemorySyncBus
from kvemu.runtime.transport import WorkerEnd
from kvemu.runtime.router import Router
from workers.engine_base import RankCore
from workers.actor.actor import KvPublisher, WorkerActor
from workers.mock_worker import MockWorker

from harness.run.factories import engine_config, pool_router, replica_front
from harness.run.routing_truth import RoutingTruth
from harness.run.pools import AGGREGATED, compose_pools, worker_type_of
from harness.scenario import Scenario
from harness.run.wiring import Wiring, wiring_for

log = logging.getLogger(__name__)

__all__ = ["Cluster", "cluster", "REQUEST_KINDS"]


class Cluster:
    """A running router with its workers (use ``cluster(...)`` to build and start one)."""

    def __init__(self, scenario: Scenario, clock: Clock, hooks: Hooks, wiring: Wiring | None = None, *,
                 keep_history: bool = True) -> None:
        """Compose the routers of every pool (and the aggregated pool's replicas) over ``wiring``; ``cluster()``
        starts them and the workers. ``keep_history``: as ``cluster()``'s."""
        self.scenario = scenario
        self.clock = clock
        self.hooks = hooks
        self.wiring = wiring if wiring is not None else wiring_for(scenario)
        """How its routers and workers are connected (in memory or over ZeroMQ): the cluster's one mode seam."""
        self.worker_pool: dict[int, str] = {}
        self.workers: dict[int, WorkerActor] = {}
        self.starting: set[int] = set()
        """Workers started and not registered yet."""
        self.leaving: set[int] = set()
        """Workers being removed (draining their requests, or about to stop)."""
        self.on_change: Callable[[], None] | None = None
        """Called with no argument whenever a worker registers, starts leaving or is gone (the autoscaler counts)."""
        self._deferring: list[int] = []  # workers whose engines defer KV events (synced before deciding)
        self._tg: anyio.abc.TaskGroup
        self._scopes: dict[int, anyio.CancelScope] = {}
        self.kv_publishers: dict[int, list[KvPublisher]] = {}
        """Per worker, one publisher per rank (chaos sets ``drop_next`` and ``lag_ns`` on them)."""
        self.kv_lag_ns = round(scenario.router.kv_event_lag_ms * NS_PER_MS)
        """How late every publisher publishes (``router.kv_event_lag_ms``; chaos changes it)."""
        self._next_id = 0
        self._router_scopes: dict[int, anyio.CancelScope] = {}
        self.feeds: list[FeedTap] = []
        """With replicas (or a fault aimed at a replica's feed): each replica's KV feed, faults and all."""
        self._truth = RoutingTruth(self.core)  # (one for the cluster: which rank a session last ran on is a fact)
        spec, rspec = scenario.cluster, scenario.router
        n = rspec.replicas
        self._ends = {pool: self.wiring.router_ends(pool, n if pool == AGGREGATED else 1) for pool in spec.pools()}
        self._taps = n > 1 or any(ev.replica is not None and ev.action != "restart_router" for ev in scenario.chaos)
        self.sync: MemorySyncBus | None = None
        """The replicas' booking announcements (``router.replica_sync``), or None."""
        if n > 1 and rspec.replica_sync.enabled:
            self.sync = MemorySyncBus(clock, round(rspec.replica_sync.delay_ms * NS_PER_MS),
                                      rspec.replica_sync.predictions)
        self.routers: dict[str, Router]
        """Each pool's router: ``aggregated``, or ``prefill`` and ``decode``."""
        self.front: Front
        """Where requests go: the router, the ``DisaggRouter`` that chains the pools, or the replicas' front door."""
        self.routers, self.front = compose_pools(spec, self._make_router, clock=clock, hooks=hooks,
                                                 retry_limit=rspec.settings().retry_limit)
        self.router: Router = next(iter(self.routers.values()))
        """The router (a disaggregated cluster: the prefill pool's; ``routers`` has both)."""
        self.replicas: list[Router] = []
        """The aggregated pool's router replicas (``router.replicas``); ``router`` is the first."""
        if not spec.disaggregated:
            self.replicas = [self.router] + [self._make_router(AGGREGATED, i) for i in range(1, n)]
            if n > 1:
                self.front = ReplicaFrontDoor(self.replicas, replica_front(scenario), keep_history)
        self.restarts: list[int] = [0] * n
        """Per replica, times it was restarted."""

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Start every router, then the scenario's workers (prefill ids first, then decode), as tasks of ``tg``;
        returns once each worker is registered (``cluster()`` does this, and stops them on exit)."""
        self._tg = tg
        for router in self.routers.values():
            await self._start_router(router)
        for i in range(1, len(self.replicas)):
            await self._start_router(self.replicas[i], i)
        for pool, (n, _, _) in self.scenario.cluster.pools().items():
            for _ in range(n):
                await self.add_worker(pool)

    def _make_router(self, pool: str, replica: int = 0) -> Router:
        """Pool ``pool``'s router (replica ``replica``), connected to its end, KV feed and replica sync."""
        n = self.scenario.router.replicas
        bus = self.wiring.bus(pool)
        hooks = self.hooks
        router = pool_router(self.scenario, pool, clock=self.clock, end=self._ends[pool][replica], replica=replica,
                             hooks=hooks if replica == 0 else _request_hooks(hooks),
                             kv_replay=bus.replay if bus else None,
                             on_worker_removed=bus.forget if bus and n == 1 else None,
                             zmq_kv_events=bus is None and pool != DECODE, guarded=self.wiring.guarded,
                             reaper=self.wiring.affinity_reaper,
                             watchdog=self.wiring.heartbeat_interval_s is not None)
        subscriber = router.kv.subscriber
        if self._taps and pool != DECODE:
            feed = FeedTap(router.kv_intake if bus is not None else into_stream)
            if replica < len(self.feeds):  # a restarted replica: its feed's faults stay (they are the network's)
                old = self.feeds[replica]
                feed.drop_next, feed.lag_ns, feed.dropped = old.drop_next, old.lag_ns, old.dropped
                self.feeds[replica] = feed
            else:
                self.feeds.append(feed)
            if bus is not None:
                bus.connect(feed, replica=replica)
            elif subscriber is not None:  # live: the replica's own subscriber hands its batches to the feed
                subscriber.feed = feed
        elif bus is not None and pool != DECODE:
            bus.connect(router.kv_intake)
        if self.sync is not None:
            self.sync.attach(replica, router.core, router.capacity_changed)
        return router

    async def handle(self, req: ClientRequest) -> RequestRecord:
        """Run a request on the current front (the router may be restarted meanwhile) and return its record."""
        ended = anyio.Event()
        record = self.front.submit(req, lambda _record: ended.set())
        await ended.wait()
        return record

    def submit(self, req: ClientRequest, on_end: Callable[[RequestRecord], None]) -> None:
        """Start a request on the current router; ``on_end(record)`` when it ended."""
        self.front.submit(req, on_end)

    def set_kv_lag(self, lag_ns: int) -> None:
        """Chaos: every KV publisher, present and future, publishes ``lag_ns`` late."""
        self.kv_lag_ns = lag_ns
        for pubs in self.kv_publishers.values():
            for pub in pubs:
                pub.lag_ns = lag_ns

    async def restart_router(self, replica: int = 0) -> None:
        """Chaos: a router process (replica ``replica``) dies and a new one starts on the same address.

        Requests it held end with ``router_restart``; workers register again when the new router
        hears from them, and it rebuilds its index from their KV-event replay buffers. Its load view starts
        empty: with replica sync it hears only what the others announce from now on.
        """
        if self.scenario.cluster.disaggregated:
            raise ValueError("restart_router is not supported for disaggregated clusters yet")
        if not 0 <= replica < len(self.replicas):
            raise ValueError(f"replica {replica} does not exist (router.replicas is {len(self.replicas)})")
        self.replicas[replica].stop()
        self._router_scopes.pop(replica).cancel()
        new = self.replicas[replica] = self._make_router(AGGREGATED, replica)
        self.restarts[replica] += 1
        if replica == 0:
            self.router = self.routers["aggregated"] = new
            if len(self.replicas) == 1:
                self.front = new
        await self._start_router(new, replica)

    def sync_workers(self) -> None:
        """Virtual time: bring the engines of every worker that defers KV events to now and publish them."""
        for wid in self._deferring:
            actor = self.workers.get(wid)
            if actor is not None:
                actor.sync()

    def unsettled(self) -> int:
        """Requests the workers still work for (unfinished, KV held for a transfer, being offloaded): 0 when the
        server has settled. Read-only; virtual time: the engines as of now (deferred KV events aside)."""
        now = self.clock.now_ns()
        return sum(actor.worker.unsettled(now) for actor in self.workers.values())

    def core(self, worker_id: int, dp_rank: int) -> RankCore | None:
        """The engine of one rank of a running worker (None: gone), for the routing truth's probe."""
        actor = self.workers.get(worker_id)
        if actor is None or dp_rank in actor.dead_ranks:
            return None
        return actor.worker.core(dp_rank)

    async def _start_router(self, router: Router, replica: int = 0) -> None:
        self.wiring.before_select(router, self.sync_workers)
        if router.pool != DECODE:  # (a decode leg's KV comes by transfer: no prefix to choose by)
            router.truth = self._truth
        scope = anyio.CancelScope()
        if router.pool != DECODE:
            self._router_scopes[replica] = scope
        started = anyio.Event()

        async def serve() -> None:
            with scope:
                await router.serve(task_status=_Started(started))

        self._tg.start_soon(serve)
        await started.wait()

    def ranks(self) -> list[tuple[int, int]]:
        """Every (worker, rank) registered now."""
        return [k for router in self.routers.values() for k in router.rank_keys()]

    async def add_worker(self, pool: str | None = None) -> int:
        """Start one more worker (of ``pool``; default: the aggregated pool, else the decode pool) and wait
        until its router registered it; returns its id."""
        spec = self.scenario.cluster
        pool = pool or ("decode" if spec.disaggregated else "aggregated")
        if pool not in self.routers:
            raise ValueError(f"no {pool} pool in this cluster (pools: {', '.join(self.routers)})")
        wid = self._next_id
        self._next_id += 1
        _, dp_size, _ = spec.pools()[pool]
        worker_type = worker_type_of(spec, pool)
        router = self.routers[pool]
        mock = MockWorker(engine_config(spec, pool), worker_id=wid)
        many = pool == AGGREGATED and len(self.replicas) > 1
        ends = self.wiring.worker_ends(pool, wid, self.replicas if many else [router])
        end = self._replica_ends(ends) if many else ends[0]
        pubs = self.kv_publishers[wid] = self.wiring.publishers(pool, wid, dp_size)
        kv_endpoints, kv_replay_endpoints = self.wiring.endpoints(wid)
        actor = WorkerActor(mock, end, self.clock, pubs, mode=self.wiring.mode,
                            heartbeat_interval_s=self.wiring.heartbeat_interval_s, kv_endpoints=kv_endpoints,
                            kv_replay_endpoints=kv_replay_endpoints, worker_type=worker_type)
        for pub in self.kv_publishers[wid]:
            pub.lag_ns = self.kv_lag_ns
        if self.wiring.defers_kv_events(actor):
            self._deferring.append(wid)
        self.workers[wid] = actor
        self.worker_pool[wid] = pool
        self.starting.add(wid)
        scope = anyio.CancelScope()
        self._scopes[wid] = scope

        async def serve() -> None:
            with scope:
                await actor.run()

        self._tg.start_soon(serve)
        with anyio.fail_after(30):  # woken by each registration: in virtual time, starting takes no time
            for router in (self.replicas if many else [self.routers[pool]]):
                while wid not in router.workers:
                    if router.registered.is_set():
                        router.registered = anyio.Event()
                    await router.registered.wait()
        self.starting.discard(wid)
        self._changed()
        return wid

    def _replica_ends(self, ends: list[WorkerEnd]) -> ReplicaEnds:
        """A worker's one link over every replica's end (it keeps each replica hearing from it)."""
        return ReplicaEnds(ends, self.clock.now_ns, round((self.wiring.heartbeat_interval_s or 0) * NS_PER_S))

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _claim(self, worker_id: int, graceful: bool) -> WorkerActor:
        actor = self.workers.get(worker_id)
        if actor is None:
            raise ValueError(f"worker {worker_id} is not running")
        if not graceful and self.wiring.heartbeat_interval_s is None:  # (its router would never notice)
            raise ValueError(f"worker {worker_id} cannot be killed: nothing watches this cluster's heartbeats (a "
                             "scenario whose chaos or autoscaler kills workers, or that sets cluster."
                             "heartbeat_interval_s or router.heartbeat_timeout_s, has them)")
        if worker_id in self.leaving:
            raise ValueError(f"worker {worker_id} is already being removed")
        self.leaving.add(worker_id)
        self._changed()
        return actor

    async def remove_worker(self, worker_id: int, *, graceful: bool = True) -> None:
        """Stop a worker: gracefully (drain, deregister) or abruptly (the router notices the silence)."""
        await self._remove(self._claim(worker_id, graceful), worker_id, graceful)

    def retire(self, worker_id: int, *, graceful: bool = True) -> None:
        """Start removing a worker (as ``remove_worker``) and return at once; it counts as leaving from now."""
        self._tg.start_soon(self._remove, self._claim(worker_id, graceful), worker_id, graceful)

    async def _remove(self, actor: WorkerActor, worker_id: int, graceful: bool) -> None:
        if graceful:
            await actor.shutdown()
        self._scopes[worker_id].cancel()
        del self.workers[worker_id]
        self.leaving.discard(worker_id)
        self._changed()
        await actor.end.aclose()
        self.wiring.worker_gone(self.worker_pool[worker_id], worker_id, replicas=len(self.replicas))


REQUEST_KINDS = (HookKind.REQUEST_ARRIVED, HookKind.ROUTED, HookKind.DISPATCH_ACCEPTED, HookKind.DISPATCH_REJECTED,
                 HookKind.QUEUED, HookKind.FIRST_TOKEN, HookKind.TOKENS, HookKind.COMPLETED, HookKind.FAILED)
"""What a second router replica tells the run's hooks: its requests' steps (its view of the workers and of the KV
events is its own: ``kvemu.replicas`` in the summary)."""


def _request_hooks(hooks: Hooks) -> Hooks:
    """Hooks that pass a replica's request events on to ``hooks`` (counted there; delivered where ``hooks`` has
    observers for their kind) and keep the rest."""
    own = Hooks()
    own.count_into(hooks.counts, REQUEST_KINDS)

    def forward(ev: HookEvent) -> None:
        hooks.emit(ev)

    kinds = [k for k in REQUEST_KINDS if hooks.wants(k)]
    if kinds:
        own.subscribe(forward, *kinds)
    return own


class _Started:
    """A task status that sets an event (to await a task's readiness outside ``TaskGroup.start``)."""

    def __init__(self, event: anyio.Event) -> None:
        self._event = event

    def started(self, value: object = None) -> None:
        self._event.set()


@contextlib.asynccontextmanager
async def cluster(scenario: Scenario, clock: Clock, hooks: Hooks, *, keep_history: bool = True,
                  wiring: Wiring | None = None) -> AsyncIterator[Cluster]:
    """Start each pool's router and its workers on the running loop (prefill worker ids first, then decode);
    stop them on exit. ``keep_history``: with router replicas, the front remembers which replica every request
    reached (a run's report needs it; a server keeps only its open requests'). ``wiring``: how the parts connect
    (default: the scenario's mode's, ``wiring_for``).

    A disaggregated cluster's pools each have their own router and network (or ZeroMQ socket), chained by a
    ``DisaggRouter``; decode workers publish their KV events to nobody, as the reference's do: the decode
    pool places requests by load only (its KV arrives by transfer).
    """
    c = Cluster(scenario, clock, hooks, wiring, keep_history=keep_history)
    async with anyio.create_task_group() as tg:
        await c.start(tg)
        try:
            yield c
        finally:
            tg.cancel_scope.cancel()
    c.wiring.close()
    for router in [*c.routers.values(), *c.replicas[1:]]:
        await router.end.aclose()
