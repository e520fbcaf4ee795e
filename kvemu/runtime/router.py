"""The router actor: the request lifecycle around the sans-IO policy core, on any clock and transport.

client request → hashes → eligibility (availability, allow-list, pins, affinity) → policy queue if every
eligible rank is busy → select → affinity acquire → book the load → dispatch → worker accepts → commit
the binding (a refusal frees the load and drops the hold) → tokens stream back → first token marks prefill complete → completion frees the load and
releases the lease. A rejected dispatch drops the hold and re-selects, up to ``retry_limit``. Workers
register and heartbeat; a missed heartbeat window removes the worker (fence, forget its cache, invalidate
its bindings, retry or fail its requests). Everything observable is emitted through ``Hooks``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any

import anyio
import msgspec
from msgspec import Meta

from kvemu.affinity import AffinityEvent, Hold, SessionAffinity, Wait, sibling_group_key
from kvemu.clock import NS_PER_S, Clock
from kvemu.errors import InvalidArgument, KvemuError, SchedulerError
from kvemu.events import RouterEvent
from kvemu.queue import DoNotQueue, PolicyQueue, QueueEntry, QueueRejected
from kvemu.records import RequestRecord
from kvemu.registry import WorkerSpec
from kvemu.routing import RoutingCore
from kvemu.runtime.hooks import HookEvent, Hooks
from kvemu.runtime.messages import (
    ClientRequest,
    Deregister,
    Dispatch,
    DispatchAck,
    Draining,
    Finished,
    Heartbeat,
    KvBatch,
    RankDown,
    Register,
    RegisterAck,
    Reregister,
    RequestFailed,
    TokenBatch,
    WorkerMessage,
)
from kvemu.runtime.transport import RouterEnd
from kvemu.validation import check_struct
from kvemu.wire.stream import EventStream, Payload, Replay, WorkerEventStats
from kvemu.wire.subscriber import KvEventSubscriber, StreamSpec

__all__ = ["RouterSettings", "Router"]

log = logging.getLogger("kvemu.router")


class RouterSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Runtime knobs of the router actor (the policy knobs live in ``RouterConfig``); bounds declared once."""

    retry_limit: Annotated[int, Meta(ge=0)] = 3
    """Re-selections after rejected dispatches or lost workers before a request fails."""
    dispatch_timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    """No acknowledgement within this time counts as a rejection."""
    heartbeat_timeout_s: Annotated[float, Meta(gt=0)] = 5.0
    """A worker silent for this long is removed."""
    startup_grace_s: Annotated[float, Meta(ge=0)] = 5.0
    """A router that has no worker yet lets requests wait this long after it started (a fresh or
    restarted router whose workers are still registering) instead of failing them at once."""
    kv_replay_on_connect: bool = True
    """Ask a newly registered worker's ranks to replay their buffered KV events."""

    def __post_init__(self) -> None:
        check_struct(self)


class _Flight:
    """One attempt of a request, from routing to completion; it writes the engine's facts into ``record``."""

    __slots__ = ("request_id", "record", "key", "ack", "done", "lease", "failure")

    def __init__(self, record: RequestRecord) -> None:
        self.request_id = record.request_id
        self.record = record
        self.key: tuple[int, int] | None = None
        self.ack: anyio.Event = anyio.Event()
        self.done: anyio.Event = anyio.Event()
        self.lease: Any = None
        self.failure: str | None = None
        """Why this attempt ended without completing (the request may still be retried)."""
        # a new attempt starts over on another rank (retries happen only before any token came back)
        record.admitted_ns = record.engine_cached_tokens = record.first_token_ns = record.completion_ns = None
        record.preemptions = record.output_tokens = 0


class _WorkerState:
    __slots__ = ("spec", "peer", "last_seen_ns", "flights")

    def __init__(self, spec: WorkerSpec, peer: bytes, now_ns: int) -> None:
        self.spec = spec
        self.peer = peer
        self.last_seen_ns = now_ns
        self.flights: dict[str, None] = {}


class _Retry(Exception):
    """This attempt did not get the request admitted; try another rank."""


class Router:
    """Routes client requests to workers; one instance per pool."""

    def __init__(
        self,
        *,
        core: RoutingCore,
        end: RouterEnd,
        clock: Clock,
        hooks: Hooks | None = None,
        settings: RouterSettings | None = None,
        affinity: SessionAffinity | None = None,
        queue: PolicyQueue | None = None,
        kv_replay: Callable[[int, int], Replay | None] | None = None,
        zmq_kv_events: bool = False,
        on_worker_added: Callable[[Register], None] | None = None,
        on_worker_removed: Callable[[int], None] | None = None,
    ) -> None:
        self.core = core
        self.end = end
        self.clock = clock
        self.hooks = hooks or Hooks()
        self.settings = settings or RouterSettings()
        self.affinity = affinity
        self.queue = queue
        self._kv_replay = kv_replay
        self._on_worker_added = on_worker_added
        self._on_worker_removed = on_worker_removed
        if affinity is not None:
            affinity.observer = self._affinity_event
        self.workers: dict[int, _WorkerState] = {}
        self._peers: dict[bytes, int] = {}  # transport identity -> worker id
        self._down_ranks: set[tuple[int, int]] = set()
        self._asked: set[bytes] = set()  # unknown peers already asked to register again
        self.stopped = False
        self.started_ns = clock.now_ns()
        self.kv_streams: dict[tuple[int, int], EventStream] = {}
        self.kv_stats: dict[int, WorkerEventStats] = {}
        self._flights: dict[str, _Flight] = {}
        self.registered = anyio.Event()
        self.kv_subscriber: KvEventSubscriber | None = None
        """With ``zmq_kv_events``: subscribes to the endpoints workers announce when they register."""
        if zmq_kv_events:
            self.kv_subscriber = KvEventSubscriber(self._apply_kv, block_size=core.block_size,
                                                   observer=self._kv_observer,
                                                   replay_on_connect=self.settings.kv_replay_on_connect)
            self.kv_subscriber.stats = self.kv_stats

    # ------------------------------------------------------------------ serving

    async def serve(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Receive worker messages and watch heartbeats until cancelled."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watchdog)
            if self.kv_subscriber is not None:
                tg.start_soon(self._pump_kv_events, self.kv_subscriber)
            task_status.started()
            await self.end.serve(self.on_message)
            tg.cancel_scope.cancel()

    async def _pump_kv_events(self, subscriber: KvEventSubscriber) -> None:
        """Feed ZeroMQ KV events into the index: poll without blocking, back off while idle."""
        idle = 0.0
        try:
            while True:
                if subscriber.poll(0):
                    idle = 0.0
                    await anyio.sleep(0)
                else:
                    idle = min(0.002, idle + 0.0002)
                    await anyio.sleep(idle)
        finally:
            subscriber.close()

    async def wait_for_workers(self, count: int, timeout_s: float = 30.0) -> None:
        """Return once ``count`` workers are registered (``TimeoutError`` otherwise)."""
        with anyio.fail_after(timeout_s):
            while len(self.workers) < count:
                if self.registered.is_set():
                    self.registered = anyio.Event()
                await self.registered.wait()

    def _now(self) -> int:
        return self.clock.now_ns()

    def _emit(self, kind: str, request_id: str | None = None, worker_id: int | None = None,
              dp_rank: int | None = None, data: dict | None = None) -> None:
        hooks = self.hooks
        if hooks.wants(kind):
            hooks.emit(HookEvent(kind, self._now(), request_id, worker_id, dp_rank, data))

    def on_message(self, peer: bytes, msg: WorkerMessage) -> None:
        """Handle one worker message (the transport's handler; it never raises for a peer's mistakes)."""
        t = type(msg)
        wid = self._peers.get(peer)
        if wid is not None:  # every message proves the worker alive, not only heartbeats
            self.workers[wid].last_seen_ns = self._now()
        elif t is not Register:
            if peer not in self._asked and t is not KvBatch:  # a worker of a previous router: re-register
                self._asked.add(peer)
                self.end.send_nowait(peer, Reregister())
            return
        if t is TokenBatch:
            self._on_tokens(msg)  # type: ignore[arg-type]
        elif t is KvBatch:
            self.kv_intake(wid, msg.dp_rank, msg.seq, msg.payload)  # type: ignore[arg-type,union-attr]
        elif t is Finished:
            self._on_finished(msg)  # type: ignore[arg-type]
        elif t is DispatchAck:
            self._on_ack(msg)  # type: ignore[arg-type]
        elif t is RequestFailed:
            self._on_failed(msg)  # type: ignore[arg-type]
        elif t is Register:
            self._on_register(peer, msg)  # type: ignore[arg-type]
        elif t is Heartbeat:
            pass  # liveness was noted above
        elif msg.worker_id != wid:  # type: ignore[union-attr]
            log.warning("peer %r (worker %s) spoke for worker %s; ignored", peer, wid, msg.worker_id)  # type: ignore[union-attr]
        elif t is Draining:
            self.drain_worker(wid)
        elif t is RankDown:
            self.rank_down(wid, msg.dp_rank)  # type: ignore[union-attr]
        elif t is Deregister:
            self.remove_worker(wid, reason=f"deregistered: {msg.reason}")  # type: ignore[union-attr]

    # ------------------------------------------------------------------ workers

    def _on_register(self, peer: bytes, msg: Register) -> None:
        reason = None
        if peer in self._peers:
            reason = f"this connection already registered worker {self._peers[peer]}"
        elif msg.worker_id in self.workers:
            reason = f"worker id {msg.worker_id} is already registered"
        elif msg.block_size != self.core.block_size:
            reason = (f"worker {msg.worker_id} uses block_size {msg.block_size} but the router uses "
                      f"{self.core.block_size}; prefix matching would silently find nothing")
        spec = None
        if reason is None:
            try:
                spec = WorkerSpec(
                    worker_id=msg.worker_id, dp_start=msg.dp_start, dp_size=msg.dp_size,
                    taints=frozenset(msg.taints), worker_type=msg.worker_type,  # type: ignore[arg-type]
                    block_size=msg.block_size, total_kv_blocks=msg.total_kv_blocks,
                    max_num_batched_tokens=msg.max_num_batched_tokens,
                )
                self.core.add_worker(spec)
            except (KvemuError, ValueError, TypeError) as exc:
                reason = str(exc)
        self._send(peer, RegisterAck(worker_id=msg.worker_id, accepted=reason is None, reason=reason))
        if reason is not None:
            log.warning("registration refused: %s", reason)
            return
        assert spec is not None
        self.workers[msg.worker_id] = _WorkerState(spec, peer, self._now())
        self._peers[peer] = msg.worker_id
        self._asked.discard(peer)
        stats = self.kv_stats.setdefault(msg.worker_id, WorkerEventStats())
        for rank in spec.ranks:
            replay = self._kv_replay(msg.worker_id, rank) if self._kv_replay else None
            self.kv_streams[(msg.worker_id, rank)] = EventStream(
                msg.worker_id, rank, sink=self._apply_kv, block_size=self.core.block_size, stats=stats,
                replay=replay, replay_on_connect=self.settings.kv_replay_on_connect, observer=self._kv_observer,
            )
        for rank in spec.ranks:  # rebuild what this worker caches from its publishers' replay buffers
            stream = self.kv_streams.get((msg.worker_id, rank))
            if stream is not None and self.settings.kv_replay_on_connect:
                stream.sync()
        if self.kv_subscriber is not None:
            for r, endpoint in enumerate(msg.kv_endpoints):
                replay = msg.kv_replay_endpoints[r] if r < len(msg.kv_replay_endpoints) else ""
                self.kv_subscriber.add(StreamSpec(msg.worker_id, msg.dp_start + r, endpoint, replay or None))
        if self._on_worker_added is not None:
            self._on_worker_added(msg)
        self._emit("worker_added", worker_id=msg.worker_id, data={"dp_size": msg.dp_size, "dp_start": msg.dp_start})
        self.registered.set()
        self._capacity_changed()

    def stop(self, reason: str = "router_restart") -> None:
        """This router instance goes away: every request it holds ends with ``reason``."""
        self.stopped = True
        for flight in list(self._flights.values()):
            if not flight.done.is_set():
                flight.failure = reason
                flight.ack.set()
                flight.done.set()
        if self.queue is not None:
            for entry in [self.queue.remove(rid) for rid in list(self.queue._entries)]:
                entry.payload.set()  # type: ignore[union-attr]
        if self.affinity is not None:
            for session in list(self.affinity._table):
                self.affinity.invalidate(session)  # wakes requests waiting for an initializer

    def drain_worker(self, worker_id: int) -> None:
        """Stop routing to a worker that is shutting down; its requests in flight finish normally."""
        if worker_id not in self.workers or self.core.registry.is_fenced(worker_id):
            return
        self.core.registry.fence(worker_id)
        if self.affinity is not None:
            self.affinity.invalidate_worker(worker_id)
        self._emit("worker_fenced", worker_id=worker_id, data={"reason": "draining"})

    def rank_down(self, worker_id: int, dp_rank: int) -> None:
        """One rank died: forget its cache and its session bindings, route nothing more to it."""
        if worker_id not in self.workers or (worker_id, dp_rank) in self._down_ranks:
            return
        self._down_ranks.add((worker_id, dp_rank))
        self.core.index.clear(worker_id, dp_rank)
        if self.affinity is not None:
            self.affinity.invalidate_worker(worker_id, dp_rank)
        self._emit("worker_fenced", worker_id=worker_id, dp_rank=dp_rank, data={"reason": "rank_down"})
        self._capacity_changed()

    def remove_worker(self, worker_id: int, *, reason: str) -> None:
        """Forget a worker: index, load, bindings; its in-flight requests are retried or failed."""
        state = self.workers.pop(worker_id, None)
        if state is None:
            return
        self._peers.pop(state.peer, None)
        self._down_ranks = {k for k in self._down_ranks if k[0] != worker_id}
        self._emit("worker_fenced", worker_id=worker_id, data={"reason": reason})
        self.core.remove_worker(worker_id)
        for key in [k for k in self.kv_streams if k[0] == worker_id]:
            del self.kv_streams[key]
        if self.affinity is not None:
            self.affinity.invalidate_worker(worker_id)
        for request_id in list(state.flights):
            flight = self._flights.get(request_id)
            if flight is not None and not flight.done.is_set():
                flight.failure = "worker_lost"
                flight.ack.set()
                flight.done.set()
        if self.kv_subscriber is not None:
            self.kv_subscriber.remove_worker(worker_id)
        if self._on_worker_removed is not None:
            self._on_worker_removed(worker_id)
        self._emit("worker_removed", worker_id=worker_id, data={"reason": reason})
        self._capacity_changed()

    async def _watchdog(self) -> None:
        timeout_ns = round(self.settings.heartbeat_timeout_s * NS_PER_S)
        period = self.settings.heartbeat_timeout_s / 4
        while True:
            await anyio.sleep(period)
            now = self._now()
            for wid in sorted(w for w, s in self.workers.items() if now - s.last_seen_ns > timeout_ns):
                self.remove_worker(wid, reason="missed heartbeats")

    # ------------------------------------------------------------------ KV events

    def kv_intake(self, worker_id: int, dp_rank: int, seq: int, payload: Payload) -> None:
        """A KV-event batch from an in-memory transport."""
        stream = self.kv_streams.get((worker_id, dp_rank))
        if stream is not None:
            stream.receive(seq, payload)

    def _apply_kv(self, event: RouterEvent) -> None:
        if event.worker_id in self.workers:
            self.core.apply_event(event)

    def _kv_observer(self, kind: str, worker_id: int, dp_rank: int, details: dict) -> None:
        self._emit(f"kv_{kind}", worker_id=worker_id, dp_rank=dp_rank, data=details)

    def _affinity_event(self, ev: AffinityEvent) -> None:
        t = ev.target
        self._emit(f"affinity_{ev.kind}", worker_id=t.worker_id if t else None, dp_rank=t.dp_rank if t else None,
                   data={"session": ev.session, "pool": ev.pool})

    # ------------------------------------------------------------------ requests

    async def handle(self, req: ClientRequest) -> RequestRecord:
        """Run one request to completion or failure and return its record (it never raises for routing failures).

        The record holds what the router sees; ``best_overlap_blocks`` and ``token_times_ns`` are left to hook
        observers (the harness recorder), which would otherwise cost every request.
        """
        result = RequestRecord(request_id=req.request_id, session_id=req.session_id,
                               parent_session_id=req.parent_session_id, arrival_ns=self._now(),
                               isl=len(req.tokens), max_tokens=req.max_tokens)
        if req.request_id in self._flights:
            result.failure = "duplicate_request_id"
            self._emit("failed", req.request_id, data={"reason": result.failure})
            return result
        self._emit("request_arrived", req.request_id, data={
            "isl": len(req.tokens), "max_tokens": req.max_tokens, "session_id": req.session_id,
            "parent_session_id": req.parent_session_id})
        try:
            reason = _validate(req)
            if reason is not None:
                raise InvalidArgument(reason)
            prepared = self.core.prepare(
                req.tokens, request_id=req.request_id, session_id=req.session_id, lora_name=req.lora_name,
                overrides=req.router_overrides,
            )
        except KvemuError as exc:
            result.failure = f"invalid_request: {exc}"
            self._emit("failed", req.request_id, data={"reason": result.failure})
            return result
        grace_ns = round(self.settings.startup_grace_s * NS_PER_S) - (self._now() - self.started_ns)
        if not self.workers and grace_ns > 0:
            with anyio.move_on_after(grace_ns / NS_PER_S):
                await self.wait_for_workers(1, timeout_s=grace_ns / NS_PER_S + 1)
        flight = _Flight(result)
        self._flights[req.request_id] = flight
        refused: list[tuple[int, int]] = []
        try:
            for attempt in range(self.settings.retry_limit + 1):
                result.attempts = attempt + 1
                try:
                    await self._attempt(req, prepared, flight, attempt, refused)
                except _Retry:
                    if self.stopped:
                        result.failure = flight.failure or "router_restart"
                        break
                    flight = self._flights[req.request_id] = _Flight(result)
                    continue
                except SchedulerError as exc:
                    result.failure = _reason(exc)
                    break
                except (QueueRejected, DoNotQueue) as exc:
                    result.failure = _reason(exc)
                    break
                break
            else:
                result.failure = "retries_exhausted"
            if result.failure is None and flight.failure is not None:
                result.failure = flight.failure
            if result.failure is None:
                self._emit("completed", req.request_id, *(flight.key or (None, None)), data={
                    "output_tokens": result.output_tokens, "cached_tokens": result.engine_cached_tokens or 0,
                    "admitted_ns": result.admitted_ns, "preemptions": result.preemptions})
            else:
                result.completion_ns = None
                self._emit("failed", req.request_id, *(flight.key or (None, None)), data={"reason": result.failure})
            return result
        finally:
            self._flights.pop(req.request_id, None)

    async def _attempt(self, req: ClientRequest, prepared: Any, flight: _Flight, attempt: int,
                       refused: list[tuple[int, int]]) -> None:
        core = self.core
        builder = core.eligibility()
        for w, r in refused:  # ranks that already turned this request away
            builder.set_available(w, False, dp_rank=r)
        for w, r in self._down_ranks:
            builder.set_available(w, False, dp_rank=r)
        if req.allowed_worker_ids is not None:
            builder.allow(req.allowed_worker_ids)
        if req.worker_id is not None or req.dp_rank is not None:
            builder.pin(req.worker_id, req.dp_rank)
        await self._maybe_queue(req, builder, prepared, flight.record)
        hold: Hold | None = None
        affinity = self.affinity
        key = _affinity_key(req)
        if affinity is not None and key is not None:
            while True:
                got = core.select_with_affinity(prepared, builder, affinity, key)
                if not isinstance(got, Wait):
                    selection, hold = got
                    break
                settled = anyio.Event()
                affinity.on_settled(got, settled.set)
                await settled.wait()
                if self.stopped:
                    flight.failure = "router_restart"
                    raise _Retry
        else:
            selection = core.select(prepared, builder.build())
        wid, rank = selection.worker_id, selection.dp_rank
        record = flight.record
        record.worker_id, record.dp_rank, record.routed_ns = wid, rank, self._now()
        record.routing_reason, record.predicted_overlap_blocks = selection.reason, selection.overlap_blocks
        if self.hooks.wants("routed"):
            ev = selection.evaluation
            overlaps = ev.inputs["overlaps"] if ev.inputs is not None else core.overlaps(prepared)
            self._emit("routed", req.request_id, wid, rank, data={
                "attempt": attempt, "reason": selection.reason, "cost": selection.cost,
                "overlap_blocks": selection.overlap_blocks,
                "best_overlap_blocks": max(overlaps.values(), default=0),
                "candidates": [(k[0], k[1], c, overlaps.get(k, 0)) for k, c in zip(ev.ranks, ev.costs)],
            })
        state = self.workers.get(wid)
        if state is None:  # pragma: no cover - selection only returns registered workers
            if hold is not None:
                affinity.drop(hold)  # type: ignore[union-attr]
            raise _Retry
        flight.key = (wid, rank)
        state.flights[req.request_id] = None
        # book now, so that requests routed while this one awaits its acknowledgement see its load;
        # a refusal frees it again (the affinity binding, by contrast, waits for the acceptance)
        core.book(req.request_id, selection, prepared)
        self._send(state.peer, Dispatch(request_id=req.request_id, dp_rank=rank, tokens=req.tokens,
                                          max_tokens=req.max_tokens))
        accepted = False
        with anyio.move_on_after(self.settings.dispatch_timeout_s):
            await flight.ack.wait()
            accepted = flight.failure is None
        if not accepted:
            reason = flight.failure or "dispatch_timeout"
            core.free(req.request_id)
            self._capacity_changed()
            state.flights.pop(req.request_id, None)
            refused.append((wid, rank))
            if hold is not None:
                affinity.drop(hold)  # type: ignore[union-attr]
                if hold.kind == "bound":  # the bound rank refused: let the session re-bind
                    affinity.invalidate(hold.session, hold.revision, hold.version)  # type: ignore[union-attr]
            self._emit("dispatch_rejected", req.request_id, wid, rank, data={"reason": reason})
            raise _Retry
        if hold is not None:
            try:
                flight.lease = affinity.commit(hold, selection.key)  # type: ignore[union-attr]
            except InvalidArgument as exc:  # hard binding moved meanwhile: keep serving, unbound
                log.info("affinity commit for %s: %s", req.request_id, exc)
        record.dispatch_ns = self._now()
        self._emit("dispatch_accepted", req.request_id, wid, rank)
        try:
            await flight.done.wait()
        finally:
            core.free(req.request_id)
            if flight.lease is not None and affinity is not None:
                affinity.release(flight.lease)
            state.flights.pop(req.request_id, None)
            self._capacity_changed()
        if flight.failure == "worker_lost" and record.first_token_ns is None:
            refused.append((wid, rank))
            raise _Retry  # nothing was streamed yet: run it elsewhere

    async def _maybe_queue(self, req: ClientRequest, builder: Any, prepared: Any, record: RequestRecord) -> None:
        queue = self.queue
        if queue is None:
            return
        while True:
            candidates = builder.build()
            if not queue.should_queue(candidates.ranks):
                return
            event = anyio.Event()
            queue.push(
                QueueEntry(req.request_id, ranks=candidates.ranks, arrival_ns=self._now(), isl=prepared.isl,
                           tier=req.priority, pin=candidates.ranks[0] if candidates.pinned and len(candidates.ranks) == 1 else None,
                           payload=event),
                num_workers=len(self.workers), do_not_queue=req.do_not_queue, now_ns=self._now(),
            )
            record.queued_ns = self._now()
            self._emit("queued", req.request_id, data={"depth": len(queue)})
            self._release_queue()
            await event.wait()
            if self.stopped:
                raise _Retry
            return

    def _capacity_changed(self) -> None:
        if self.queue is not None:
            self._release_queue()

    def _release_queue(self) -> None:
        queue = self.queue
        assert queue is not None
        while (entry := queue.pop_ready()) is not None:
            entry.payload.set()  # type: ignore[union-attr]

    # ------------------------------------------------------------------ worker → router streaming

    def _on_ack(self, msg: DispatchAck) -> None:
        flight = self._flights.get(msg.request_id)
        if flight is None:
            return
        if not msg.accepted:
            flight.failure = msg.reason or "rejected"
        flight.ack.set()

    def _on_tokens(self, msg: TokenBatch) -> None:
        flight = self._flights.get(msg.request_id)
        if flight is None or not msg.times_ns:
            return
        self._note_tokens(flight, msg.times_ns)

    def _note_tokens(self, flight: _Flight, times: list[int]) -> None:
        record = flight.record
        if record.first_token_ns is None:
            record.first_token_ns = times[0]
            self.core.prefill_complete(flight.request_id)
            key = flight.key or (None, None)
            self._emit("first_token", flight.request_id, *key, data={"time_ns": times[0]})
            self._capacity_changed()
        before = record.output_tokens
        record.output_tokens = after = before + len(times)
        self.core.note_output(flight.request_id, record.isl, before, after)
        if self.hooks.wants("tokens"):
            key = flight.key or (None, None)
            self._emit("tokens", flight.request_id, *key, data={"times_ns": times})

    def _on_finished(self, msg: Finished) -> None:
        flight = self._flights.get(msg.request_id)
        if flight is None:
            return
        if msg.times_ns:
            self._note_tokens(flight, msg.times_ns)
        record = flight.record
        record.engine_cached_tokens = msg.cached_tokens
        record.admitted_ns, record.preemptions = msg.admitted_ns, msg.preemptions
        record.completion_ns = msg.times_ns[-1] if msg.times_ns else self._now()
        flight.done.set()

    def _on_failed(self, msg: RequestFailed) -> None:
        flight = self._flights.get(msg.request_id)
        if flight is None:
            return
        flight.failure = msg.reason
        flight.ack.set()
        flight.done.set()

    def _send(self, peer: bytes, msg: msgspec.Struct) -> None:
        self.end.send_nowait(peer, msg)


def _affinity_key(req: ClientRequest) -> str | None:
    if req.parent_session_id is not None:
        return sibling_group_key(req.parent_session_id)
    return req.session_id


def _reason(exc: Exception) -> str:
    name = type(exc).__name__
    snake = "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
    return f"{snake}: {exc}"


def _validate(req: ClientRequest) -> str | None:
    if not req.tokens:
        return "tokens: the prompt is empty"
    if req.max_tokens < 1:
        return f"max_tokens must be >= 1, got {req.max_tokens}"
    for name in ("session_id", "parent_session_id"):
        value = getattr(req, name)
        if value is not None and len(value.encode()) > 256:
            return f"{name} is longer than 256 bytes"
    return None
