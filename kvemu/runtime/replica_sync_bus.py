"""Router replicas' sync batches on an in-memory transport (``router.replica_sync`` in one process).

Each replica's ``SyncOutbox`` opens a batch with its first event; the bus delivers the batch ``delay_ns`` later to
every other replica's ``SyncInbox``, in replica order, and tells that replica's lifecycle when load left a rank
(a queued request may now fit), as Dynamo's receiver wakes its queue. Batches of one replica arrive in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvemu.clock import NS_PER_S, Clock
from kvemu.errors import InvalidArgument
from kvemu.replica_sync import SyncBatch, SyncInbox, SyncOutbox, attach_core, frees_load
from kvemu.routing_core import RoutingCore

__all__ = ["MemorySyncBus"]


class MemorySyncBus:
    """Connects the router replicas of one pool: every replica hears every other's bookings, ``delay_ns`` late."""

    def __init__(self, clock: Clock, delay_ns: int, predictions: bool = False) -> None:
        if delay_ns < 0:
            raise InvalidArgument(f"replica sync delay must be >= 0 ns, got {delay_ns}", field="delay_ms")
        self.clock = clock
        self.delay_ns = delay_ns
        self.predictions = predictions
        """Bookings carry the prompt's hashes into peers' approximate indexes (``kvemu.replica_sync``)."""
        self.inboxes: dict[int, SyncInbox] = {}
        self.outboxes: dict[int, SyncOutbox] = {}
        self._woken: dict[int, Callable[[], None]] = {}
        self.batches = 0
        """Batches delivered."""

    def attach(self, replica: int, core: RoutingCore, capacity_changed: Callable[[], None]) -> None:
        """Connect a replica's routing core (again: a restarted replica starts with an empty view)."""
        outbox, self.inboxes[replica] = attach_core(replica, core, self.predictions)
        outbox.on_open = lambda: self._schedule(outbox)
        self.outboxes[replica] = outbox
        self._woken[replica] = capacity_changed

    def _schedule(self, outbox: SyncOutbox) -> None:
        loop = asyncio.get_running_loop()
        loop.call_at(loop.time() + self.delay_ns / NS_PER_S, self._deliver, outbox)

    def _deliver(self, outbox: SyncOutbox) -> None:
        batch = outbox.take()
        if batch is None or self.outboxes.get(outbox.origin) is not outbox:
            return  # (a replica that restarted meanwhile: its unsent batch died with it)
        self.batches += 1
        self.deliver(batch)

    def deliver(self, batch: SyncBatch) -> None:
        """Apply one batch at every replica but its origin, now."""
        now = self.clock.now_ns()
        frees = frees_load(batch)
        for i in sorted(self.inboxes):
            if i == batch.origin:
                continue
            self.inboxes[i].apply(batch, now)
            if frees:
                self._woken[i]()
