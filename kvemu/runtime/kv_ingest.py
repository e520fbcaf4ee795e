"""The router's KV-event intake: every rank's stream into the routing core's index, in one place.

Batches arrive either on an in-memory transport (``intake``: a ``KvBatch`` message or the ``MemoryKvBus``)
or, live, on the ZeroMQ endpoints a worker announces when it registers (``KvEventSubscriber``, pumped by
``run``). Either way one ``EventStream`` per rank orders them, detects gaps, replays and converts, and
the events of registered workers reach ``RoutingCore.apply_event``. Counters per worker stay after the
worker is gone (the report reads them).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from kvemu.router_events import RouterEvent
from kvemu.routing_core import RoutingCore
from kvemu.messages import Register
from kvemu.wire.stream import EventStream, Payload, Replay, StreamObserver, WorkerEventStats
from kvemu.wire.subscriber import KvEventSubscriber, StreamSpec

__all__ = ["KvIngest"]

"""Told ``(kind, worker_id, dp_rank, details)`` for ``gap``, ``replay``, ``lost`` and ``restart``."""


class KvIngest:
    """Streams of the registered workers' ranks, feeding one routing core."""

    def __init__(self, core: RoutingCore, *, observer: StreamObserver | None = None, replay_on_connect: bool = True,
                 replay: Callable[[int, int], Replay | None] | None = None, zmq: bool = False,
                 max_ranks: int | None = None, replay_timeout_s: float = 2.0) -> None:
        self.core = core
        self.observer = observer
        self.replay_on_connect = replay_on_connect
        self._replay = replay
        self.streams: dict[tuple[int, int], EventStream] = {}
        self.stats: dict[int, WorkerEventStats] = {}
        """Per worker id, for every worker ever registered."""
        self.subscriber: KvEventSubscriber | None = None
        """With ``zmq``: subscribes to the endpoints workers announce when they register."""
        if zmq:
            self.subscriber = KvEventSubscriber(self._apply, block_size=core.block_size, observer=observer,
                                                replay_on_connect=replay_on_connect, max_streams=max_ranks,
                                                replay_timeout_s=replay_timeout_s)
            self.subscriber.stats = self.stats

    def add_worker(self, msg: Register) -> None:
        """Open the streams of a newly registered worker's ranks and rebuild its cache from their replays."""
        wid = msg.worker_id
        stats = self.stats.setdefault(wid, WorkerEventStats())
        ranks = range(msg.dp_start, msg.dp_start + msg.dp_size)
        groups = list(msg.kv_groups)  # (kind, window) per group_idx: for events that name no kind (vLLM 0.20/0.21)
        for rank in ranks:
            replay = self._replay(wid, rank) if self._replay else None
            self.streams[(wid, rank)] = EventStream(
                wid, rank, sink=self._apply, block_size=self.core.block_size, stats=stats, replay=replay,
                replay_on_connect=self.replay_on_connect, observer=self.observer, groups=groups or None,
            )
        if self.replay_on_connect:
            for rank in ranks:
                self.streams[(wid, rank)].sync()
        if self.subscriber is not None:
            for r, endpoint in enumerate(msg.kv_endpoints):
                replay_endpoint = msg.kv_replay_endpoints[r] if r < len(msg.kv_replay_endpoints) else ""
                self.subscriber.add(StreamSpec(wid, msg.dp_start + r, endpoint, replay_endpoint or None,
                                               tuple(groups)))

    def streams_left(self) -> int | None:
        """How many more ranks' ZeroMQ streams can be opened (None: no bound, or no ZeroMQ)."""
        return None if self.subscriber is None else self.subscriber.streams_left()

    def remove_worker(self, worker_id: int) -> None:
        """Close a removed worker's streams; its later batches are ignored."""
        for key in [k for k in self.streams if k[0] == worker_id]:
            del self.streams[key]
        if self.subscriber is not None:
            self.subscriber.remove_worker(worker_id)

    def intake(self, worker_id: int, dp_rank: int, seq: int, payload: Payload) -> None:
        """One batch from an in-memory transport (unknown ranks are ignored)."""
        stream = self.streams.get((worker_id, dp_rank))
        if stream is not None:
            stream.receive(seq, payload)

    def _apply(self, event: RouterEvent) -> None:
        if event.worker_id in self.core.registry:  # a removed worker's late events change nothing
            self.core.apply_event(event)

    def take_in_arrived(self) -> int:
        """Apply every batch already waiting on the sockets, now (the ``run`` loop takes them in between other
        tasks, so a busy router's view lags what arrived); returns the live batches handled."""
        return 0 if self.subscriber is None else self.subscriber.poll(0)

    async def run(self) -> None:
        """Feed ZeroMQ batches into the index until cancelled (returns at once without a subscriber)."""
        subscriber = self.subscriber
        if subscriber is None:
            return
        idle = 0.0
        try:
            while True:  # poll without blocking the loop; back off while idle
                if subscriber.poll(0):
                    idle = 0.0
                    await anyio.sleep(0)
                else:
                    idle = min(0.002, idle + 0.0002)
                    await anyio.sleep(idle)
        finally:
            subscriber.close()
