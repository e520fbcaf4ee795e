"""Transports between the router and its workers: in-memory (virtual or live) and ZeroMQ (live).

The router end receives ``(peer, bytes)`` from every worker and sends to one peer; a worker end sends
and receives bytes. Both carry the msgspec-encoded messages of ``kvemu.runtime.messages``, so actors
cannot tell the transports apart. In-memory delivery may be delayed by a fixed latency; messages on
one link keep their order.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Protocol

import anyio
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvemu.clock import NS_PER_S
from kvemu.errors import InvalidArgument

__all__ = ["RouterEnd", "WorkerEnd", "MemoryNetwork", "ZmqRouterEnd", "ZmqWorkerEnd", "peer_id", "message_socket"]


def peer_id(worker_id: int) -> bytes:
    """The transport identity of a worker."""
    return str(worker_id).encode()


class RouterEnd(Protocol):
    """The router's side: one inbox for every worker, one send per peer."""

    async def receive(self) -> tuple[bytes, bytes]: ...

    def send_nowait(self, peer: bytes, data: bytes) -> None:
        """Queue a message for one worker; never blocks (messages to a vanished peer are dropped)."""
        ...

    async def aclose(self) -> None: ...


class WorkerEnd(Protocol):
    """A worker's side of its link to the router."""

    async def receive(self) -> bytes: ...

    def send_nowait(self, data: bytes) -> None:
        """Queue a message for the router; never blocks."""
        ...

    async def aclose(self) -> None: ...


class _Delay:
    """Deliver into a stream after a fixed delay, preserving order (loop timers fire FIFO)."""

    __slots__ = ("delay_s",)

    def __init__(self, latency_ns: int) -> None:
        self.delay_s = latency_ns / NS_PER_S

    def put(self, stream: MemoryObjectSendStream, item: object) -> None:
        if not self.delay_s:
            stream.send_nowait(item)
            return
        asyncio.get_running_loop().call_later(self.delay_s, _deliver, stream, item)


def _deliver(stream: MemoryObjectSendStream, item: object) -> None:
    try:
        stream.send_nowait(item)
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        pass  # the receiver is gone (a removed worker): the message is dropped, as on a network


class _MemoryRouterEnd:
    def __init__(self, net: MemoryNetwork) -> None:
        self._net = net

    async def receive(self) -> tuple[bytes, bytes]:
        return await self._net._router_rx.receive()

    def send_nowait(self, peer: bytes, data: bytes) -> None:
        tx = self._net._worker_tx.get(peer)
        if tx is not None:
            self._net._delay.put(tx, data)

    async def aclose(self) -> None:
        await self._net._router_rx.aclose()


class _MemoryWorkerEnd:
    def __init__(self, net: MemoryNetwork, peer: bytes, rx: MemoryObjectReceiveStream) -> None:
        self._net = net
        self._peer = peer
        self._rx = rx

    async def receive(self) -> bytes:
        return await self._rx.receive()

    def send_nowait(self, data: bytes) -> None:
        self._net._delay.put(self._net._router_tx, (self._peer, data))

    async def aclose(self) -> None:
        self._net._worker_tx.pop(self._peer, None)
        await self._rx.aclose()


class MemoryNetwork:
    """In-process links with an optional one-way latency; works on wall and on virtual time."""

    def __init__(self, latency_ns: int = 0) -> None:
        if latency_ns < 0:
            raise InvalidArgument(f"latency_ns must be >= 0, got {latency_ns}")
        self._delay = _Delay(latency_ns)
        self._router_tx, self._router_rx = anyio.create_memory_object_stream[tuple[bytes, bytes]](math.inf)
        self._worker_tx: dict[bytes, MemoryObjectSendStream] = {}

    def router_end(self) -> RouterEnd:
        """The router's end (one per network)."""
        return _MemoryRouterEnd(self)

    def worker_end(self, worker_id: int) -> WorkerEnd:
        """A new worker's end; its identity is ``peer_id(worker_id)``."""
        peer = peer_id(worker_id)
        tx, rx = anyio.create_memory_object_stream[bytes](math.inf)
        self._worker_tx[peer] = tx
        return _MemoryWorkerEnd(self, peer, rx)


def message_socket(kind: int, context: zmq.asyncio.Context | None = None) -> zmq.asyncio.Socket:
    """An asyncio ZeroMQ socket for actor messages: no linger, unbounded queues (nothing is dropped)."""
    sock = (context or zmq.asyncio.Context.instance()).socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises instead of vanishing
    return sock


def _ignore_unroutable(fut: object) -> None:
    if not fut.cancelled():  # type: ignore[attr-defined]
        exc = fut.exception()  # type: ignore[attr-defined]
        if exc is not None and not isinstance(exc, zmq.ZMQError):
            raise exc  # pragma: no cover - only ZMQ errors (peer gone) are expected


class ZmqRouterEnd:
    """The router's end on a ROUTER socket (bound); workers connect DEALERs with their identity."""

    def __init__(self, endpoint: str, context: zmq.asyncio.Context | None = None) -> None:
        sock = message_socket(zmq.ROUTER, context)
        sock.bind(endpoint)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock

    async def receive(self) -> tuple[bytes, bytes]:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) == 2:
                return frames[0], frames[1]

    def send_nowait(self, peer: bytes, data: bytes) -> None:
        # zmq.asyncio sends at once when the socket can take it and otherwise queues in order
        fut = self._sock.send_multipart([peer, data])
        fut.add_done_callback(_ignore_unroutable)

    async def aclose(self) -> None:
        self._sock.close(linger=0)


class ZmqWorkerEnd:
    """A worker's DEALER connected to the router."""

    def __init__(self, endpoint: str, worker_id: int, context: zmq.asyncio.Context | None = None) -> None:
        sock = message_socket(zmq.DEALER, context)
        # unique per connection: a second worker claiming the same id is refused by the router, not lost
        sock.setsockopt(zmq.IDENTITY, peer_id(worker_id) + b"-" + uuid.uuid4().hex[:12].encode())
        sock.connect(endpoint)
        self._sock = sock

    async def receive(self) -> bytes:
        return await self._sock.recv()

    def send_nowait(self, data: bytes) -> None:
        self._sock.send(data)

    async def aclose(self) -> None:
        self._sock.close(linger=0)
