"""The backend of ``kvemu front`` (``harness.procs.replica_door``): router replicas as processes, one link each.

Each request goes to the replica ``router.replica_front`` picks (the same rule and seed as in one process and in the
load generator), its cancel to the same one, and its tokens stream back from there (``StreamTokens``, the first
message of every connection: a router streams to a connection, so a reconnected or restarted router is asked
again).

A router whose connection drops (its process died) or that has not answered for ``lost_after_s`` is lost: its
open requests fail with ``router_lost`` (an SSE error event naming the reason), and until it answers again the
requests ``router.replica_front`` gives it go to the next live replica round the ring (as a consistent-hash ring
hands a dead node's keys to its successor: deterministic, and a session's turns stay together). ``/health`` is
503 until every replica has had workers once, then only while no replica can take a request.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NamedTuple

import anyio
import anyio.abc
import msgspec
import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from zmq.utils.monitor import parse_monitor_message

from kvemu.clock import Clock
from kvemu.http.backend import OnEnd, OnTokens
from kvemu.messages import ClientRequest, encode
from kvemu.records import RequestRecord
from kvemu.replica_front import ReplicaFront
from kvemu.runtime.transport import message_socket
from kvemu.wire import security

from harness.procs.protocol import (CLIENT, CancelRequest, RecordReply, Stats, StatsQuery, StreamTokens, TokensReply,
                                    never_ran_record, reply_decoder)

__all__ = ["RouterLink", "RouterProcesses", "ReplicaCollector", "PING_S", "LOST_AFTER_S"]


PING_S = 1.0
"""How often the front door asks each router for its view (workers registered; that it still answers)."""
LOST_AFTER_S = 10.0
"""A router silent this long is lost (one whose process died is lost at once: its connection drops)."""
MAX_QUEUED = 4096
"""Messages one router's socket may have waiting to be written; a request past that fails at once."""


class _Open(NamedTuple):
    """A request sent to a router and not ended yet, with the callbacks its tokens and record go to."""

    req: ClientRequest
    on_tokens: OnTokens
    on_end: OnEnd


class RouterLink:
    """One router process as the front door reaches it: a DEALER of its own, so that only that router's tokens,
    records and views come back on it (another router cannot end this one's requests)."""

    def __init__(self, replica: int, endpoint: str, clock: Clock, lost_after_s: float = LOST_AFTER_S,
                 ping_s: float = PING_S) -> None:
        self.replica = replica
        self.endpoint = endpoint
        self._clock = clock
        self._ping_s = ping_s
        self._lost_after_ns = int(lost_after_s * 1e9)
        self.open: dict[str, _Open] = {}
        """Requests sent and not ended, by id."""
        self._cancelled: set[str] = set()
        """Request ids cancelled here whose records the router has not sent back yet (the id is still in use there)."""
        self.heard_ns = clock.now_ns()
        self.workers = 0
        """Workers registered with the router, as its last view said."""
        self.lost: str | None = None
        """Why the router is considered gone, or None."""
        self.sent = 0
        self.unmatched = 0
        """Replies for no open request of this link (cancelled or failed here before the router answered)."""
        self.malformed = 0
        self.rerouted = 0
        """Requests sent here because the replica the front picked for them was not live."""
        self.dropped = 0
        """Connections to the router that dropped (its process died or restarted)."""
        self._tx, self._rx = anyio.create_memory_object_stream[bytes](MAX_QUEUED)

    @property
    def live(self) -> bool:
        """Whether a request sent here now can run: the router answers and has workers."""
        return self.lost is None and self.workers > 0

    def submit(self, req: ClientRequest, on_tokens: OnTokens, on_end: OnEnd) -> None:
        """Send ``req`` to the router; ``on_end`` gets its record (at once if it cannot be sent)."""
        rid = req.request_id
        if self.lost is not None:
            on_end(never_ran_record(req, self._clock.now_ns(), f"router_lost: {self.lost}"))
            return
        if rid in self._cancelled:
            on_end(never_ran_record(req, self._clock.now_ns(), f"duplicate_request_id: {rid!r} was cancelled and "
                                    f"router replica {self.replica} has not ended it yet"))
            return
        try:
            self._tx.send_nowait(encode(req))
        except anyio.WouldBlock:
            on_end(never_ran_record(req, self._clock.now_ns(), f"front_door_overloaded: {MAX_QUEUED} messages wait "
                                    f"for router replica {self.replica}"))
            return
        self.open[rid] = _Open(req, on_tokens, on_end)
        self.sent += 1

    def cancel(self, request_id: str, reason: str) -> None:
        """End an open request: the router frees it; nothing more is reported for it."""
        if self.open.pop(request_id, None) is None:
            return
        self._cancelled.add(request_id)
        self._queue(encode(CancelRequest(request_id=request_id, reason=reason)))

    async def serve(self, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Ping, and keep a connection to the router until cancelled: a new one each time it drops."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._ping)
            while True:
                await self._connection(task_status)
                task_status = anyio.TASK_STATUS_IGNORED

    async def _connection(self, task_status: anyio.abc.TaskStatus) -> None:
        """One connection: ``StreamTokens`` first (the router streams to a connection, not to this link), then
        write and read until it drops; then its open requests are lost (the router can answer them on this
        connection only) and whatever waited to be written for it is dropped."""
        sock = message_socket(zmq.DEALER)
        security.connect_securely(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        try:
            await sock.send_multipart([CLIENT, encode(StreamTokens())])
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._write, sock)
                tg.start_soon(self._read, sock)
                task_status.started()
                await _dropped(monitor)
                tg.cancel_scope.cancel()
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
        self.dropped += 1
        self.lose(f"router replica {self.replica} at {self.endpoint} closed its connection", connection_gone=True)

    async def _write(self, sock: Any) -> None:
        async for data in self._rx:
            await sock.send_multipart([CLIENT, data])

    async def _read(self, sock: Any) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 2 or frames[0] != CLIENT:
                self.malformed += 1
                continue
            try:
                msg = reply_decoder.decode(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.malformed += 1
                continue
            self.heard_ns = self._clock.now_ns()
            if self.lost is not None:
                print(json.dumps({"event": "router_found", "replica": self.replica, "was": self.lost}), file=sys.stderr)
                self.lost = None
                self._queue(encode(StreamTokens()))  # before any request sent from now on (idempotent there)
            t = type(msg)
            if t is TokensReply:
                opened = self.open.get(msg.request_id)  # type: ignore[union-attr]
                if opened is None:
                    self.unmatched += 1
                else:
                    opened.on_tokens(msg.n)  # type: ignore[union-attr]
            elif t is RecordReply:
                record: RequestRecord = msg.record  # type: ignore[union-attr]
                self._cancelled.discard(record.request_id)
                ended = self.open.pop(record.request_id, None)
                if ended is None:
                    self.unmatched += 1
                else:
                    ended.on_end(record)
            elif t is Stats:
                self.workers = len(msg.workers)  # type: ignore[union-attr]

    async def _ping(self) -> None:
        query = encode(StatsQuery())
        while True:
            self._queue(query)
            await anyio.sleep(self._ping_s)
            silent_ns = self._clock.now_ns() - self.heard_ns
            if self.lost is None and silent_ns > self._lost_after_ns:
                self.lose(f"router replica {self.replica} at {self.endpoint} did not answer for "
                          f"{silent_ns / 1e9:.1f} s")

    def _queue(self, data: bytes) -> None:
        """Write ``data`` to the router after what waits already (dropped when too much waits: a query, a
        cancel whose request the router then runs to its end)."""
        try:
            self._tx.send_nowait(data)
        except anyio.WouldBlock:
            pass

    def lose(self, why: str, connection_gone: bool = False) -> None:
        """The router is gone: fail its open requests with ``router_lost``. A router that is only silent is
        asked to cancel them (it frees them if it comes back); with its connection gone it cannot answer them,
        and what waited to be written for it is dropped."""
        if self.lost is None:
            print(json.dumps({"event": "router_lost", "replica": self.replica, "why": why}), file=sys.stderr)
            self.lost = why
        self.workers = 0
        opened, self.open = self.open, {}
        now = self._clock.now_ns()
        if connection_gone:
            self._cancelled.clear()
            while True:
                try:
                    self._rx.receive_nowait()
                except anyio.WouldBlock:
                    break
        for rid, o in opened.items():
            if not connection_gone:
                self._cancelled.add(rid)
                self._queue(encode(CancelRequest(request_id=rid, reason="router_lost")))
            o.on_end(never_ran_record(o.req, now, f"router_lost: {self.lost}"))


async def _dropped(monitor: Any) -> None:
    """Return once the socket ``monitor`` watches loses an established connection."""
    connected = False
    while True:
        event = parse_monitor_message(await monitor.recv_multipart())["event"]
        if event == zmq.EVENT_CONNECTED:
            connected = True
        elif event == zmq.EVENT_DISCONNECTED and connected:
            return


class RouterProcesses:
    """The front door's backend (``kvemu.http.backend.Backend``): each request goes to the router process
    ``front`` picks; its tokens and record come back from that router alone."""

    def __init__(self, links: list[RouterLink], front: ReplicaFront, clock: Clock, *, max_model_len: int,
                 block_size: int) -> None:
        if len(links) != front.replicas:
            raise ValueError(f"{len(links)} routers for a front of {front.replicas}")
        self.links = links
        self.front = front
        self._clock = clock
        self.max_model_len = max_model_len
        self.block_size = block_size
        self._where: dict[str, RouterLink] = {}
        """Open requests: the router each went to."""
        self._ready = False
        """Every replica has had workers once (``/health`` is 503 before: the stack is starting)."""

    def submit(self, req: ClientRequest, on_tokens: OnTokens, on_end: OnEnd) -> None:
        rid = req.request_id
        where = self._where
        if rid in where:  # the id of an open request: refused here, and nothing of that request is touched
            on_end(never_ran_record(req, self._clock.now_ns(),
                                    f"duplicate_request_id: {rid!r} is in use by a request still open"))
            return
        link = self._live_from(self.front.pick_request(req))
        where[rid] = link

        def ended(record: RequestRecord) -> None:
            if where.get(rid) is link:
                del where[rid]
            on_end(record)

        link.submit(req, on_tokens, ended)

    def cancel(self, request_id: str, reason: str) -> None:
        link = self._where.pop(request_id, None)
        if link is not None:
            link.cancel(request_id, reason)

    def _live_from(self, i: int) -> RouterLink:
        """Replica ``i`` if it is live, else the next live one round the ring; none live: ``i`` (the request then
        fails there with the reason)."""
        n = len(self.links)
        for k in range(n):
            link = self.links[(i + k) % n]
            if link.live:
                link.rerouted += k > 0
                return link
        return self.links[i]

    def unavailable(self) -> str | None:
        if not self._ready:
            self._ready = all(link.live for link in self.links)
        if self._ready and any(link.live for link in self.links):
            return None
        for link in self.links:
            if link.lost is not None:
                return link.lost
        for link in self.links:
            if link.workers == 0:
                return f"no worker is registered with router replica {link.replica}"
        return None

    def shut(self, reason: str) -> None:
        """End every open request with ``reason``, asking each router to free it."""
        now = self._clock.now_ns()
        for link in self.links:
            opened = list(link.open.values())
            for o in opened:
                link.cancel(o.req.request_id, reason)
                o.on_end(never_ran_record(o.req, now, reason))

    async def serve(self, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            for link in self.links:
                await tg.start(link.serve)
            task_status.started()


class ReplicaCollector:
    """The front door's view of each router replica, for ``/metrics``."""

    def __init__(self, backend: RouterProcesses) -> None:
        self._backend = backend

    def collect(self) -> Any:
        sent = CounterMetricFamily("kvemu_front_replica_requests", "Requests the front door sent to each router "
                                   "replica", labels=["replica"])
        opened = GaugeMetricFamily("kvemu_front_replica_open_requests", "Requests open at each router replica",
                                   labels=["replica"])
        up = GaugeMetricFamily("kvemu_front_replica_up", "1 while the router replica answers, 0 once it is lost",
                               labels=["replica"])
        workers = GaugeMetricFamily("kvemu_front_replica_workers", "Workers registered with each router replica",
                                    labels=["replica"])
        rerouted = CounterMetricFamily("kvemu_front_replica_rerouted_requests", "Requests sent to each router replica "
                                       "because the one the front picked was not live", labels=["replica"])
        dropped = CounterMetricFamily("kvemu_front_replica_dropped_connections", "Connections to each router replica "
                                      "that dropped (its process died or restarted)", labels=["replica"])
        for link in self._backend.links:
            label = [str(link.replica)]
            sent.add_metric(label, link.sent)
            opened.add_metric(label, len(link.open))
            up.add_metric(label, 0 if link.lost is not None else 1)
            workers.add_metric(label, link.workers)
            rerouted.add_metric(label, link.rerouted)
            dropped.add_metric(label, link.dropped)
        yield from (sent, opened, up, workers, rerouted, dropped)
