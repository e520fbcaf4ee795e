"""The router process (``kvemu router``): the router actor and the client gateway on one ZeroMQ socket.

It serves workers and clients (``harness.procs.protocol``) until SIGTERM. A disaggregated scenario's router
process hosts its prefill and decode routers on that one socket (``harness.procs.gate`` gives each worker its
own pool's router) behind a ``DisaggRouter``; chaos ``Control`` messages are applied here or forwarded to the
workers. With ``router.replicas`` it is one replica (``--replica``); with ``router.replica_sync`` it shares its
bookings with its peers over ZeroMQ (``kvemu.runtime.replica_sync_zmq``; peers from ``--sync-peer`` or a
``SyncPeers`` control message).
"""

from __future__ import annotations

import hmac
import json
import os
import signal
import sys
import uuid
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import zmq

from kvemu.clock import NS_PER_MS, WallClock
from kvemu.disagg import DECODE
from kvemu.errors import InvalidArgument
from kvemu.hooks import HookEvent, Hooks, TokenTimes
from kvemu.http.backend import LastTokenTime, keep_last_token_time
from kvemu.runtime.loop import run_live
from kvemu.messages import Chaos, ClientRequest, encode, with_packed_prompt
from kvemu.records import RequestRecord
from kvemu.runtime.kv_bus import FeedTap, into_stream
from kvemu.runtime.prompt_lane import PromptLane
from kvemu.runtime.replica_sync_zmq import ZmqSyncLink
from kvemu.runtime.router import Router
from kvemu.runtime.transport import ZmqRouterEnd

from harness.chaos import (
    CONTROL_TOKEN_ENV,
    MAX_TOKEN_BYTES,
    ChaosHost,
    Control,
    ControlReply,
    Outcome,
    SyncPeers,
    WorkerExited,
    apply_chaos,
)
from harness.run.factories import pool_router
from harness.procs.gate import PoolGate
from harness.run.pools import AGGREGATED, affinity_stats, compose_pools, kv_stats, owner, routing_block_size, samples, worker_type_of
from harness.report.recorder import Recorder
from harness.report.run_data import EXITED
from harness.scenario import Scenario
from harness.text import counted
from harness.tuning import tune_gc
from harness.procs.protocol import (
    CLIENT,
    CancelRequest,
    ClientMessage,
    LANE_FRAME_BYTES,
    MAX_STREAMING_CLIENTS,
    HttpOptions,
    RecordReply,
    Stats,
    StatsQuery,
    StreamTokens,
    TokensReply,
    client_decoder,
    client_request_key,
    log_start,
    malformed_reply,
    never_ran_record,
)

if TYPE_CHECKING:
    from kvemu.http.server import HttpServer



class _SharedRouterEnd(ZmqRouterEnd):
    """Worker traffic for the router actor; client traffic for the gateway (same ROUTER socket)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.clients_tx, self.clients_rx = anyio.create_memory_object_stream[tuple[bytes, bytes]](float("inf"))

    async def receive(self) -> tuple[bytes, list[bytes]]:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) == 3 and frames[1] == CLIENT:  # a message is a msgpack map: never the bare marker
                self.clients_tx.send_nowait((frames[0], frames[2]))
            elif len(frames) >= 2:
                return frames[0], frames[1:]

    def reply(self, peer: bytes, data: bytes) -> None:
        # zmq.asyncio's send_multipart returns a Future; its stubs declare only an Awaitable
        self._sock.send_multipart([peer, CLIENT, data]).add_done_callback(_quiet)  # type: ignore[attr-defined]


def _quiet(fut: Any) -> None:
    if not fut.cancelled():
        fut.exception()  # a vanished peer: nothing to do


def _sync_link(scenario: Scenario, replica: int, listen: str, peers: dict[int, str],
               clock: WallClock) -> ZmqSyncLink | None:
    """Replica ``replica``'s sync with its peers (``router.replica_sync``; None: one router, or sync off)."""
    rspec = scenario.router
    if rspec.replicas < 2 or not rspec.replica_sync.enabled or scenario.cluster.disaggregated:
        return None
    link = ZmqSyncLink(replica, clock, round(rspec.replica_sync.delay_ms * NS_PER_MS),
                       rspec.replica_sync.predictions, listen)
    for peer, endpoint in sorted(peers.items()):
        link.connect(peer, endpoint)
    return link


class _RouterProcess:
    """One router process: its pools' routers on one ZeroMQ socket, the client gateway beside them, the control
    channel, and optionally an HTTP front door and replica sync. ``serve`` runs it until SIGTERM or SIGINT."""

    def __init__(self, scenario: Scenario, listen: str, http: HttpOptions | None = None, replica: int = 0,
                 sync_listen: str = "tcp://127.0.0.1:0", sync_peers: dict[int, str] | None = None) -> None:
        self.scenario = scenario
        self.replica = replica
        self.clock = clock = WallClock()
        self.hooks = hooks = Hooks()
        spec = scenario.cluster
        self.recorder = Recorder(hooks)
        self.lane = PromptLane(clock, routing_block_size(spec))
        self.end = _SharedRouterEnd(listen)
        self.routers: dict[str, Router] = {}
        self.gate = PoolGate(self.end, {worker_type_of(spec, pool): pool for pool in spec.pools()},
                             lambda: self.routers)
        self.feed = FeedTap(into_stream) if scenario.router.replicas > 1 else None
        """A replica's own KV feed, between its subscriber and its streams (chaos naming this replica faults it)."""
        pools, self.front = compose_pools(spec, self._new_router, clock=clock, hooks=hooks,
                                          retry_limit=scenario.router.settings().retry_limit)
        self.routers.update(pools)
        self.sync = _sync_link(scenario, replica, sync_listen, sync_peers or {}, clock)
        if self.sync is not None:
            self.sync.attach(self.routers[AGGREGATED].core, self.routers[AGGREGATED].capacity_changed)
        self.router_id = uuid.uuid4().hex[:12]
        """The router instance this process runs (a chaos restart replaces it), and when it started."""
        self.router_started_ns = clock.now_ns()
        self.process_id = f"{os.getpid()}-{self.router_id}"
        self.control = _RouterControl(os.environ.get(CONTROL_TOKEN_ENV) or None)
        self.control.feed = self.feed
        self.server = self._http_server(http) if http is not None else None
        self.in_flight: set[str] = set()
        self.cancelling: dict[str, str] = {}
        """Requests cancelled while still decoding or hashing in the lane: key -> reason."""
        self.streaming: dict[bytes, None] = {}
        """Clients that asked for their requests' tokens (``StreamTokens``), oldest first."""
        self.streams: dict[str, tuple[bytes, str]] = {}
        """Their open requests: key -> (client, its request id)."""
        self.bad_messages = 0
        """Client messages refused while decoding (``Stats.bad_client_messages``)."""
        self._scopes: dict[str, anyio.CancelScope] = {}
        hooks.subscribe(self._stream_tokens, "tokens")
        hooks.subscribe(lambda ev: self.control.on_worker_added(self.routers, ev.worker_id), "worker_added")

    def _new_router(self, pool: str) -> Router:
        router = pool_router(self.scenario, pool, clock=self.clock, end=self.gate.end(pool), hooks=self.hooks,
                             replica=self.replica,
                             zmq_kv_events=pool != DECODE,  # decode workers' KV events go to nobody
                             guarded=True, reaper=True)  # its workers are other processes, on wall time
        if self.feed is not None and router.kv.subscriber is not None:  # (a restarted router: the same feed)
            router.kv.subscriber.feed = self.feed
        return router

    def _http_server(self, http: HttpOptions) -> HttpServer:
        """The OpenAI front door in this process (``--http``; an aggregated cluster only)."""
        from kvemu.http.server import HttpServer

        from harness.procs.frontdoor import front_door

        assert not self.scenario.cluster.disaggregated, "the CLI refuses --http for a disaggregated cluster"

        def forget(rid: str) -> None:
            self.recorder.records.pop(rid, None)  # the client has its answer

        app = front_door(self.scenario, lambda: self.routers[AGGREGATED], self.hooks, self.clock,
                         tokenizer=http.tokenizer, model=http.model, forget=forget, limits=http.admission)
        return HttpServer(app, http.listen, http.server)

    def _stream_tokens(self, ev: HookEvent) -> None:
        to = self.streams.get(ev.request_id) if ev.request_id is not None else None
        if to is not None and isinstance(ev.details, TokenTimes):
            self.end.reply(to[0], encode(TokensReply(request_id=to[1], n=len(ev.details.times_ns))))

    def _wants_tokens(self, peer: bytes) -> None:
        """``peer`` asked for its requests' tokens (``StreamTokens``)."""
        streaming = self.streaming
        if peer not in streaming and len(streaming) >= MAX_STREAMING_CLIENTS:
            del streaming[next(iter(streaming))]  # the oldest: a front door long replaced, most likely
        streaming[peer] = None

    async def handle(self, peer: bytes, req: ClientRequest | None, frame: bytes = b"") -> None:
        """Run one client request and reply with its record; a huge one (or a large ``frame`` still to decode)
        works in the prompt lane, so that a burst of them leaves the loop to other requests between steps."""
        lane, end, in_flight, streams = self.lane, self.end, self.in_flight, self.streams
        async with lane.turn(bool(frame) or (req is not None and lane.is_huge(req.tokens))) as work:
            if req is None:
                req = self._decode_request(peer, frame)
                if req is None:
                    return
                await work.pause()
            # requests are keyed by (client, request id): two clients may use the same id, and a reply goes
            # only to the client that sent the request
            key = client_request_key(peer, req.request_id)
            if key in in_flight:  # this client's own id, still running: refuse the copy, keep the original
                end.reply(peer, encode(RecordReply(record=never_ran_record(req, self.clock.now_ns(),
                                                                           "duplicate_request_id"))))
                return
            in_flight.add(key)
            if peer in self.streaming:
                streams[key] = (peer, req.request_id)
            ended = anyio.Event()
            record: RequestRecord | None = None
            try:
                await work.hash(req.tokens)  # a packed prompt: its blocks a slice per step
                # the record submit returns is the one on_end is given, complete once the request ended
                record = self.front.submit(msgspec.structs.replace(req, request_id=key), lambda _record: ended.set())
                if peer in self.streaming:  # a front door: it streams counts, and its records' token times go unread
                    keep_last_token_time(record)
                if key in self.cancelling:
                    self.front.cancel(key, self.cancelling.pop(key))
            except BaseException:
                in_flight.discard(key)
                streams.pop(key, None)
                raise
        try:
            await ended.wait()
        finally:
            in_flight.discard(key)
            streams.pop(key, None)
            self.cancelling.pop(key, None)
            self.recorder.records.pop(key, None)  # the client has its answer
            if record is not None and ended.is_set():
                record.request_id = req.request_id
                if isinstance(record.token_times_ns, LastTokenTime):
                    record.token_times_ns = []
                end.reply(peer, encode(RecordReply(record=record)))

    def _refused(self, why: str) -> None:
        """Count a client message refused while decoding; log only the first (a flood must not flood the log)."""
        self.bad_messages += 1
        if self.bad_messages == 1:
            print(json.dumps({"event": "bad_client_message", "error": why[:200],
                              "note": "further ones are counted (stats: bad_client_messages), not logged"}),
                  file=sys.stderr)

    def _decode_message(self, peer: bytes, data: bytes) -> ClientMessage | None:
        """A client message decoded (a request's prompt packed: ``with_packed_prompt``); a malformed one (or one
        with a field past its bound, ``kvemu.limits``) is counted, logged the first time, answered where it can
        be attributed, and gives None."""
        try:
            return with_packed_prompt(client_decoder.decode(data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._refused(str(exc))
            answer = malformed_reply(data, exc, self.clock.now_ns())
            if answer is not None:  # the client waits for it: say what was wrong instead of nothing
                self.end.reply(peer, encode(answer))
            return None

    def _decode_request(self, peer: bytes, data: bytes) -> ClientRequest | None:
        """A large client message decoded: a request, or None (answered when malformed; a query or control
        message is never this large and is dropped, logged)."""
        msg = self._decode_message(peer, data)
        if msg is None:
            return None
        if type(msg) is not ClientRequest:
            self._refused(f"an oversized {type(msg).__name__}")
            return None
        return msg

    def stats(self, publishers: bool = False) -> Stats:
        """What a ``StatsQuery`` is answered with: workers, ranks and their load, KV-event and affinity counts,
        counters, worker events, this instance (and, if asked, the workers' KV publishers)."""
        now = self.clock.now_ns()
        routers, recorder, sync, feed = self.routers, self.recorder, self.sync, self.feed
        current = list(routers.values())
        taken = samples(routers, now)
        return Stats(now_ns=now, workers=sorted(w for r in current for w in r.workers),
                     ranks=[(x.worker_id, x.dp_rank) for x in taken], samples=taken, kv_stats=kv_stats(current),
                     affinity=affinity_stats(current), counters=dict(recorder.counters),
                     worker_events=recorder.worker_events, router_id=self.router_id,
                     router_started_ns=self.router_started_ns, process_id=self.process_id,
                     records_held=len(recorder.records),
                     pools={pool: sorted(r.workers) for pool, r in routers.items()}, replica=self.replica,
                     sync=sync.stats() if sync is not None else None,
                     feed_dropped=feed.dropped if feed is not None else 0,
                     bad_client_messages=self.bad_messages,
                     publishers=[m for pool, r in routers.items() if pool != DECODE for m in r.registrations()
                                 if m.kv_endpoints] if publishers else [])

    async def _serve_pool(self, pool: str, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.CancelScope() as self._scopes[pool]:
            await self.routers[pool].serve(task_status=task_status)

    async def _restart(self, tg: anyio.abc.TaskGroup) -> None:
        """Chaos: the router loses all its state, as if its process had been replaced on the same address
        (an aggregated cluster: ``_RouterControl`` refuses it for a disaggregated one)."""
        old = self.routers[AGGREGATED]
        old.stop("router_restart")  # each handler replies to its client
        self._scopes[AGGREGATED].cancel()
        await anyio.sleep(0)
        new = self.routers[AGGREGATED] = self._new_router(AGGREGATED)
        self.front = new
        new.kv_stats.update(old.kv_stats)  # the report counts the KV events of every router instance
        if self.sync is not None:  # its load view starts empty: it hears only what its peers announce from now on
            self.sync.attach(new.core, new.capacity_changed)
        self.router_id, self.router_started_ns = uuid.uuid4().hex[:12], self.clock.now_ns()
        await tg.start(self._serve_pool, AGGREGATED)

    async def _gateway(self, tg: anyio.abc.TaskGroup) -> None:
        end, control = self.end, self.control
        async for peer, data in end.clients_rx:
            if len(data) >= LANE_FRAME_BYTES:  # a huge prompt: decoded in the lane, after those before it
                tg.start_soon(self.handle, peer, None, data)
                continue
            msg = self._decode_message(peer, data)
            if msg is None:
                continue
            if type(msg) is ClientRequest:
                tg.start_soon(self.handle, peer, msg)
            elif type(msg) is StatsQuery:
                if msg.settle:
                    for r in self.routers.values():
                        r.kv.take_in_arrived()
                end.reply(peer, encode(self.stats(msg.publishers)))
            elif type(msg) is CancelRequest:  # its handler replies with the record, failed with the reason
                key = client_request_key(peer, msg.request_id)
                if key in self.in_flight and not self.front.cancel(key, msg.reason):
                    self.cancelling[key] = msg.reason  # (not submitted yet)
            elif type(msg) is StreamTokens:
                self._wants_tokens(peer)
            elif type(msg) is SyncPeers:
                end.reply(peer, encode(control.sync_peers(self.sync, msg)))
            elif type(msg) is WorkerExited:
                end.reply(peer, encode(control.worker_exited(self.routers, msg)))
            elif type(msg) is Control:
                reply = await control.apply(self.routers, msg)
                end.reply(peer, encode(reply))
                if reply.ok and msg.event.action == "restart_router":
                    await self._restart(tg)

    async def serve(self, grace_s: float) -> None:
        """Serve until SIGTERM or SIGINT, then drain: requests in flight (from ZeroMQ clients and over HTTP) get
        up to ``grace_s`` to finish, then fail with ``router_shutdown``."""
        routers, server, sync, end = self.routers, self.server, self.sync, self.end
        async with anyio.create_task_group() as tg:
            for pool in list(routers):
                await tg.start(self._serve_pool, pool)
            tg.start_soon(self.gate.serve)
            tg.start_soon(self._gateway, tg)
            if server is not None:
                await tg.start(server.serve)
            if sync is not None:
                await tg.start(sync.serve)
            replicas = ({"replica": self.replica, "sync": sync.endpoint if sync is not None else None}
                        if self.scenario.router.replicas > 1 else {})
            log_start("router", listen=end.endpoint, control=self.control.token is not None, pools=list(routers),
                      **({"http": server.url} if server is not None else {}), **replicas)
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            with anyio.move_on_after(grace_s):
                while self.in_flight or any(r.in_flight for r in routers.values()):
                    await anyio.sleep(0.01)
            for router in routers.values():
                router.stop("router_shutdown")  # ends them: each handler replies to its client
            with anyio.move_on_after(1.0):
                while self.in_flight:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.05)  # let the replies leave the socket
            tg.cancel_scope.cancel()
        if sync is not None:
            await sync.aclose()
        await end.aclose()


async def _serve_router(scenario: Scenario, listen: str, grace_s: float, http: HttpOptions | None = None,
                        replica: int = 0, sync_listen: str = "tcp://127.0.0.1:0",
                        sync_peers: dict[int, str] | None = None) -> None:
    await _RouterProcess(scenario, listen, http, replica, sync_listen, sync_peers).serve(grace_s)


class _RouterControl:
    """The router process's control channel: checks the token and applies or forwards chaos events."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self.lag_ms: float | None = None
        """The KV-event lag chaos set, for workers that register later too."""
        self.feed: FeedTap | None = None
        """This replica's own KV feed (``router.replicas`` > 1): chaos naming a replica faults it here."""

    def _refusal(self, token: str, action: str) -> ControlReply | None:
        """Why a control message with ``token`` is refused (None: the token is right)."""
        if self.token is None:
            return ControlReply(ok=False, detail=f"this router takes no control messages: start it with "
                                                 f"{CONTROL_TOKEN_ENV} set to a shared secret")
        if len(token) > MAX_TOKEN_BYTES or not hmac.compare_digest(token.encode(), self.token.encode()):
            print(json.dumps({"event": "control_refused", "action": action, "why": "wrong token"}), file=sys.stderr)
            return ControlReply(ok=False, detail=f"wrong control token (see {CONTROL_TOKEN_ENV})")
        return None

    def worker_exited(self, routers: dict[str, Router], msg: WorkerExited) -> ControlReply:
        """The supervisor saw a worker's process exit: fence it now (its requests are retried or fail as
        ``worker_lost``), its ``worker_removed`` event saying how it exited."""
        refused = self._refusal(msg.token, "worker_exited")
        if refused is not None:
            return refused
        router = owner(routers.values(), msg.worker_id)
        if router is None:
            return ControlReply(ok=True, detail=f"worker {msg.worker_id} was not registered (or already fenced)")
        router.remove_worker(msg.worker_id, reason=f"{EXITED} ({msg.how})")
        return ControlReply(ok=True, detail=f"worker {msg.worker_id} fenced")

    async def apply(self, routers: dict[str, Router], msg: Control) -> ControlReply:
        """Apply or forward one chaos event to the worker it names (in whichever pool it is registered)."""
        ev = msg.event
        refused = self._refusal(msg.token, ev.action)
        if refused is not None:
            return refused
        print(json.dumps({"event": "control", "action": ev.action, "worker": ev.worker}), file=sys.stderr)
        done = await apply_chaos(_RouterChaos(self, routers), ev)
        return ControlReply(ok=done.ok, detail=done.detail)

    def sync_peers(self, sync: ZmqSyncLink | None, msg: SyncPeers) -> ControlReply:
        """The supervisor tells this replica where its peers publish their sync batches: subscribe to each."""
        refused = self._refusal(msg.token, "sync_peers")
        if refused is not None:
            return refused
        if sync is None:
            return ControlReply(ok=False, detail="replica sync is off here (router.replicas > 1 and "
                                                 "router.replica_sync.enabled turn it on)")
        try:
            for peer, endpoint in sorted(msg.peers.items()):
                sync.connect(peer, endpoint)
        except (InvalidArgument, zmq.ZMQError) as exc:
            return ControlReply(ok=False, detail=f"sync_peers: {exc}"[:300])
        return ControlReply(ok=True, detail=f"subscribed to {counted(len(msg.peers), 'peer')}")

    def on_worker_added(self, routers: dict[str, Router], worker_id: int | None) -> None:
        """A worker registered: give it the KV-event lag chaos set, if any."""
        router = owner(routers.values(), worker_id) if worker_id is not None else None
        if self.lag_ms is not None and router is not None:
            router.send_chaos(worker_id, Chaos(action="delay_kv_events", lag_ms=self.lag_ms))  # type: ignore[arg-type]


class _RouterChaos(ChaosHost):
    """A router process as a chaos host: it restarts itself, faults its own KV feed (a replica) and forwards the
    rest to the worker it names; starting and stopping worker processes is a supervisor's."""

    def __init__(self, control: _RouterControl, routers: dict[str, Router]) -> None:
        self.control = control
        self.routers = routers

    def _workers(self) -> list[int]:
        return sorted(w for r in self.routers.values() for w in r.workers)

    @staticmethod
    def _supervisors(action: str) -> Outcome:
        return Outcome(False, f"{action} starts or stops a worker process: kvemu up applies it (with docker-compose, "
                              "scale the worker service)")

    async def add_worker(self) -> Outcome:
        return self._supervisors("add_worker")

    async def remove_worker(self, worker: int | None, graceful: bool) -> Outcome:
        return self._supervisors("remove_worker")

    async def restart_router(self, replica: int) -> Outcome:
        """Say yes or why not: ``_serve_router`` restarts the router once the reply left."""
        if AGGREGATED not in self.routers:
            return Outcome(False, "restart_router: restarting the routers of a disaggregated cluster is not "
                                  "supported yet")
        return Outcome(True, "restarting: the requests it holds fail with router_restart")

    def _feed(self, action: str, replica: int) -> FeedTap | str:
        """This replica's own KV feed, or why chaos cannot fault it."""
        return self.control.feed or (f"{action} on replica {replica}: this router is no replica (router.replicas "
                                     "is 1)")

    async def delay_kv_events(self, replica: int | None, lag_ms: float) -> Outcome:
        if replica is not None:
            feed = self._feed("delay_kv_events", replica)
            if isinstance(feed, str):
                return Outcome(False, feed)
            feed.lag_ns = round(lag_ms * NS_PER_MS)
            return Outcome(True, f"this replica's KV feed {lag_ms:g} ms late")
        self.control.lag_ms = lag_ms
        workers = self._workers()
        for wid in workers:
            owner(self.routers.values(), wid).send_chaos(  # type: ignore[union-attr]
                wid, Chaos(action="delay_kv_events", lag_ms=lag_ms))
        return Outcome(True, f"KV events {lag_ms:g} ms late on {counted(len(workers), 'worker')} and every later "
                             "one")

    async def drop_kv_events(self, replica: int, count: int) -> Outcome:
        feed = self._feed("drop_kv_events", replica)
        if isinstance(feed, str):
            return Outcome(False, feed)
        feed.drop_next += count
        return Outcome(True, f"the next {counted(count, 'KV batch')} of this replica's feed lost")

    async def to_worker(self, worker: int | None, msg: Chaos) -> Outcome:
        workers = self._workers()
        if worker is None and not workers:
            return Outcome(False, f"{msg.action}: no worker is registered")
        target = worker if worker is not None else workers[0]
        router = owner(self.routers.values(), target)
        why = (router.send_chaos(target, msg) if router is not None else
               f"worker {target} is not registered (registered: {workers[:16]})")
        return Outcome(why is None, why or f"{msg.action} sent to worker {target}")


def router_main(scenario: Scenario, listen: str, grace_s: float = 10.0, http: HttpOptions | None = None,
                replica: int = 0, sync_listen: str = "tcp://127.0.0.1:0",
                sync_peers: dict[int, str] | None = None) -> int:
    """``kvemu router``: serve until SIGTERM (with an OpenAI front door when ``http`` is given); with
    ``router.replicas``, as replica ``replica``, its sync PUB on ``sync_listen`` and subscribed to ``sync_peers``
    (more can be given later: ``SyncPeers`` on the control channel)."""
    tune_gc()
    run_live(lambda: _serve_router(scenario, listen, grace_s, http, replica, sync_listen, sync_peers))
    return 0


# ---------------------------------------------------------------------------------- worker
