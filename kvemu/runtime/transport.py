"""Transports between the router and its workers: in-memory (virtual or live) and ZeroMQ (live).

Actors hand a transport message *objects* (``kvemu.messages``) and are handed message
objects: each end's ``serve(handler)`` calls the actor's synchronous handler once per message, in
the order the link delivered them. ZeroMQ ends encode to msgpack bytes and decode (dropping what is
undecodable, with a log line). In-memory links schedule the receiver's handler directly at the
delivery instant with the object itself, after an optional fixed one-way latency; with
``wire_check=True`` every message is encoded and decoded on the way, exactly as ZeroMQ would carry it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import msgspec
import zmq
import zmq.asyncio

from kvemu.clock import NS_PER_S
from kvemu.errors import InvalidArgument
from kvemu.messages import (Register, RegisterAck, RouterMessage, WorkerMessage, decode_router_message,
                            decode_worker_message, encode)
from kvemu.wire import limits, security

__all__ = [
    "RouterEnd",
    "WorkerEnd",
    "RouterHandler",
    "WorkerHandler",
    "MemoryNetwork",
    "ZmqRouterEnd",
    "ZmqWorkerEnd",
    "NoRouterEnd",
    "peer_id",
    "message_socket",
    "decode_or_log",
]

log = logging.getLogger("kvemu.transport")

RouterHandler = Callable[[bytes, WorkerMessage], None]
"""The router actor's handler: ``handler(peer, message)``."""
WorkerHandler = Callable[[RouterMessage], None]
"""A worker actor's handler: ``handler(message)``."""


def peer_id(worker_id: int) -> bytes:
    """The transport identity of a worker."""
    return str(worker_id).encode()


def decode_or_log(decode: Callable[[bytes], Any], data: bytes, source: object) -> Any:
    """``decode(data)``, or ``None`` (logged) when the bytes are not a valid message."""
    try:
        return decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("undecodable message from %r: %s", source, exc)
        return None


class RouterEnd(Protocol):
    """The router's side: one handler for every worker's messages, one send per peer."""

    async def serve(self, handler: RouterHandler) -> None:
        """Call ``handler`` for every message until the end is closed (or the caller is cancelled)."""
        ...

    def send_nowait(self, peer: bytes, msg: msgspec.Struct) -> None:
        """Queue a message for one worker; never blocks (messages to a vanished peer are dropped)."""
        ...

    async def aclose(self) -> None: ...


class WorkerEnd(Protocol):
    """A worker's side of its link to the router."""

    async def serve(self, handler: WorkerHandler) -> None:
        """Call ``handler`` for every message from the router until closed (or cancelled)."""
        ...

    def send_nowait(self, msg: msgspec.Struct) -> None:
        """Queue a message for the router; never blocks."""
        ...

    async def aclose(self) -> None: ...


class NoRouterEnd:
    """A worker's end when no kvemu router is in front of it (``kvemu fleet``: another router, or clients,
    reach its HTTP server): its registration is accepted at once, and what else it says (heartbeats, its
    requests' ends) has no one to go to."""

    def __init__(self) -> None:
        self._handler: WorkerHandler | None = None
        self._unanswered: list[RegisterAck] = []
        self._closed = anyio.Event()

    async def serve(self, handler: WorkerHandler) -> None:
        """Answer the registration, then wait until closed."""
        self._handler = handler
        while self._unanswered:
            handler(self._unanswered.pop(0))
        await self._closed.wait()

    def send_nowait(self, msg: msgspec.Struct) -> None:
        """A registration is accepted (once ``serve`` runs); anything else is dropped."""
        if type(msg) is Register:
            ack = RegisterAck(worker_id=msg.worker_id, accepted=True)
            if self._handler is None:
                self._unanswered.append(ack)
            else:
                self._handler(ack)

    async def aclose(self) -> None:
        self._closed.set()


# ------------------------------------------------------------------------------------- in memory


class _Inbox:
    """Where one receiver's messages are delivered: its handler once it serves, a backlog before.

    A handler that raises ends the receiver's ``serve`` with that exception (as a receive loop would),
    and the inbox takes no more messages.
    """

    __slots__ = ("handler", "backlog", "closed", "error", "loop", "_wake")

    def __init__(self) -> None:
        self.handler: Callable[..., None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        """The loop ``serve`` runs on, while it runs: senders schedule deliveries on it without asking for the
        running loop (``asyncio.get_running_loop`` makes a ``getpid`` system call per message)."""
        self.backlog: list[tuple] = []
        self.closed = False
        self.error: BaseException | None = None
        self._wake: anyio.Event | None = None

    def deliver(self, *args: Any) -> None:
        if self.closed or self.error is not None:
            return  # the receiver is gone: dropped, as on a network
        handler = self.handler
        if handler is None:
            self.backlog.append(args)
            return
        try:
            handler(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised by serve() in the receiver's task
            self.error = exc
            if self._wake is not None:
                self._wake.set()

    async def serve(self, handler: Callable[..., None]) -> None:
        if self.closed:
            return
        self.handler = handler
        self.loop = asyncio.get_running_loop()
        self._wake = wake = anyio.Event()
        backlog, self.backlog = self.backlog, []
        for args in backlog:
            self.deliver(*args)
        try:
            await wake.wait()
        finally:
            self.handler = self.loop = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def close(self) -> None:
        self.closed = True
        self.backlog.clear()
        if self._wake is not None:
            self._wake.set()


class _Link:
    """One direction of in-memory delivery: at once (next loop turn) or after a fixed latency, in order."""

    __slots__ = ("delay_s", "wire_check", "decode")

    def __init__(self, latency_ns: int, wire_check: bool, decode: Callable[[bytes], Any]) -> None:
        self.delay_s = latency_ns / NS_PER_S
        self.wire_check = wire_check
        self.decode = decode

    def put(self, inbox: _Inbox, *args: Any) -> None:
        if self.wire_check:  # what ZeroMQ would carry: the message must survive its own encoding
            *head, msg = args
            msg = decode_or_log(self.decode, encode(msg), "in-memory link")
            if msg is None:
                return
            args = (*head, msg)
        loop = inbox.loop or asyncio.get_running_loop()
        if self.delay_s:
            loop.call_later(self.delay_s, inbox.deliver, *args)
        else:
            loop.call_soon(inbox.deliver, *args)


class _MemoryRouterEnd:
    def __init__(self, net: MemoryNetwork) -> None:
        self._net = net

    async def serve(self, handler: RouterHandler) -> None:
        await self._net._router_inbox.serve(handler)

    def send_nowait(self, peer: bytes, msg: msgspec.Struct) -> None:
        inbox = self._net._worker_inboxes.get(peer)
        if inbox is not None:
            self._net._to_worker.put(inbox, msg)

    async def aclose(self) -> None:
        self._net._router_inbox.close()


class _MemoryWorkerEnd:
    def __init__(self, net: MemoryNetwork, peer: bytes, inbox: _Inbox) -> None:
        self._net = net
        self._peer = peer
        self._inbox = inbox

    async def serve(self, handler: WorkerHandler) -> None:
        await self._inbox.serve(handler)

    def send_nowait(self, msg: msgspec.Struct) -> None:
        self._net._to_router.put(self._net._router_inbox, self._peer, msg)

    async def aclose(self) -> None:
        if self._net._worker_inboxes.get(self._peer) is self._inbox:
            del self._net._worker_inboxes[self._peer]
        self._inbox.close()


class MemoryNetwork:
    """In-process links with an optional one-way latency; works on wall and on virtual time.

    Messages travel as objects; ``wire_check=True`` encodes and decodes each one on the way.
    """

    def __init__(self, latency_ns: int = 0, *, wire_check: bool = False) -> None:
        if latency_ns < 0:
            raise InvalidArgument(f"latency_ns must be >= 0, got {latency_ns}", field="latency_ns")
        self.wire_check = wire_check
        self._to_router = _Link(latency_ns, wire_check, decode_worker_message)
        self._to_worker = _Link(latency_ns, wire_check, decode_router_message)
        self._router_inbox = _Inbox()
        self._worker_inboxes: dict[bytes, _Inbox] = {}

    def router_end(self) -> RouterEnd:
        """The router's end (one per network; a restarted router serves the same end)."""
        return _MemoryRouterEnd(self)

    def worker_end(self, worker_id: int) -> WorkerEnd:
        """A new worker's end; its identity is ``peer_id(worker_id)``."""
        peer = peer_id(worker_id)
        inbox = self._worker_inboxes[peer] = _Inbox()
        return _MemoryWorkerEnd(self, peer, inbox)


# ------------------------------------------------------------------------------------- ZeroMQ


def message_socket(kind: int, context: zmq.asyncio.Context | None = None) -> zmq.asyncio.Socket:
    """An asyncio ZeroMQ socket for actor messages: no linger, unbounded queues (nothing is dropped), messages
    bounded in size (``kvemu.wire.limits``)."""
    sock = (context or zmq.asyncio.Context.instance()).socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    limits.limit_inbound(sock, limits.MAX_MESSAGE_BYTES)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises instead of vanishing
    return sock


def _ignore_unroutable(fut: object) -> None:
    if not fut.cancelled():  # type: ignore[attr-defined]
        exc = fut.exception()  # type: ignore[attr-defined]
        if exc is not None and not isinstance(exc, zmq.ZMQError):
            raise exc  # pragma: no cover - only ZMQ errors (peer gone) are expected


class _Outbox:
    """Messages sent during one turn of the loop, by destination, leaving as one multipart message each at the
    end of the turn: one send (and one wake-up of ZeroMQ's I/O thread) for however many messages a turn made.
    Each frame is one message; order is kept per destination."""

    __slots__ = ("_send", "_queued", "_scheduled")

    def __init__(self, send: Callable[[bytes | None, list[bytes]], object]) -> None:
        self._send = send
        self._queued: dict[bytes | None, list[bytes]] = {}
        self._scheduled = False

    def put(self, to: bytes | None, data: bytes) -> None:
        frames = self._queued.get(to)
        if frames is None:
            self._queued[to] = [data]
        else:
            frames.append(data)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        queued, self._queued = self._queued, {}
        for to, frames in queued.items():
            self._send(to, frames)


class ZmqRouterEnd:
    """The router's end on a ROUTER socket (bound); workers connect DEALERs with their identity.

    A worker's multipart message ``[identity, m1, m2, ...]`` carries one actor message per frame (what its
    end sent in one loop turn); messages to a worker leave the same way.
    """

    def __init__(self, endpoint: str, context: zmq.asyncio.Context | None = None) -> None:
        sock = message_socket(zmq.ROUTER, context)
        self.endpoint = security.bind_securely(sock, endpoint)
        self._sock = sock
        self._outbox = _Outbox(self._send_frames)

    async def receive(self) -> tuple[bytes, list[bytes]]:
        """The next ``(peer, payloads)`` of a worker."""
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) >= 2:
                return frames[0], frames[1:]

    async def serve(self, handler: RouterHandler) -> None:
        while True:
            try:
                peer, payloads = await self.receive()
            except zmq.ZMQError:
                return  # the socket was closed
            for data in payloads:
                msg = decode_or_log(decode_worker_message, data, peer)
                if msg is not None:
                    handler(peer, msg)

    def send_nowait(self, peer: bytes, msg: msgspec.Struct) -> None:
        self._outbox.put(peer, encode(msg))

    def _send_frames(self, peer: bytes | None, frames: list[bytes]) -> None:
        # zmq.asyncio sends at once when the socket can take it and otherwise queues in order
        fut = self._sock.send_multipart([peer, *frames])
        # zmq.asyncio returns an asyncio Future; pyzmq annotates it as a bare Awaitable
        fut.add_done_callback(_ignore_unroutable)  # type: ignore[attr-defined]

    async def aclose(self) -> None:
        self._outbox.flush()
        self._sock.close(linger=0)


class ZmqWorkerEnd:
    """A worker's DEALER connected to the router (messages of one loop turn leave as one multipart message)."""

    def __init__(self, endpoint: str, worker_id: int, context: zmq.asyncio.Context | None = None) -> None:
        sock = message_socket(zmq.DEALER, context)
        # unique per connection: a second worker claiming the same id is refused by the router, not lost
        sock.setsockopt(zmq.IDENTITY, peer_id(worker_id) + b"-" + uuid.uuid4().hex[:12].encode())
        security.connect_securely(sock)
        sock.connect(endpoint)
        self._sock = sock
        self._outbox = _Outbox(lambda _to, frames: self._sock.send_multipart(frames))

    async def serve(self, handler: WorkerHandler) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except zmq.ZMQError:
                return  # the socket was closed
            for data in frames:
                msg = decode_or_log(decode_router_message, data, "router")
                if msg is not None:
                    handler(msg)

    def send_nowait(self, msg: msgspec.Struct) -> None:
        self._outbox.put(None, encode(msg))

    async def aclose(self) -> None:
        self._outbox.flush()
        self._sock.close(linger=0)
