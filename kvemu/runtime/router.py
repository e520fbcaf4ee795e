"""The router actor: the I/O shell around the request ``Lifecycle`` and the routing core, on any clock and transport.

It turns worker messages into lifecycle inputs (from the worker each request was dispatched to only),
drives the lifecycle's deadlines with a ``Wakeup``, registers workers, watches their heartbeats (a missed
window removes the worker: fence, forget its cache, invalidate its bindings, retry or fail its requests)
and feeds KV events into the index. ``handle`` awaits one request's end. Everything observable is
emitted through ``Hooks``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Annotated

import anyio
import msgspec
from msgspec import Meta

from kvemu.affinity import AffinityEvent, SessionAffinity
from kvemu.clock import NS_PER_S, Clock
from kvemu.errors import KvemuError
from kvemu.lifecycle import Lifecycle, LifecycleSettings, TruthProbe
from kvemu.load import LoadTracker
from kvemu.limits import MAX_SECONDS
from kvemu.queue import PolicyQueue
from kvemu.records import RequestRecord
from kvemu.index import WorkerKey
from kvemu.registry import WorkerSpec
from kvemu.ratelimit import TokenBucket
from kvemu.routing_core import RoutingCore
from kvemu.hooks import HookDetails, HookKind, Hooks, KvDetails, Ranks, Reason, SessionBinding
from kvemu.runtime.kv_ingest import KvIngest
from kvemu.messages import (
    Chaos,
    ClientRequest,
    Deregister,
    DispatchAck,
    Draining,
    EngineSettings,
    Finished,
    Heartbeat,
    KvBatch,
    KvPulled,
    RankDown,
    Register,
    RegisterAck,
    Reregister,
    RequestFailed,
    TokenBatch,
    WorkerMessage,
)
from kvemu.runtime.transport import RouterEnd
from kvemu.runtime.wakeup import Wakeup
from kvemu.validation import check_struct
from kvemu.wire.stream import Replay

__all__ = ["RouterSettings", "Router", "worker_spec"]

log = logging.getLogger("kvemu.router")

_KV_KINDS = {"gap": HookKind.KV_GAP, "replay": HookKind.KV_REPLAY, "lost": HookKind.KV_LOST,
             "restart": HookKind.KV_RESTART}
"""The hook kind of each KV-event stream observation (``EventStream``'s observer kinds)."""
_AFFINITY_KINDS = {"bound": HookKind.AFFINITY_BOUND, "rebound": HookKind.AFFINITY_REBOUND,
                   "released": HookKind.AFFINITY_RELEASED, "expired": HookKind.AFFINITY_EXPIRED,
                   "invalidated": HookKind.AFFINITY_INVALIDATED}
"""The hook kind of each ``AffinityEvent`` kind."""


class RouterSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Runtime knobs of the router actor (the policy knobs live in ``RouterConfig``); bounds declared once."""

    retry_limit: Annotated[int, Meta(ge=0, le=1 << 16)] = 3
    """Re-selections after rejected dispatches or lost workers before a request fails."""
    dispatch_timeout_s: Annotated[float, Meta(gt=0, le=MAX_SECONDS)] = 10.0
    """No acknowledgement within this time counts as a rejection."""
    heartbeat_timeout_s: Annotated[float, Meta(gt=0, le=MAX_SECONDS)] = 5.0
    """A worker silent for this long is removed."""
    startup_grace_s: Annotated[float, Meta(ge=0, le=MAX_SECONDS)] = 5.0
    """A router that has no worker yet lets requests wait this long after it started (a fresh or
    restarted router whose workers are still registering) instead of failing them at once."""
    max_unacked_dispatches: Annotated[int, Meta(ge=1, le=1 << 16)] = 3
    """A worker that lets this many dispatches in a row time out unacknowledged is removed (it must register
    again, and is removed again at its next timeout until it acknowledges one)."""
    request_deadline_s: Annotated[float, Meta(gt=0, le=MAX_SECONDS)] | None = 3600.0
    """A request still open this long after it reached the router fails with ``deadline_exceeded`` and frees
    its load and affinity binding (a worker that accepted it and went quiet cannot hold it forever)."""
    kv_replay_on_connect: bool = True
    """Ask a newly registered worker's ranks to replay their buffered KV events."""
    max_workers: Annotated[int, Meta(ge=1, le=1 << 16)] = 4096
    """Registered workers at once; a registration beyond it is refused."""
    max_ranks: Annotated[int, Meta(ge=1, le=1 << 16)] = 8192
    """Registered DP ranks at once, over all workers (sizes the KV subscriber's sockets in live mode)."""
    max_ranks_per_worker: Annotated[int, Meta(ge=1, le=1 << 16)] = 512
    """DP ranks one worker may register."""
    registrations_per_s: Annotated[float, Meta(gt=0, le=1e6)] = 200.0
    """Registrations accepted per second once the burst is spent; one beyond is refused with ``rate_limited``
    and a retry time (a worker registers again then)."""
    registration_burst: Annotated[int, Meta(ge=1, le=1 << 16)] = 4096
    """Registrations accepted at once before the rate applies (a whole cluster starting together)."""
    kv_replay_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 2.0
    """Live mode: a KV-event replay that has not ended this long after it was asked for fails (counted as
    ``replay_failures``; the batches it did not bring count as lost). Replays never block the router."""
    max_pending_workers: Annotated[int, Meta(ge=1, le=1 << 16)] = 64
    """Live mode: workers whose registration was accepted but who have not spoken since (a kvemu worker
    heartbeats as soon as it reads the acceptance). A pending worker is never routed to and is forgotten after
    ``heartbeat_timeout_s``; a registration beyond this many is refused with ``rate_limited`` and a retry time."""
    probation_ack_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 2.0
    """Live mode: a worker that has acknowledged no dispatch since it registered has this long to acknowledge
    its first (a kvemu worker does so at once); a miss removes it, and the request tries elsewhere without
    spending a retry."""
    first_token_timeout_s: Annotated[float, Meta(gt=0, le=86400)] | None = 60.0
    """Live mode: an accepted request with no first token this long after its acceptance ends that attempt with
    ``first_token_timeout`` (its worker is told to abort it) and runs elsewhere if it may. A worker that never
    produced a first token is removed at its first such timeout, any other at ``max_unacked_dispatches`` in a
    row. None: never (a request then waits up to ``request_deadline_s``)."""

    def __post_init__(self) -> None:
        check_struct(self)


def worker_spec(msg: Register) -> WorkerSpec:
    """What the routing core registers of a worker's ``Register``."""
    return WorkerSpec(
        worker_id=msg.worker_id, dp_start=msg.dp_start, dp_size=msg.dp_size,
        taints=frozenset(msg.taints), worker_type=msg.worker_type,  # type: ignore[arg-type]
        block_size=msg.block_size, total_kv_blocks=msg.total_kv_blocks,
        max_num_batched_tokens=msg.max_num_batched_tokens,
    )


class _WorkerState:
    """A registered worker (or a pending registration: ``Router.pending``): its spec, peer, when it last spoke."""

    __slots__ = ("spec", "peer", "last_seen_ns", "register")

    def __init__(self, spec: WorkerSpec, peer: bytes, now_ns: int, register: Register) -> None:
        self.spec = spec
        self.peer = peer
        self.last_seen_ns = now_ns
        self.register = register
        """Its registration as it came (its KV-event endpoints: ``Router.registrations``)."""


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
        pool: str | None = None,
        engine: EngineSettings | None = None,
        guarded: bool = True,
        watchdog: bool = True,
    ) -> None:
        """``guarded`` (default True, a router facing processes it does not own): hold peers to the live bounds
        (a pending stage, probation, the first-token timeout). The host that owns its workers and their time (the
        virtual driver's wiring) passes False: they are its own engines, and its times are no wall-clock facts.
        ``watchdog`` (default True): remove workers silent for ``heartbeat_timeout_s``; a host whose workers cannot
        fall silent, and so send no heartbeats, passes False."""
        self.core = core
        self.end = end
        self.clock = clock
        self.hooks = hooks or Hooks()
        self.settings = settings or RouterSettings()
        self.affinity = affinity
        self._on_worker_added = on_worker_added
        self._on_worker_removed = on_worker_removed
        self.pool = pool
        """``prefill`` or ``decode`` when this router is one pool of a disaggregated cluster (it then takes
        the legs a ``DisaggRouter`` sends it and only workers of its type); None: an aggregated cluster."""
        self.engine = engine
        """The engine settings this pool's workers must register (their scenario's); a worker saying others is
        refused with ``engine_mismatch``. None: not checked."""
        self.on_kv_pulled: Callable[[int, KvPulled], None] | None = None
        """Told when a decode rank pulled the KV of a request dispatched to it (a ``DisaggRouter`` listens)."""
        if affinity is not None:
            affinity.observer = self._affinity_event
        self.workers: dict[int, _WorkerState] = {}
        self._peers: dict[bytes, int] = {}  # transport identity -> worker id
        self._down_ranks: set[tuple[int, int]] = set()
        self._asked: set[bytes] = set()  # unknown peers already asked to register again
        self.guarded = guarded
        """Whether peers are held to the live-mode bounds (a pending stage, probation, the first-token timeout)."""
        self.watchdog = watchdog
        """Whether silent workers are removed (their heartbeats watched)."""
        self.pending: dict[bytes, _WorkerState] = {}
        """Live mode: registrations accepted whose worker has not spoken since, by peer (not routed to)."""
        self.started_ns = clock.now_ns()
        self.registrations_refused = 0
        self._registrations = TokenBucket(self.settings.registrations_per_s, self.settings.registration_burst,
                                          self.started_ns)
        self.kv = KvIngest(core, observer=self._kv_observer, replay_on_connect=self.settings.kv_replay_on_connect,
                           replay=kv_replay, zmq=zmq_kv_events, max_ranks=self.settings.max_ranks,
                           replay_timeout_s=self.settings.kv_replay_timeout_s)
        """KV events of every registered rank into the index."""
        self.kv_stats = self.kv.stats
        """KV-event counters per worker id (the report reads them)."""
        self.kv_intake = self.kv.intake
        """The in-memory intake of KV batches (a ``MemoryKvBus`` connects here)."""
        self._timers = Wakeup(self._on_time, clock.now_ns)
        self.lifecycle = Lifecycle(
            core, send=self._dispatch, clock=clock, hooks=self.hooks, affinity=affinity, queue=queue,
            settings=LifecycleSettings(self.settings.retry_limit, self.settings.dispatch_timeout_s,
                                       self.settings.startup_grace_s, self.settings.request_deadline_s,
                                       self.settings.max_unacked_dispatches,
                                       self.settings.probation_ack_timeout_s if self.guarded else None,
                                       self.settings.first_token_timeout_s if self.guarded else None),
            unavailable=self._down_ranks, on_deadline=self._timers.arm, on_unresponsive=self._unresponsive,
            on_stalled=self._stalled,
        )
        """Every request from arrival to its end (the sans-IO state machine this actor drives)."""
        self.registered = anyio.Event()

    @property
    def queue(self) -> PolicyQueue | None:
        """The policy queue requests wait in while every eligible rank is busy (the lifecycle's)."""
        return self.lifecycle.queue

    @queue.setter
    def queue(self, queue: PolicyQueue | None) -> None:
        self.lifecycle.queue = queue

    # ------------------------------------------------------------------ what hosts read

    def rank_keys(self) -> tuple[WorkerKey, ...]:
        """Every registered ``(worker_id, dp_rank)`` this router routes to, sorted."""
        return self.core.rank_keys()

    def indexed_blocks(self, key: WorkerKey) -> tuple[int, dict[int, int] | None]:
        """The blocks this router's prefix index holds for a rank (as its KV events told it), and per KV cache group
        for a hybrid engine's rank (None: the rank has no other group)."""
        blocks = self.core.index.tree_size(*key)
        groups = self.core.groups
        return blocks, groups.sizes(key, blocks) if groups is not None else None

    @property
    def load(self) -> LoadTracker:
        """The load the router books per rank (active requests, prefill tokens, decode blocks), as it routes by."""
        return self.core.load

    @property
    def in_flight(self) -> int:
        """Requests open at this router (arrived and not yet ended)."""
        return len(self.lifecycle.flights)

    def requests_at(self, stages: Collection[str]) -> int:
        """Open requests at one of these lifecycle ``stages`` (``kvemu.lifecycle.WAITING``, ``QUEUED``, ...)."""
        return sum(f.stage in stages for f in self.lifecycle.flights.values())

    @property
    def truth(self) -> TruthProbe | None:
        """The routing truth each routing decision is judged by (the record's ``truth_*`` fields); None: none."""
        return self.lifecycle.truth

    @truth.setter
    def truth(self, probe: TruthProbe | None) -> None:
        self.lifecycle.truth = probe

    def capacity_changed(self) -> None:
        """Something outside the router changed which ranks can take requests (a replica's synced view): requests
        waiting for capacity are tried again."""
        self.lifecycle.capacity_changed()

    # ------------------------------------------------------------------ serving

    async def serve(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Receive worker messages and watch heartbeats until cancelled."""
        async with anyio.create_task_group() as tg:
            if self.watchdog:
                tg.start_soon(self._watchdog)
            tg.start_soon(self._timers.run)
            tg.start_soon(self.kv.run)
            task_status.started()
            await self.end.serve(self.on_message)
            tg.cancel_scope.cancel()

    async def wait_for_workers(self, count: int, timeout_s: float = 30.0) -> None:
        """Return once ``count`` workers are registered (``TimeoutError`` otherwise)."""
        with anyio.fail_after(timeout_s):
            while len(self.workers) < count:
                if self.registered.is_set():
                    self.registered = anyio.Event()
                await self.registered.wait()

    def _now(self) -> int:
        return self.clock.now_ns()

    def _emit(self, kind: HookKind, request_id: str | None = None, worker_id: int | None = None,
              dp_rank: int | None = None, details: HookDetails | None = None) -> None:
        self.hooks.note(kind, self._now(), request_id, worker_id, dp_rank, details)

    def _on_time(self) -> int | None:
        self.lifecycle.poll(self._now())
        return self.lifecycle.next_deadline_ns()

    def _dispatch(self, worker_id: int, msg: msgspec.Struct) -> None:
        state = self.workers.get(worker_id)
        if state is not None:
            self._send(state.peer, msg)

    def on_message(self, peer: bytes, msg: WorkerMessage) -> None:
        """Handle one worker message (the transport's handler; it never raises for a peer's mistakes)."""
        # (``type(msg) is``: mypy narrows the union on it, messages are exact classes, and it is the fastest
        # dispatch measured: a ``match`` on class patterns took three times as long per message; the most
        # frequent kinds come first)
        wid = self._peers.get(peer)
        if type(msg) is Register:
            if wid is not None:  # (a registered connection registering again is refused, but it spoke)
                self.workers[wid].last_seen_ns = self._now()
            self._on_register(peer, msg)
            return
        if wid is None and peer in self.pending:  # its first word since: admit it
            wid = self._admit(peer)
        if wid is None:
            if peer not in self._asked and type(msg) is not KvBatch:  # a worker of a previous router: re-register
                self._asked.add(peer)
                self.end.send_nowait(peer, Reregister())
            return
        self.workers[wid].last_seen_ns = self._now()  # every message proves the worker alive, not only heartbeats
        if type(msg) is TokenBatch:
            self.lifecycle.on_tokens(wid, msg)
        elif type(msg) is KvBatch:
            self.kv_intake(wid, msg.dp_rank, msg.seq, msg.payload)
        elif type(msg) is Heartbeat:
            pass  # liveness was noted above
        elif type(msg) is DispatchAck:
            self.lifecycle.on_ack(wid, msg)
        elif type(msg) is Finished:
            self.lifecycle.on_finished(wid, msg)
        elif type(msg) is KvPulled:
            if self.on_kv_pulled is not None and self.lifecycle.dispatched_to(wid, msg.request_id) is not None:
                self.on_kv_pulled(wid, msg)
        elif type(msg) is RequestFailed:
            self.lifecycle.on_failed(wid, msg)
        elif type(msg) is Draining or type(msg) is RankDown or type(msg) is Deregister:
            if msg.worker_id != wid:
                log.warning("peer %r (worker %s) spoke for worker %s; ignored", peer, wid, msg.worker_id)
            elif type(msg) is Draining:
                self.drain_worker(wid)
            elif type(msg) is RankDown:
                self.rank_down(wid, msg.dp_rank)
            elif type(msg) is Deregister:
                self.remove_worker(wid, reason=f"deregistered: {msg.reason}")

    # ------------------------------------------------------------------ workers

    def _on_register(self, peer: bytes, msg: Register) -> None:
        reason = None
        retry_after_s = None
        waiting = self.pending.get(peer)
        mismatch = self._engine_mismatch(msg)
        if waiting is not None and waiting.register == msg:  # its acceptance crossed a repeat: accept it again
            self._send(peer, RegisterAck(worker_id=msg.worker_id, accepted=True))
            return
        if peer in self._peers or waiting is not None:
            reason = f"this connection already registered worker {self._peers.get(peer, msg.worker_id)}"
        elif msg.worker_id in self.workers or any(p.spec.worker_id == msg.worker_id for p in self.pending.values()):
            reason = f"worker id {msg.worker_id} is already registered"
        elif self.pool is not None and msg.worker_type != self.pool:
            reason = (f"worker {msg.worker_id} is a {msg.worker_type} worker but this router serves the {self.pool} "
                      f"pool; start it with --worker-type {self.pool} or point it at the {msg.worker_type} pool")
        elif mismatch is not None and not msg.own_engine:
            reason = (f"engine_mismatch: {mismatch}; start it with the router's scenario (kvemu worker --config FILE, "
                      "the same --set), or with --own-engine if it differs on purpose")
        elif msg.block_size != self.core.block_size:
            reason = (f"worker {msg.worker_id} uses block_size {msg.block_size} but the router uses "
                      f"{self.core.block_size}; prefix matching would silently find nothing")
        else:
            reason = self._registration_limits(msg)
        if reason is None and self.guarded and len(self.pending) >= self.settings.max_pending_workers:
            retry_after_s = self.settings.heartbeat_timeout_s / 4
            reason = (f"rate_limited: worker {msg.worker_id}: {len(self.pending)} registered workers have not spoken "
                      f"since (max_pending_workers); retry in {retry_after_s:g} s")
        if reason is None and not self._registrations.take(self._now()):
            retry_after_s = max(0.05, self._registrations.wait_s(self._now()))
            reason = (f"rate_limited: worker {msg.worker_id}: more than {self.settings.registration_burst} registrations "
                      f"at once and {self.settings.registrations_per_s:g}/s since (registrations_per_s); "
                      f"retry in {retry_after_s:.2f} s")
        spec = None
        if reason is None:
            try:
                spec = worker_spec(msg)
                if not self.guarded:
                    self.core.add_worker(spec)
            except (KvemuError, ValueError, TypeError) as exc:
                reason = str(exc)
        self._send(peer, RegisterAck(worker_id=msg.worker_id, accepted=reason is None, reason=reason,
                                     retry_after_s=retry_after_s))
        if reason is not None:
            self.registrations_refused += 1
            if self.registrations_refused <= 10 or self.registrations_refused % 1000 == 0:  # a flood logs little
                log.warning("registration refused (%d so far): %s", self.registrations_refused, reason)
            if retry_after_s is not None:
                self._asked.discard(peer)  # a registered worker's next heartbeat is answered with Reregister
            return
        assert spec is not None
        if mismatch is not None:
            log.warning("worker %s registered with its own engine (--own-engine): %s", msg.worker_id, mismatch)
        state = _WorkerState(spec, peer, self._now(), msg)
        self._asked.discard(peer)
        if self.guarded:  # routed to (and its KV streams opened) once it speaks again: ``_admit``
            self.pending[peer] = state
            return
        self._add(state)

    def _engine_mismatch(self, msg: Register) -> str | None:
        """How a worker's registered engine settings differ from those this pool expects (None: alike, or unsaid)."""
        if self.engine is None or msg.engine is None or msg.engine.digest == self.engine.digest:
            return None
        runs, expected = msg.engine.differences(self.engine)
        return f"worker {msg.worker_id} runs {runs} where the router's scenario says {expected}"

    def _admit(self, peer: bytes) -> int | None:
        """A pending worker spoke: register it for routing (None if that fails now, e.g. a limit reached)."""
        state = self.pending.pop(peer)
        msg = state.register
        reason = self._registration_limits(msg)
        if reason is None:
            try:
                self.core.add_worker(state.spec)
            except (KvemuError, ValueError, TypeError) as exc:
                reason = str(exc)
        if reason is not None:
            self.registrations_refused += 1
            log.warning("registered worker %s not admitted: %s", msg.worker_id, reason)
            return None  # (``on_message`` asks it to register again)
        state.last_seen_ns = self._now()
        self._add(state)
        return msg.worker_id

    def _add(self, state: _WorkerState) -> None:
        msg, peer = state.register, state.peer
        self.workers[msg.worker_id] = state
        self._peers[peer] = msg.worker_id
        self.kv.add_worker(msg)
        if self._on_worker_added is not None:
            self._on_worker_added(msg)
        self._emit(HookKind.WORKER_ADDED, worker_id=msg.worker_id, details=Ranks(msg.dp_size, msg.dp_start))
        self.registered.set()
        self.lifecycle.worker_added()

    def _registration_limits(self, msg: Register) -> str | None:
        """Why a registration exceeds this router's bounds (None if it does not); checked before anything changes."""
        s = self.settings
        wid = msg.worker_id
        if not 1 <= msg.dp_size <= s.max_ranks_per_worker:
            return f"worker {wid}: dp_size {msg.dp_size} is outside 1..{s.max_ranks_per_worker} (max_ranks_per_worker)"
        if len(self.workers) >= s.max_workers:
            return f"worker {wid}: {len(self.workers)} workers are registered, the most this router takes (max_workers)"
        ranks = self.core.registry.num_ranks
        if ranks + msg.dp_size > s.max_ranks:
            return (f"worker {wid}: its {msg.dp_size} ranks would make {ranks + msg.dp_size}, more than this router "
                    f"takes ({s.max_ranks}, max_ranks)")
        left = self.kv.streams_left()
        if left is not None and len(msg.kv_endpoints) > left:
            return (f"worker {wid}: its {len(msg.kv_endpoints)} KV-event streams would exceed what this router can "
                    f"open ({left} more; the open-file limit bounds them: raise the hard limit, ulimit -Hn)")
        for name in ("kv_endpoints", "kv_replay_endpoints"):
            endpoints = getattr(msg, name)
            if len(endpoints) > msg.dp_size:
                return f"worker {wid}: {len(endpoints)} {name} for {msg.dp_size} ranks"
            bad = next((e for e in endpoints if e and (len(e) > 256 or not e.startswith(("tcp://", "ipc://")))), None)
            if bad is not None:
                return f"worker {wid}: {name} entry {bad[:64]!r} is not a tcp:// or ipc:// endpoint of <= 256 characters"
        if len(msg.taints) > 64 or any(len(t) > 128 for t in msg.taints):
            return f"worker {wid}: at most 64 taints of <= 128 characters"
        return None

    def registrations(self) -> list[Register]:
        """The registered workers' ``Register`` messages, by worker id (where their KV events are published)."""
        return [self.workers[wid].register for wid in sorted(self.workers)]

    def serves_peer(self, peer: bytes) -> bool:
        """Whether ``peer`` (a transport identity) is the connection of a worker registered here (or pending)."""
        return peer in self._peers or peer in self.pending

    def send_chaos(self, worker_id: int, msg: Chaos) -> str | None:
        """Ask a registered worker to apply a fault to itself (chaos on real processes); returns why not, or None."""
        state = self.workers.get(worker_id)
        if state is None:
            return f"worker {worker_id} is not registered (registered: {sorted(self.workers)[:16]})"
        self._send(state.peer, msg)
        return None

    def stop(self, reason: str = "router_restart") -> None:
        """This router instance goes away: every request it holds ends with ``reason``."""
        self.lifecycle.stop(reason)
        if self.affinity is not None:
            self.affinity.invalidate_all()  # wakes requests waiting for an initializer

    def drain_worker(self, worker_id: int) -> None:
        """Stop routing to a worker that is shutting down; its requests in flight finish normally."""
        if worker_id not in self.workers or self.core.registry.is_fenced(worker_id):
            return
        self.core.registry.fence(worker_id)
        if self.affinity is not None:
            self.affinity.invalidate_worker(worker_id)
        self._emit(HookKind.WORKER_FENCED, worker_id=worker_id, details=Reason("draining"))
        self.lifecycle.capacity_changed()  # requests queued only on it start their admission over

    def rank_down(self, worker_id: int, dp_rank: int) -> None:
        """One rank died: forget its cache and its session bindings, route nothing more to it."""
        if worker_id not in self.workers or (worker_id, dp_rank) in self._down_ranks:
            return
        self._down_ranks.add((worker_id, dp_rank))
        self.core.index.clear(worker_id, dp_rank)
        if self.affinity is not None:
            self.affinity.invalidate_worker(worker_id, dp_rank)
        self._emit(HookKind.WORKER_FENCED, worker_id=worker_id, dp_rank=dp_rank, details=Reason("rank_down"))
        self.lifecycle.capacity_changed()

    def _unresponsive(self, worker_id: int, unacked: int) -> None:
        self.remove_worker(worker_id, reason=f"unresponsive: {unacked} dispatches in a row unacknowledged")

    def _stalled(self, worker_id: int, stalls: int) -> None:
        self.remove_worker(worker_id, reason=f"unresponsive: {stalls} accepted requests in a row without a first "
                                             f"token within {self.settings.first_token_timeout_s:g} s")

    def remove_worker(self, worker_id: int, *, reason: str) -> None:
        """Forget a worker: index, load, bindings; its in-flight requests are retried or failed."""
        state = self.workers.pop(worker_id, None)
        if state is None:
            return
        self._peers.pop(state.peer, None)
        self._down_ranks.difference_update([k for k in self._down_ranks if k[0] == worker_id])
        self._emit(HookKind.WORKER_FENCED, worker_id=worker_id, details=Reason(reason))
        self.core.remove_worker(worker_id)
        self.kv.remove_worker(worker_id)
        if self.affinity is not None:
            self.affinity.invalidate_worker(worker_id)
        if self._on_worker_removed is not None:
            self._on_worker_removed(worker_id)
        self._emit(HookKind.WORKER_REMOVED, worker_id=worker_id, details=Reason(reason))
        self.lifecycle.worker_lost(worker_id)

    async def _watchdog(self) -> None:
        timeout_ns = round(self.settings.heartbeat_timeout_s * NS_PER_S)
        period = self.settings.heartbeat_timeout_s / 4
        period_ns = round(period * NS_PER_S)
        last = self._now()
        while True:
            await anyio.sleep(period)
            now = self._now()
            stalled = now - last - 2 * period_ns  # the router itself did not run (stopped, swapped out, a long pass)
            last = now
            if stalled > 0:  # its own stall is not the workers' silence: their heartbeats wait in its socket
                for s in (*self.workers.values(), *self.pending.values()):
                    s.last_seen_ns += stalled
            for peer in [p for p, s in self.pending.items() if now - s.last_seen_ns > timeout_ns]:
                del self.pending[peer]  # accepted, never heard from since: forgotten, and asked to register again
                self._send(peer, Reregister())  # (a starved worker; a fake's one message more)
            for wid in sorted(w for w, s in self.workers.items() if now - s.last_seen_ns > timeout_ns):
                self.remove_worker(wid, reason="missed heartbeats")

    # ------------------------------------------------------------------ KV events

    def _kv_observer(self, kind: str, worker_id: int, dp_rank: int, details: KvDetails) -> None:
        self._emit(_KV_KINDS[kind], worker_id=worker_id, dp_rank=dp_rank, details=details)

    def _affinity_event(self, ev: AffinityEvent) -> None:
        t = ev.target
        self._emit(_AFFINITY_KINDS[ev.kind], worker_id=t.worker_id if t else None, dp_rank=t.dp_rank if t else None,
                   details=SessionBinding(ev.session, ev.pool))

    # ------------------------------------------------------------------ requests

    async def handle(self, req: ClientRequest) -> RequestRecord:
        """Run one request to completion or failure and return its record (it never raises for routing failures).

        The record is the one the lifecycle keeps and its hooks carry: routing, engine facts and token times.
        """
        ended = anyio.Event()
        record = self.submit(req, lambda _record: ended.set())
        await ended.wait()
        return record

    def submit(self, req: ClientRequest, on_end: Callable[[RequestRecord], None],
               can_retry: Callable[[], bool] | None = None,
               on_finished: Callable[[Finished], None] | None = None) -> RequestRecord:
        """Start one request; ``on_end`` gets its record when it ended (``handle`` without a task).

        A router that is not serving yet (a restart in progress) takes the request; it progresses once
        ``serve`` runs, which delivers the workers' replies and the request deadlines. Only a pool router
        takes disaggregated legs (``kv_hold``, ``kv_transfer``), which a ``DisaggRouter`` sends it."""
        if (req.kv_hold or req.kv_transfer is not None) and self.pool is None:
            record = RequestRecord(request_id=req.request_id, arrival_ns=self.clock.now_ns(), isl=len(req.tokens),
                                   max_tokens=req.max_tokens,
                                   failure="invalid_request: kv_hold and kv_transfer are for disaggregated clusters")
            self.hooks.note(HookKind.FAILED, record.arrival_ns, req.request_id, record=record)
            on_end(record)
            return record
        return self.lifecycle.submit(req, on_end, can_retry, on_finished)

    def sync_before_select(self, sync: Callable[[], None] | None) -> None:
        """Call ``sync`` before every selection (the lifecycle's ``before_select`` hook): a host whose workers
        publish KV events lazily (virtual time) brings them up to the present there."""
        self.lifecycle.before_select = sync

    def tell(self, worker_id: int, msg: msgspec.Struct) -> None:
        """Send a registered worker a message (a ``DisaggRouter`` frees held KV with ``ReleaseKv``)."""
        self._dispatch(worker_id, msg)

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """End an open request at once (its client went away): load, queue place and affinity binding are
        freed and its worker is told to abort it. Returns whether it was open."""
        return self.lifecycle.cancel(request_id, reason)

    def _send(self, peer: bytes, msg: msgspec.Struct) -> None:
        self.end.send_nowait(peer, msg)
