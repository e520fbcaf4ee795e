"""kvemu as a real distributed system: router, worker and load-generator processes over ZeroMQ.

One ROUTER socket on the router's ``--listen`` address serves both workers (2-frame messages:
identity, payload) and clients (3 frames: identity, ``b"C"``, payload). Clients send ``ClientRequest``s
and get back each request's ``kvemu.RequestRecord`` when it ends; ``StatsQuery`` returns the router's view
(ranks, per-rank load and cache, KV-event and affinity counters). Every process logs one JSON line when
it starts, with its endpoints, and shuts down cleanly on SIGTERM. A disaggregated scenario's router process
hosts its prefill and decode routers on that one socket (``harness.gate`` gives each worker its own pool's
router) behind a ``DisaggRouter``; each worker serves the pool its ``--worker-type`` names.
"""

from __future__ import annotations

import hmac
import json
import os
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict, TypeVar

import anyio
import msgspec
import zmq

from kvemu.clock import NS_PER_S, WallClock
from kvemu.disagg import DECODE
from kvemu.http import DEFAULT_MODEL
from kvemu.records import RequestRecord
from kvemu.hooks import Hooks
from kvemu.runtime.loop import run_live
from kvemu.messages import Chaos, ClientRequest, encode, with_packed_prompt
from kvemu.runtime.prompt_lane import PromptLane
from kvemu.runtime.router import Router
from kvemu.runtime.transport import ZmqRouterEnd, ZmqWorkerEnd, message_socket
from kvemu.tuning import tune_gc
from kvemu.wire import security
from kvemu.wire.publisher import KvEventPublisher
from workers.actor import WorkerActor, WorkerRejected
from workers.worker import MockWorker

from harness.chaos import (
    CONTROL_TOKEN_ENV,
    MAX_TOKEN_BYTES,
    SUPERVISOR_CHAOS,
    Control,
    ControlReply,
    WorkerExited,
    at_ns,
    worker_chaos,
)
from harness.cluster import engine_config, pool_router
from harness.gate import PoolGate
from harness.pools import (
    AGGREGATED,
    affinity_stats,
    compose_pools,
    kv_stats,
    owner,
    pool_sizes,
    routing_block_size,
    samples,
    worker_type_of,
)
from harness.recorder import Recorder
from harness.report import EXITED, RunData, Sample, save_report
from harness.runner import count_requests
from harness.sessions import awaiting, play_workload
from harness.scenario import ChaosEvent, Scenario, ScenarioError
from harness.text import counted
from harness.workload import build_sessions

__all__ = ["HttpOptions", "StatsQuery", "Stats", "RecordReply", "router_main", "worker_main", "worker_pool",
           "loadgen_main", "loadgen_report", "log_start",
           "send_control", "NotStarted", "RouterUnreachable"]

CLIENT = b"C"


class StatsQuery(msgspec.Struct, tag=True, frozen=True):
    """Ask the router for its current view."""


class Stats(msgspec.Struct, tag=True, kw_only=True):
    """The router's view: ranks, per-rank load/cache, counters (one reply to ``StatsQuery``)."""

    now_ns: int
    workers: list[int]
    ranks: list[tuple[int, int]]
    samples: list[Sample]
    kv_stats: dict[int, dict[str, int]]
    affinity: dict[str, int] | None = None
    counters: dict[str, int] = {}
    worker_events: list[dict[str, Any]] = []
    router_id: str = ""
    """Changes when the router restarts (a new process, or chaos ``restart_router``): a client's requests
    sent before ``router_started_ns`` and never answered were lost with the old one."""
    router_started_ns: int = 0
    process_id: str = ""
    """Changes only when the router process is replaced (its counters then start again from zero)."""
    records_held: int = 0
    """Request records the router process still keeps (those of requests still open): a leak shows here."""
    pools: dict[str, list[int]] = {}
    """The workers registered with each pool's router: ``aggregated``, or ``prefill`` and ``decode``."""


class RecordReply(msgspec.Struct, tag=True, kw_only=True):
    """A finished request's record, as the router's hook recorder built it."""

    record: RequestRecord


ClientMessage = ClientRequest | StatsQuery | Control | WorkerExited
ReplyMessage = RecordReply | Stats | ControlReply
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_reply_decoder = msgspec.msgpack.Decoder(ReplyMessage)


MAX_CLIENT_ID_CHARS = 1024
"""The longest request id a refusal of a malformed client message echoes back."""


class _Head(msgspec.Struct):
    """What a malformed client message is read for: its type and request id (every other field skipped)."""

    type: str = ""
    request_id: str = ""


_head_decoder = msgspec.msgpack.Decoder(_Head)


LANE_FRAME_BYTES = 1 << 20
"""A client message this large (a prompt of ~250k+ ids) is decoded in the router's prompt lane, not at once."""


def malformed_reply(data: bytes, exc: Exception, now_ns: int) -> RecordReply | ControlReply | None:
    """The answer to a client message that did not decode, when it can be attributed: a ``ClientRequest`` whose
    ``request_id`` can be read gets its record failed with ``invalid_request`` naming what was wrong, a
    ``Control`` a refusal (control answers go back in order); anything else None (nobody to answer)."""
    try:  # only the message's type and id: the rest (a prompt past the bound, say) is skipped, not built
        head = _head_decoder.decode(data)
    except Exception:  # noqa: BLE001 - not a msgpack map with a str type and id (or nested past the depth)
        return None
    why = str(exc)[:300]
    if head.type == "ClientRequest":
        rid = head.request_id
        if 0 < len(rid) <= MAX_CLIENT_ID_CHARS:
            return RecordReply(record=RequestRecord(request_id=rid, arrival_ns=now_ns,
                                                    failure=f"invalid_request: malformed ClientRequest: {why}"))
    elif head.type == "Control":
        return ControlReply(ok=False, detail=f"malformed control message: {why}")
    return None


def log_start(role: str, **endpoints: Any) -> None:
    """The one structured line every process prints when it starts."""
    print(json.dumps({"event": "started", "role": role, "pid": os.getpid(), **endpoints}), flush=True)


# ---------------------------------------------------------------------------------- router


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


class _Instance(TypedDict):
    """The router instance a process runs (a chaos restart replaces it)."""

    id: str
    started_ns: int


_A = TypeVar("_A")


def _answer(waiters: deque[tuple[anyio.Event, list[_A]]], answer: _A) -> None:
    """Hand ``answer`` to the oldest query waiting for one of its kind (none: a late answer, dropped)."""
    if waiters:
        event, box = waiters.popleft()
        box.append(answer)
        event.set()


def _quiet(fut: Any) -> None:
    if not fut.cancelled():
        fut.exception()  # a vanished peer: nothing to do


def send_control(router: str, token: str, event: ChaosEvent | WorkerExited, timeout_s: float = 10.0) -> ControlReply:
    """Send one chaos event (or a worker's exit) to a router process's control channel and wait for its
    answer (blocking)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # a router that refused the handshake (a different KVEMU_SECRET) leaves no peer to queue for: without a
    # send timeout, the send would wait for one forever
    sock.setsockopt(zmq.SNDTIMEO, max(1, round(timeout_s * 1000)))
    security.connect_securely(sock)
    deadline = time.monotonic() + timeout_s
    try:
        sock.connect(router)
        msg = event if isinstance(event, WorkerExited) else Control(token=token, event=event)
        try:
            sock.send_multipart([CLIENT, encode(msg)])
        except zmq.Again:
            return ControlReply(ok=False, detail=f"no answer from the router within {timeout_s:g} s")
        while (left := deadline - time.monotonic()) > 0 and sock.poll(round(left * 1000)):
            frames = sock.recv_multipart()
            if len(frames) == 2 and frames[0] == CLIENT:
                try:
                    reply = _reply_decoder.decode(frames[1])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                if type(reply) is ControlReply:
                    return reply
        return ControlReply(ok=False, detail=f"no answer from the router within {timeout_s:g} s")
    finally:
        sock.close(linger=0)


def client_request_key(peer: bytes, request_id: str) -> str:
    """The router's id for a client's request: the client's connection identity, then its own id."""
    return f"{peer.hex()}/{request_id}"


class HttpOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Where a process serves HTTP, and how (``--http``, ``--tokenizer``, ``--model``)."""

    listen: str
    tokenizer: str | None = None
    model: str = DEFAULT_MODEL
    server: str = "uvicorn"
    """``uvicorn`` or ``granian`` (``--http-server``)."""


async def _serve_router(scenario: Scenario, listen: str, grace_s: float, http: HttpOptions | None = None) -> None:
    clock = WallClock()
    hooks = Hooks()
    spec = scenario.cluster
    recorder = Recorder(hooks, block_size=routing_block_size(spec))
    lane = PromptLane(clock, routing_block_size(spec))
    end = _SharedRouterEnd(listen)
    routers: dict[str, Router] = {}
    gate = PoolGate(end, {worker_type_of(spec, pool): pool for pool in spec.pools()}, lambda: routers)

    def new_router(pool: str) -> Router:
        return pool_router(scenario, pool, clock=clock, end=gate.end(pool), hooks=hooks,
                           zmq_kv_events=pool != DECODE)  # decode workers' KV events go to nobody

    pools, front = compose_pools(spec, new_router, clock=clock, hooks=hooks,
                                 retry_limit=scenario.router.settings().retry_limit)
    routers.update(pools)
    instance: _Instance = {"id": uuid.uuid4().hex[:12], "started_ns": clock.now_ns()}
    process_id = f"{os.getpid()}-{instance['id']}"
    control = _RouterControl(os.environ.get(CONTROL_TOKEN_ENV) or None)
    server = None
    if http is not None:
        from kvemu.http.server import HttpServer

        from harness.frontdoor import front_door

        assert not spec.disaggregated, "the CLI refuses --http for a disaggregated cluster"
        def forget(rid: str) -> None:
            recorder.records.pop(rid, None)  # the client has its answer

        app = front_door(scenario, lambda: routers[AGGREGATED], hooks, clock, tokenizer=http.tokenizer,
                         model=http.model, forget=forget)
        server = HttpServer(app, http.listen, http.server)
    in_flight: set[str] = set()

    async def handle(peer: bytes, req: ClientRequest | None, frame: bytes = b"") -> None:
        """Run one client request and reply with its record; a huge one (or a large ``frame`` still to decode)
        works in the prompt lane, so that a burst of them leaves the loop to other requests between steps."""
        async with lane.turn(bool(frame) or lane.is_huge(req.tokens)) as work:  # type: ignore[union-attr]
            if req is None:
                req = decode_request(peer, frame)
                if req is None:
                    return
                await work.pause()
            # requests are keyed by (client, request id): two clients may use the same id, and a reply goes
            # only to the client that sent the request
            key = client_request_key(peer, req.request_id)
            if key in in_flight:  # this client's own id, still running: refuse the copy, keep the original
                end.reply(peer, encode(RecordReply(record=_record(req, clock.now_ns(), "duplicate_request_id"))))
                return
            in_flight.add(key)
            ended = anyio.Event()
            try:
                await work.hash(req.tokens)  # a packed prompt: its blocks a slice per step
                front.submit(msgspec.structs.replace(req, request_id=key), lambda _record: ended.set())
            except BaseException:
                in_flight.discard(key)
                raise
        try:
            await ended.wait()
        finally:
            in_flight.discard(key)
            rec = recorder.records.pop(key, None)
            if rec is not None:
                rec.request_id = req.request_id
                end.reply(peer, encode(RecordReply(record=rec)))

    def decode_message(peer: bytes, data: bytes) -> ClientMessage | None:
        """A client message decoded (a request's prompt packed: ``with_packed_prompt``); a malformed one is
        answered where it can be attributed, and gives None."""
        try:
            return with_packed_prompt(_client_decoder.decode(data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            print(json.dumps({"event": "bad_client_message", "error": str(exc)[:200]}), file=sys.stderr)
            answer = malformed_reply(data, exc, clock.now_ns())
            if answer is not None:  # the client waits for it: say what was wrong instead of nothing
                end.reply(peer, encode(answer))
            return None

    def decode_request(peer: bytes, data: bytes) -> ClientRequest | None:
        """A large client message decoded: a request, or None (answered when malformed; a query or control
        message is never this large and is dropped, logged)."""
        msg = decode_message(peer, data)
        if msg is not None and type(msg) is not ClientRequest:
            print(json.dumps({"event": "bad_client_message", "error": f"an oversized {type(msg).__name__}"}),
                  file=sys.stderr)
            return None
        return msg

    def stats() -> Stats:
        now = clock.now_ns()
        current = list(routers.values())
        taken = samples(routers, now)
        return Stats(now_ns=now, workers=sorted(w for r in current for w in r.workers),
                     ranks=[(x.worker_id, x.dp_rank) for x in taken], samples=taken, kv_stats=kv_stats(current),
                     affinity=affinity_stats(current), counters=dict(recorder.counters),
                     worker_events=recorder.worker_events, router_id=instance["id"],
                     router_started_ns=instance["started_ns"], process_id=process_id,
                     records_held=len(recorder.records),
                     pools={pool: sorted(r.workers) for pool, r in routers.items()})

    scopes: dict[str, anyio.CancelScope] = {}

    async def serve_pool(pool: str, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.CancelScope() as scopes[pool]:
            await routers[pool].serve(task_status=task_status)

    async def restart(tg: anyio.abc.TaskGroup) -> None:
        """Chaos: the router loses all its state, as if its process had been replaced on the same address
        (an aggregated cluster: ``_RouterControl`` refuses it for a disaggregated one)."""
        nonlocal front
        old = routers[AGGREGATED]
        old.stop("router_restart")  # each handler replies to its client
        scopes[AGGREGATED].cancel()
        await anyio.sleep(0)
        front = routers[AGGREGATED] = new_router(AGGREGATED)
        front.kv_stats.update(old.kv_stats)  # the report counts the KV events of every router instance
        instance.update({"id": uuid.uuid4().hex[:12], "started_ns": clock.now_ns()})
        await tg.start(serve_pool, AGGREGATED)

    hooks.subscribe(lambda ev: control.on_worker_added(routers, ev.worker_id), "worker_added")

    async def gateway(tg: anyio.abc.TaskGroup) -> None:
        async for peer, data in end.clients_rx:
            if len(data) >= LANE_FRAME_BYTES:  # a huge prompt: decoded in the lane, after those before it
                tg.start_soon(handle, peer, None, data)
                continue
            msg = decode_message(peer, data)
            if msg is None:
                continue
            t = type(msg)
            if t is StatsQuery:
                end.reply(peer, encode(stats()))
            elif t is WorkerExited:
                end.reply(peer, encode(control.worker_exited(routers, msg)))  # type: ignore[arg-type]
            elif t is Control:
                reply = control.apply(routers, msg)  # type: ignore[arg-type]
                end.reply(peer, encode(reply))
                if reply.ok and msg.event.action == "restart_router":  # type: ignore[union-attr]
                    await restart(tg)
            else:  # a ClientRequest: the other types are handled above (mypy does not narrow through ``t``)
                tg.start_soon(handle, peer, msg)  # type: ignore[arg-type]

    async with anyio.create_task_group() as tg:
        for pool in list(routers):
            await tg.start(serve_pool, pool)
        tg.start_soon(gate.serve)
        tg.start_soon(gateway, tg)
        if server is not None:
            await tg.start(server.serve)
        log_start("router", listen=end.endpoint, control=control.token is not None, pools=list(routers),
                  **({"http": server.url} if server is not None else {}))
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        # drain: requests in flight (from ZeroMQ clients and over HTTP) get up to grace_s to finish, then fail
        # with router_shutdown
        with anyio.move_on_after(grace_s):
            while in_flight or any(r.lifecycle.flights for r in routers.values()):
                await anyio.sleep(0.01)
        for router in routers.values():
            router.stop("router_shutdown")  # ends them: each handler replies to its client
        with anyio.move_on_after(1.0):
            while in_flight:
                await anyio.sleep(0.01)
        await anyio.sleep(0.05)  # let the replies leave the socket
        tg.cancel_scope.cancel()
    await end.aclose()


class _RouterControl:
    """The router process's control channel: checks the token and applies or forwards chaos events."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self.lag_ms: float | None = None
        """The KV-event lag chaos set, for workers that register later too."""

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

    def apply(self, routers: dict[str, Router], msg: Control) -> ControlReply:
        """Apply or forward one chaos event to the worker it names (in whichever pool it is registered)."""
        ev = msg.event
        refused = self._refusal(msg.token, ev.action)
        if refused is not None:
            return refused
        if ev.action in SUPERVISOR_CHAOS:
            return ControlReply(ok=False, detail=f"{ev.action} starts or stops a worker process: kvemu up applies it "
                                                 "(with docker-compose, scale the worker service)")
        print(json.dumps({"event": "control", "action": ev.action, "worker": ev.worker}), file=sys.stderr)
        workers = sorted(w for r in routers.values() for w in r.workers)
        if ev.action == "restart_router":
            if AGGREGATED not in routers:
                return ControlReply(ok=False, detail="restart_router: restarting the routers of a disaggregated "
                                                     "cluster is not supported yet")
            return ControlReply(ok=True, detail="restarting: the requests it holds fail with router_restart")
        if ev.action == "delay_kv_events":
            self.lag_ms = ev.lag_ms
            for wid in workers:
                owner(routers.values(), wid).send_chaos(wid, worker_chaos(ev))  # type: ignore[union-attr]
            return ControlReply(ok=True, detail=f"KV events {ev.lag_ms:g} ms late on {counted(len(workers), 'worker')} "
                                                "and every later one")
        if ev.worker is None and not workers:
            return ControlReply(ok=False, detail=f"{ev.action}: no worker is registered")
        target = ev.worker if ev.worker is not None else workers[0]
        router = owner(routers.values(), target)
        why = (router.send_chaos(target, worker_chaos(ev)) if router is not None else
               f"worker {target} is not registered (registered: {workers[:16]})")
        return ControlReply(ok=why is None, detail=why or f"{ev.action} sent to worker {target}")

    def on_worker_added(self, routers: dict[str, Router], worker_id: int | None) -> None:
        """A worker registered: give it the KV-event lag chaos set, if any."""
        router = owner(routers.values(), worker_id) if worker_id is not None else None
        if self.lag_ms is not None and router is not None:
            router.send_chaos(worker_id, Chaos(action="delay_kv_events", lag_ms=self.lag_ms))  # type: ignore[arg-type]


def router_main(scenario: Scenario, listen: str, grace_s: float = 10.0, http: HttpOptions | None = None) -> int:
    """``kvemu router``: serve until SIGTERM (with an OpenAI front door when ``http`` is given)."""
    tune_gc()
    run_live(lambda: _serve_router(scenario, listen, grace_s, http))
    return 0


# ---------------------------------------------------------------------------------- worker


async def _serve_worker(scenario: Scenario, router: str, worker_id: int, pool: str, dp_size: int, kv_events: str,
                        kv_replay: str | None, grace_s: float, http: HttpOptions | None = None) -> None:
    spec = scenario.cluster
    cfg = msgspec.structs.replace(engine_config(spec, pool), dp_size=dp_size)
    mock = MockWorker(cfg, worker_id=worker_id)
    pubs = [KvEventPublisher(kv_events, replay_endpoint=kv_replay, dp_rank=r, bind=True,
                             vllm_version=spec.kv_events_version) for r in range(dp_size)]
    end = ZmqWorkerEnd(router, worker_id)
    actor = WorkerActor(mock, end, WallClock(), pubs, mode="live", heartbeat_interval_s=spec.heartbeat_interval_s,
                        kv_endpoints=[_reachable(p.endpoint) for p in pubs],
                        kv_replay_endpoints=[_reachable(p.replay_endpoint) if p.replay_endpoint else "" for p in pubs],
                        worker_type=worker_type_of(spec, pool))
    actor.on_unanswered = lambda waited_s: print(
        f"kvemu worker: worker {worker_id}: no answer from the router at {router} after {waited_s:g} s: is it running "
        f"there, and does it have the same {security.SECRET_ENV} as this worker? (still trying for "
        f"{actor.register_timeout_s - waited_s:g} s)", file=sys.stderr, flush=True)
    actor.on_chaos = lambda msg, why: print(json.dumps({"event": "chaos_applied", "worker_id": worker_id,
                                                        "action": msg.action, "dp_rank": msg.dp_rank, "error": why}),
                                            file=sys.stderr, flush=True)
    server = None
    if http is not None:
        from kvemu.http.server import HttpServer

        from harness.frontdoor import worker_door

        server = HttpServer(worker_door(scenario, actor, tokenizer=http.tokenizer, model=http.model), http.listen,
                            http.server)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(actor.run)
            if server is not None:
                await tg.start(server.serve)
            log_start("worker", worker_id=worker_id, pool=pool, router=router, kv_events=[p.endpoint for p in pubs],
                      kv_replay=[p.replay_endpoint for p in pubs],
                      **({"http": server.url} if server is not None else {}))
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            await actor.shutdown(grace_s)
            await anyio.sleep(0.05)  # let the deregistration leave
            tg.cancel_scope.cancel()
    finally:
        for p in pubs:
            p.close(drain_timeout_s=0.2)
        await end.aclose()


def _reachable(endpoint: str) -> str:
    """A bound wildcard endpoint as a peer can connect to it."""
    return endpoint.replace("0.0.0.0", "127.0.0.1").replace("tcp://*", "tcp://127.0.0.1")


def worker_pool(scenario: Scenario, worker_type: str | None) -> str:
    """The pool a ``kvemu worker --worker-type`` serves: the aggregated pool by default, or the pool it names of
    a disaggregated cluster (where it is required). ``ScenarioError`` naming the flag otherwise."""
    pools = list(scenario.cluster.pools())
    if worker_type is None and len(pools) == 1:
        return pools[0]
    if worker_type in pools:
        return worker_type
    choices = " or ".join(f"--worker-type {p}" for p in pools)
    if worker_type is None:
        raise ScenarioError(f"the scenario's cluster is disaggregated (cluster.prefill, cluster.decode): say which "
                            f"pool this worker serves with {choices}")
    raise ScenarioError(f"--worker-type {worker_type}: the scenario's cluster has no {worker_type} pool (its pools: "
                        f"{', '.join(pools)}); " + ("drop --worker-type" if pools == [AGGREGATED] else f"use {choices}"))


def worker_main(scenario: Scenario, router: str, *, worker_id: int | None, dp_size: int | None,
                kv_events: str, kv_replay: str | None, grace_s: float = 10.0, http: HttpOptions | None = None,
                worker_type: str | None = None) -> int:
    """``kvemu worker``: serve one router until SIGTERM (and OpenAI clients directly when ``http`` is given);
    ``worker_type`` picks the pool (its engine and DP size) of a disaggregated cluster (``worker_pool``)."""
    pool = worker_pool(scenario, worker_type)
    tune_gc()
    wid = worker_id if worker_id is not None else uuid.uuid4().int % (1 << 31)
    try:
        run_live(lambda: _serve_worker(scenario, router, wid, pool, dp_size or scenario.cluster.pools()[pool][1],
                                       kv_events, kv_replay, grace_s, http))
    except BaseException as exc:  # the router refused it (a squatted id...) or never answered: one line, no traceback
        rejected = exc.split(WorkerRejected)[0] if isinstance(exc, BaseExceptionGroup) else exc
        while isinstance(rejected, BaseExceptionGroup) and rejected.exceptions:
            rejected = rejected.exceptions[0]
        if not isinstance(rejected, WorkerRejected):
            raise
        print(f"kvemu worker: {rejected}", file=sys.stderr, flush=True)
        return 1
    return 0


# ---------------------------------------------------------------------------------- load generator


def _record(req: ClientRequest, arrival_ns: int, failure: str | None = None) -> RequestRecord:
    """The record of a request that never ran: refused at the gateway, or never answered."""
    return RequestRecord(request_id=req.request_id, session_id=req.session_id, parent_session_id=req.parent_session_id,
                         arrival_ns=arrival_ns, isl=len(req.tokens), max_tokens=req.max_tokens, failure=failure)


class _RouterClient:
    """A DEALER to the router: submit requests, await their records, query stats."""

    def __init__(self, router: str) -> None:
        sock = message_socket(zmq.DEALER)
        security.connect_securely(sock)
        sock.connect(router)
        self.sock = sock
        self.records: dict[str, RequestRecord] = {}
        self._waiting: dict[str, anyio.Event] = {}
        self._stats_waiters: deque[tuple[anyio.Event, list[Stats]]] = deque()  # replies come back in order
        self._control_waiters: deque[tuple[anyio.Event, list[ControlReply]]] = deque()
        self.replies: list[RequestRecord] | None = None
        """Every record received, in arrival order, when set to a list (tests)."""
        self.heard_ns = time.monotonic_ns()
        """When the router last said anything (any reply)."""
        self.lost: str | None = None
        """Why the router is considered gone (``router_lost``); every open and later request then fails."""
        self.router_now: Callable[[], int] = time.monotonic_ns
        """The router's clock, for the records of requests it never answered."""
        self._sent: dict[str, tuple[ClientRequest, int]] = {}  # awaiting a reply: the request, when it was sent
    async def listen(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2 or frames[0] != CLIENT:
                continue
            self.heard_ns = time.monotonic_ns()
            try:
                msg = _reply_decoder.decode(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                print(json.dumps({"event": "bad_router_message", "error": str(exc)[:200]}), file=sys.stderr)
                continue
            if type(msg) is RecordReply:
                if self.replies is not None:
                    self.replies.append(msg.record)
                rid = msg.record.request_id
                self.records[rid] = msg.record
                ev = self._waiting.pop(rid, None)
                if ev is not None:
                    ev.set()
            elif type(msg) is ControlReply:  # answers come back in the order their queries went
                _answer(self._control_waiters, msg)
            elif type(msg) is Stats:
                _answer(self._stats_waiters, msg)

    async def submit(self, req: ClientRequest) -> RequestRecord | None:
        if self.lost is not None:
            return self._failed(req, self.lost)
        ev = self._waiting[req.request_id] = anyio.Event()
        self._sent[req.request_id] = (req, self.router_now())
        await self.sock.send_multipart([CLIENT, encode(req)])
        await ev.wait()
        self._sent.pop(req.request_id, None)
        return self.records.get(req.request_id)

    def open_records(self) -> list[RequestRecord]:
        """Records for the requests sent and not answered (a stopped run reports them unfinished)."""
        return [_record(req, sent_ns) for rid, (req, sent_ns) in self._sent.items() if rid not in self.records]

    def lose(self, reason: str = "router_lost") -> None:
        """The router is gone: fail every request still waiting for it (and every later one) with ``reason``."""
        self.lost = reason
        self._fail_waiting(reason)

    def restarted(self, before_ns: int, why: str) -> list[str]:
        """The router restarted at ``before_ns`` (its clock): requests sent before then and not answered were
        lost with it; fail them with ``why`` (a late answer still replaces the record). Returns their ids."""
        return self._fail_waiting(why, before_ns)

    def _fail_waiting(self, reason: str, before_ns: int | None = None) -> list[str]:
        """Fail the requests still awaiting an answer (those sent before ``before_ns``, when given) and wake
        their senders; returns their ids."""
        ids = [rid for rid, (_, sent) in self._sent.items()
               if rid not in self.records and (before_ns is None or sent < before_ns)]
        for rid in ids:
            self._failed(self._sent[rid][0], reason)
            ev = self._waiting.pop(rid, None)
            if ev is not None:
                ev.set()
        return ids

    def _failed(self, req: ClientRequest, reason: str) -> RequestRecord:
        rec = self.records[req.request_id] = _record(req, self.router_now(), reason)
        return rec

    async def stats(self, timeout_s: float = 30.0) -> Stats:
        """The router's current view (``TimeoutError`` if it does not answer in time)."""
        answer = await self._ask(StatsQuery(), self._stats_waiters, timeout_s)
        if answer is None:
            raise TimeoutError(f"no answer from the router within {timeout_s:g} s")
        return answer

    async def control(self, msg: Control, timeout_s: float = 10.0) -> ControlReply:
        """Send a control message and wait for the router's answer."""
        answer = await self._ask(msg, self._control_waiters, timeout_s)
        return answer or ControlReply(ok=False, detail=f"no answer from the router within {timeout_s:g} s")

    async def _ask(self, msg: msgspec.Struct, waiters: deque[tuple[anyio.Event, list[_A]]],
                   timeout_s: float) -> _A | None:
        """Send a query and wait for its answer (None after ``timeout_s``: a late answer then goes to the next
        query of its kind, which any view of the router will do for)."""
        waiter: tuple[anyio.Event, list[_A]] = (anyio.Event(), [])
        waiters.append(waiter)
        await self.sock.send_multipart([CLIENT, encode(msg)])
        with anyio.move_on_after(timeout_s):
            await waiter[0].wait()
        if not waiter[1]:
            waiters.remove(waiter)
            return None
        return waiter[1][0]


def router_silence_s(scenario: Scenario) -> float:
    """How long a router may stay silent before a load generator that cannot see its process declares it lost
    (``run.router_silence_s``; default five heartbeat intervals, at least 5 s)."""
    if scenario.run.router_silence_s is not None:
        return scenario.run.router_silence_s
    return max(5.0, 5 * scenario.cluster.heartbeat_interval_s)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a stopped process is alive; a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # no /proc: existing is all we can tell
    return "State:\tZ" not in status and "State:\tX" not in status


async def _loadgen(scenario: Scenario, router: str, outdir: Path, expect_workers: int | None,
                   apply_chaos: bool = False, router_pid: int | None = None) -> tuple[dict[str, Any], Path | None]:
    sessions = build_sessions(scenario)
    client = _RouterClient(router)
    wall0 = time.perf_counter_ns()
    samples: list[Sample] = []
    token = os.environ.get(CONTROL_TOKEN_ENV, "")
    run = _LoadgenRun()
    t0 = 0
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.listen)
            play_scope, wait_scope = anyio.CancelScope(), anyio.CancelScope()

            def lose(**details: Any) -> None:
                print(json.dumps({"event": "router_lost", **details}), file=sys.stderr)
                client.lose("router_lost")
                play_scope.cancel()  # sessions stop: nothing more is sent to a router that is gone
                wait_scope.cancel()

            async def on_signal(*, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
                # SIGTERM or Ctrl-C: stop sending, report what happened so far; SIGUSR1: the router died
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) as signals:
                    task_status.started()
                    async for signum in signals:
                        if signum == signal.SIGUSR1:  # kvemu up saw the router process die
                            lose(why="the router process exited")
                        else:
                            run.stopped = signal.Signals(signum).name
                            play_scope.cancel()
                            wait_scope.cancel()
                        return

            await tg.start(on_signal)  # from the start: a signal while waiting for the router is not fatal
            with wait_scope:
                st = await _await_router(client, router, expect_workers, CONNECT_WAIT_S)
            if wait_scope.cancelled_caught:
                raise NotStarted(f"the router process exited before the run started ({router})" if client.lost
                                 else f"stopped by {run.stopped} before the run started")
            t0 = st.now_ns
            log_start("loadgen", router=router, workers=st.workers, requests=count_requests(sessions))
            run.last = st
            lost_after_ns = round(router_silence_s(scenario) * NS_PER_S)
            stall_ns = round(max(scenario.run.router_stall_s, lost_after_ns / NS_PER_S) * NS_PER_S)

            async def sampler() -> None:
                waiting = False  # for a silent router whose process is alive
                while True:
                    try:
                        s = await client.stats(timeout_s=1.0)
                    except TimeoutError:  # a saturated router skips a sample; a silent one is gone
                        silent_ns = time.monotonic_ns() - client.heard_ns
                        if silent_ns <= lost_after_ns:
                            continue
                        alive = process_alive(router_pid) if router_pid is not None else None
                        if alive is False:
                            return lose(why="the router process exited")
                        if alive is None or silent_ns > stall_ns:
                            return lose(silent_s=round(silent_ns / NS_PER_S, 1))
                        if not waiting:
                            waiting = True
                            print(json.dumps({"event": "router_silent", "silent_s": round(silent_ns / NS_PER_S, 1),
                                              "process": "alive", "waiting_up_to_s": stall_ns / NS_PER_S}),
                                  file=sys.stderr, flush=True)
                        continue
                    if waiting:
                        waiting = False
                        print(json.dumps({"event": "router_answering"}), file=sys.stderr, flush=True)
                    run.observe(s, client)
                    samples.extend(msgspec.structs.replace(x, time_ns=x.time_ns - t0) for x in s.samples)
                    await anyio.sleep(0.25)

            clock = _Since(t0, st.now_ns)
            client.router_now = lambda: clock.now_ns() + t0

            async def chaos() -> None:  # docker-compose: the load generator carries the timeline
                ids = sorted(st.workers)  # worker N of the timeline: the N-th registered at the start, by id
                for ev in sorted(scenario.chaos, key=lambda e: e.at_s):
                    await anyio.sleep(max(0, at_ns(ev) - clock.now_ns()) / NS_PER_S)
                    if ev.worker is not None and ev.worker < len(ids):
                        ev = msgspec.structs.replace(ev, worker=ids[ev.worker])
                    reply = await client.control(Control(token=token, event=ev))
                    print(json.dumps({"event": "chaos", "action": ev.action, "at_s": ev.at_s, "ok": reply.ok,
                                      "detail": reply.detail}), file=sys.stderr)

            tg.start_soon(sampler)
            if apply_chaos:
                tg.start_soon(chaos)
            finished = True
            with play_scope:
                async with anyio.create_task_group() as play:
                    finished = await play_workload(scenario, sessions, awaiting(play, client.submit), clock)
                    play.cancel_scope.cancel()  # cut short: the requests still out are abandoned
            run.partial = not finished or client.lost is not None or run.stopped is not None
            if client.lost is None and run.stopped is None:
                try:
                    run.observe(await client.stats(timeout_s=5.0), client)
                except TimeoutError:
                    pass
            tg.cancel_scope.cancel()
    except Exception as exc:  # noqa: BLE001 - a bug or a broken router: still report what ran, marked partial
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # the task group's: name the cause
            exc = exc.exceptions[0]  # type: ignore[assignment]
        if not t0:
            raise exc from None  # nothing ran yet
        run.partial = True
        run.stopped = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        print(json.dumps({"event": "loadgen_error", "error": run.stopped}), file=sys.stderr)
    records = [_shift(r, t0) for r in [*client.records.values(), *client.open_records()]]
    final = run.last
    data = RunData(records=sorted(records, key=lambda r: (r.arrival_ns, r.request_id)), scenario_name=scenario.name,
                   mode="live", seed=scenario.run.seed, wall_time_ns=time.perf_counter_ns() - wall0,
                   partial=run.partial,
                   stop_reason=client.lost or run.stopped or ("drain_timeout" if run.partial else None),
                   block_size=routing_block_size(scenario.cluster), ranks=final.ranks, samples=samples,
                   kv_stats=run.kv_stats(), affinity=final.affinity, counters=run.counters(),
                   failures=_failures(records), worker_events=run.worker_events(), pools=pool_sizes(scenario.cluster),
                   sla=scenario.run.sla, concurrency=scenario.workload.concurrency)
    return save_report(data, outdir)


CONNECT_WAIT_S = 60.0
"""How long the load generator waits for the router (and the workers it expects) before giving up."""


class NotStarted(RuntimeError):
    """The load generator stopped before its run started: nothing ran, so there is nothing to report."""


class RouterUnreachable(NotStarted):
    """The load generator never heard from the router, or the workers it expects never registered."""


async def _await_router(client: _RouterClient, router: str, expect_workers: int | None, wait_s: float) -> Stats:
    """The router's first view once it answers and has the expected workers; ``RouterUnreachable`` after
    ``wait_s`` (it is starting, or unreachable: a wrong address, or a different ``KVEMU_SECRET``)."""
    deadline = time.monotonic() + wait_s
    st: Stats | None = None
    while time.monotonic() < deadline:
        try:
            st = await client.stats(timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
        except TimeoutError:
            continue
        if expect_workers is None or len(st.workers) >= expect_workers:
            return st
        await anyio.sleep(0.1)
    if st is None:
        raise RouterUnreachable(f"no answer from the router at {router} within {wait_s:g} s: is it running, and "
                                f"does it have the same {security.SECRET_ENV} as this process?")
    raise RouterUnreachable(f"the router at {router} has {counted(len(st.workers), 'worker')}, not the "
                            f"{expect_workers} expected, after {wait_s:g} s")


class _LoadgenRun:
    """What the load generator learns of the router over a run, across router restarts."""

    def __init__(self) -> None:
        self.last: Stats = None  # type: ignore[assignment]
        self.gone: list[Stats] = []
        """The last view of each router process that was replaced (its counters still count)."""
        self.restarts = 0
        self.partial = False
        self.stopped: str | None = None

    def observe(self, s: Stats, client: _RouterClient) -> None:
        """A new view; a new router id means the router restarted: what was sent before it started and is not
        answered is failed with ``router_lost`` (a request queued while no router listened may still be
        answered by the new one, and its record then replaces the failure)."""
        last = self.last
        if s.router_id != last.router_id:
            self.restarts += 1
            lost = client.restarted(s.router_started_ns, "router_lost: the router restarted without answering")
            print(json.dumps({"event": "router_restarted", "router": s.router_id, "unanswered": len(lost)}),
                  file=sys.stderr)
            if s.process_id != last.process_id:  # a new process: the old one's counters are not in the new view
                self.gone.append(last)
        self.last = s

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in [*self.gone, self.last]:
            for k, v in s.counters.items():
                out[k] = out.get(k, 0) + v
        if self.restarts:
            out["router_restarts"] = self.restarts
        return out

    def kv_stats(self) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        for s in [*self.gone, self.last]:
            for wid, counts in s.kv_stats.items():
                mine = out.setdefault(wid, {})
                for k, v in counts.items():
                    mine[k] = mine.get(k, 0) + v
        return out

    def worker_events(self) -> list[dict[str, Any]]:
        return [e for s in [*self.gone, self.last] for e in s.worker_events]


class _Since:
    """The router's clock as seen from the load generator: ns since the run started (t0)."""

    is_virtual = False

    def __init__(self, t0: int, router_now: int) -> None:
        self._offset = time.monotonic_ns() - (router_now - t0)

    def now_ns(self) -> int:
        return time.monotonic_ns() - self._offset


def _shift(rec: RequestRecord, t0: int) -> RequestRecord:
    def s(v: int | None) -> int | None:
        return None if v is None else v - t0

    return msgspec.structs.replace(
        rec, arrival_ns=rec.arrival_ns - t0, queued_ns=s(rec.queued_ns), routed_ns=s(rec.routed_ns),
        dispatch_ns=s(rec.dispatch_ns), admitted_ns=s(rec.admitted_ns),
        first_token_ns=s(rec.first_token_ns), token_times_ns=[t - t0 for t in rec.token_times_ns],
        completion_ns=s(rec.completion_ns),
    )


def _failures(records: list[RequestRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if r.failure:
            key = r.failure.split(":")[0]
            out[key] = out.get(key, 0) + 1
    return out


def loadgen_main(scenario: Scenario, router: str, outdir: Path, expect_workers: int | None = None,
                 apply_chaos: bool = False, router_pid: int | None = None) -> dict[str, Any]:
    """``loadgen_report``'s summary."""
    return loadgen_report(scenario, router, outdir, expect_workers, apply_chaos, router_pid)[0]


def loadgen_report(scenario: Scenario, router: str, outdir: Path, expect_workers: int | None = None,
                   apply_chaos: bool = False, router_pid: int | None = None) -> tuple[dict[str, Any], Path | None]:
    """``kvemu loadgen``: play the scenario's workload against a router process and write the report
    (``apply_chaos``: also play the chaos timeline through the router's control channel; ``router_pid``: the
    router's process on this machine, so that a silent router is told from a gone one). Returns the summary and
    where the report went (``harness.report.save_report``)."""
    return run_live(lambda: _loadgen(scenario, router, outdir, expect_workers, apply_chaos, router_pid))

