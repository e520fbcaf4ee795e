"""Router replicas' sync batches over ZeroMQ (``router.replica_sync`` between router processes).

Each replica binds one PUB for its own batches and SUBscribes to every peer's PUB, one socket per peer. Its
``SyncOutbox`` opens a batch with its first event; the batch leaves ``delay_ns`` later, msgpack-encoded (split into
messages within the wire's bounds). A received message is decoded with the bounded ``SyncBatch`` type and applied
only if its ``origin`` is the peer its socket belongs to; others, malformed and oversize ones are counted and
dropped. Applying a batch that took load off a rank wakes the replica's lifecycle (a queued request may now fit).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import zmq
import zmq.asyncio

from kvemu.clock import NS_PER_S, Clock
from kvemu.errors import InvalidArgument
from kvemu.replica_sync import MAX_SYNC_BATCH_EVENTS, SyncBatch, SyncInbox, SyncOutbox, attach_core, frees_load
from kvemu.runtime.transport import message_socket
from kvemu.wire import limits, security

__all__ = ["ZmqSyncLink", "wire_messages", "MAX_SYNC_MESSAGE_BYTES"]

MAX_SYNC_MESSAGE_BYTES = limits.MAX_MESSAGE_BYTES
"""Largest sync message sent or accepted (a bigger batch leaves split; a bigger message is dropped)."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SyncBatch)
_INBOX_COUNTS = ("applied", "ignored", "refused", "expired")


def wire_messages(batch: SyncBatch, max_bytes: int = MAX_SYNC_MESSAGE_BYTES) -> tuple[list[bytes], int]:
    """``batch`` as encoded messages in order, each at most ``MAX_SYNC_BATCH_EVENTS`` events and ``max_bytes``
    long; and how many events were left out (one event too large to send alone)."""
    out: list[bytes] = []
    left_out = 0

    def emit(events: list[Any]) -> None:
        nonlocal left_out
        data = _encoder.encode(SyncBatch(batch.origin, events))
        if len(data) <= max_bytes:
            out.append(data)
        elif len(events) == 1:
            left_out += 1
        else:
            mid = len(events) // 2
            emit(events[:mid])
            emit(events[mid:])

    events = batch.events
    for i in range(0, len(events), MAX_SYNC_BATCH_EVENTS):
        emit(events[i:i + MAX_SYNC_BATCH_EVENTS])
    return out, left_out


class ZmqSyncLink:
    """One router replica's sync: its PUB (``endpoint``), a SUB per peer, its outbox and inbox."""

    def __init__(self, replica: int, clock: Clock, delay_ns: int, predictions: bool = False,
                 listen: str = "tcp://127.0.0.1:0", context: zmq.asyncio.Context | None = None,
                 max_bytes: int = MAX_SYNC_MESSAGE_BYTES) -> None:
        if delay_ns < 0:
            raise InvalidArgument(f"replica sync delay must be >= 0 ns, got {delay_ns}", field="delay_ms")
        self.replica = replica
        self.clock = clock
        self.delay_ns = delay_ns
        self.predictions = predictions
        self.max_bytes = max_bytes
        self._context = context
        pub = message_socket(zmq.PUB, context)
        self.endpoint = security.bind_securely(pub, listen)
        """Where peers subscribe (its real port when bound on port 0)."""
        self._pub = pub
        self._subs: dict[int, zmq.asyncio.Socket] = {}
        self.peers: dict[int, str] = {}
        """Each peer replica's PUB endpoint this link subscribes to."""
        self.outbox: SyncOutbox | None = None
        self.inbox: SyncInbox | None = None
        self._woken: Callable[[], None] = lambda: None
        self._tg: Any = None
        self._earlier = dict.fromkeys(("announced", *_INBOX_COUNTS), 0)  # outboxes and inboxes before a restart
        self.counts = dict.fromkeys(("batches_sent", "messages_sent", "events_unsent", "batches_applied",
                                     "dropped_foreign", "dropped_malformed", "dropped_oversize"), 0)
        """Transport counters: batches and messages sent, events too large to send, batches applied, messages
        dropped (another origin than their socket's peer, undecodable, too large)."""

    def attach(self, core: Any, capacity_changed: Callable[[], None]) -> None:
        """Connect the replica's routing core (again after a restart: its unsent batch dies with the old one)."""
        if self.outbox is not None and self.inbox is not None:
            self._earlier["announced"] += self.outbox.sent
            for k in _INBOX_COUNTS:
                self._earlier[k] += getattr(self.inbox, k)
        outbox, self.inbox = attach_core(self.replica, core, self.predictions)
        outbox.on_open = lambda: self._schedule(outbox)
        self.outbox = outbox
        self._woken = capacity_changed

    def connect(self, peer: int, endpoint: str) -> None:
        """Subscribe to peer replica ``peer``'s batches at ``endpoint`` (again: replaces the earlier socket)."""
        if peer == self.replica:
            raise InvalidArgument(f"replica {peer} is this replica: a replica does not subscribe to itself",
                                  field="replica")
        old = self._subs.pop(peer, None)
        if old is not None:
            old.close(linger=0)
        sock = message_socket(zmq.SUB, self._context)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        security.connect_securely(sock)
        sock.connect(endpoint)
        self._subs[peer] = sock
        self.peers[peer] = endpoint
        if self._tg is not None:
            self._tg.start_soon(self._read, peer, sock)

    def _schedule(self, outbox: SyncOutbox) -> None:
        loop = asyncio.get_running_loop()
        loop.call_at(loop.time() + self.delay_ns / NS_PER_S, self._flush, outbox)

    def _flush(self, outbox: SyncOutbox) -> None:
        batch = outbox.take()
        if batch is None or outbox is not self.outbox:
            return
        messages, left_out = wire_messages(batch, self.max_bytes)
        self.counts["batches_sent"] += 1
        self.counts["messages_sent"] += len(messages)
        self.counts["events_unsent"] += left_out
        for data in messages:
            self._pub.send(data).add_done_callback(_quiet)  # type: ignore[attr-defined]

    def receive(self, peer: int, data: bytes) -> bool:
        """One message from peer ``peer``'s socket: applied now if it is a well-formed batch of that peer
        (True), else counted and dropped."""
        if len(data) > self.max_bytes:
            self.counts["dropped_oversize"] += 1
            return False
        try:
            batch = _decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.counts["dropped_malformed"] += 1
            return False
        if batch.origin != peer or peer == self.replica:
            self.counts["dropped_foreign"] += 1
            return False
        if self.inbox is None:
            return False
        self.inbox.apply(batch, self.clock.now_ns())
        self.counts["batches_applied"] += 1
        if frees_load(batch):
            self._woken()
        return True

    async def _read(self, peer: int, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
            except zmq.ZMQError:
                return  # the socket was closed (replaced, or the link closed)
            if len(frames) != 1:
                self.counts["dropped_malformed"] += 1
                continue
            self.receive(peer, frames[0])

    async def serve(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Read every peer's batches (peers connected later included) until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for peer, sock in self._subs.items():
                tg.start_soon(self._read, peer, sock)
            task_status.started()
            await anyio.sleep_forever()

    def stats(self) -> dict[str, int]:
        """What this replica announced and applied over the run (every attachment), and the transport's counts."""
        out = dict(self._earlier)
        if self.outbox is not None and self.inbox is not None:
            out["announced"] += self.outbox.sent
            for k in _INBOX_COUNTS:
                out[k] += getattr(self.inbox, k)
        return {**out, **self.counts}

    async def aclose(self) -> None:
        self._tg = None
        for sock in self._subs.values():
            sock.close(linger=0)
        self._subs.clear()
        self._pub.close(linger=0)


def _quiet(fut: Any) -> None:
    if not fut.cancelled():
        fut.exception()  # (a closed socket at shutdown: nothing to do)
