"""KV events on in-memory transports: per-rank sequence numbers, replay buffers and an event lag.

A ``MemoryKvPublisher`` numbers batches like the ZeroMQ publisher, keeps the last ``buffer_steps`` for
replay, and delivers ``(seq, payload)`` to the bus's subscriber; like every publisher it can publish
``lag_ns`` late (the bus's ``lag_ns`` is every new publisher's). The payload is the
engine's batch in the router's model (``EventBatch``: no token ids, no encoding), or, with
``wire_check=True``, the exact bytes of the bus's vLLM version (and block-hash form), as a ZeroMQ publisher
would send them (a ready-made ``KVEventBatch`` always travels as its bytes). Chaos can drop deliveries (they stay
replayable) or change the lag.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

from kvemu.clock import NS_PER_S
from kvemu.errors import InvalidArgument
from kvemu.router_events import EngineEvents
from kvemu.wire.codec import STORED_FIELDS, profile_for
from kvemu.kv_events import KVEventBatch
from kvemu.wire.publisher import PublisherStats
from kvemu.wire.replay_log import LoggedPublisher, ReplayLog, wire_payload
from kvemu.wire.vllm_hashes import vllm_hashes
from kvemu.wire.stream import Payload

__all__ = ["MemoryKvBus", "MemoryKvPublisher", "FeedTap", "into_stream"]

Deliver = Callable[[int, int, int, Payload], None]
"""``deliver(worker_id, dp_rank, seq, payload)``: the router's intake."""


class MemoryKvPublisher(LoggedPublisher[Payload]):
    """One rank's publisher on a ``MemoryKvBus`` (same interface as ``KvEventPublisher.publish``)."""

    def __init__(self, bus: MemoryKvBus, worker_id: int, dp_rank: int, vllm_version: str, buffer_steps: int,
                 hash_form: str = "int", block_hashes: str = "kvemu") -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.profile = profile_for(vllm_version, hash_form)
        self._vllm_hashes = vllm_hashes(block_hashes)
        """vLLM's block hashes in its events (then carried as wire bytes: the router reads them as it would a vLLM's)."""
        self._kinds = "kv_cache_spec_kind" in STORED_FIELDS[:self.profile.stored_fields]
        """Its events name each KV cache group's kind (vLLM >= 0.22)."""
        self._log: ReplayLog[Payload] = ReplayLog(buffer_steps)
        self.stats = PublisherStats()
        self.lag_ns = bus.lag_ns

    def _publish_now(self, batch: KVEventBatch | EngineEvents) -> bool:
        """Buffer and deliver one batch; False if it was dropped (still replayable)."""
        payload: Payload
        # (hybrid KV groups on a vLLM version whose events do not name the group's kind: as the bytes say, so the
        # router sees only what that version tells it, as with wire_check)
        if self._vllm_hashes is not None:
            payload = wire_payload(self._vllm_hashes.batch(batch), self.dp_rank, self.profile)
        elif type(batch) is not KVEventBatch and not self.bus.wire_check and not (
                getattr(batch, "groups", None) is not None and not self._kinds):
            payload = batch.router_batch()
        else:
            payload = wire_payload(batch, self.dp_rank, self.profile)
        seq, live = self._log.append(payload)
        if not live:
            self.stats.dropped += 1
            return False
        self.stats.published += 1
        self.bus._deliver(self.worker_id, self.dp_rank, seq, payload)
        return True

    def replay(self, start: int) -> Iterator[tuple[int, Payload]]:
        """Buffered batches with ``seq >= start``, in order."""
        self.stats.replay_requests += 1
        batches = self._log.since(start)
        self.stats.replayed_batches += len(batches)
        return iter(batches)

    def restart(self) -> None:
        """Simulate an engine restart: the sequence starts again at 0 and the buffer is empty."""
        self._log.restart()


class FeedTap:
    """One router replica's KV feed with its own faults (chaos): the next ``drop_next`` batches are lost on the
    way (the replica's stream sees the gap and asks for a replay), and batches arrive ``lag_ns`` late, in order.
    It passes each batch's arguments on to ``intake`` as they came (the in-memory bus's ``(worker_id, dp_rank,
    seq, payload)``, or a ZeroMQ subscriber's ``(stream, seq, payload)``)."""

    def __init__(self, intake: Callable[..., None]) -> None:
        self.intake = intake
        self.drop_next = 0
        self.dropped = 0
        """Batches lost on the way so far."""
        self.lag_ns = 0
        self._late_until = 0.0  # loop time of the last batch held back by the lag

    def __call__(self, *batch: Any) -> None:
        if self.drop_next:
            self.drop_next -= 1
            self.dropped += 1
            return
        if not self.lag_ns and not self._late_until:
            self.intake(*batch)
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not self.lag_ns and self._late_until <= now:
            self._late_until = 0.0
            self.intake(*batch)
            return
        due = self._late_until = max(now + self.lag_ns / NS_PER_S, self._late_until)
        loop.call_at(due, self.intake, *batch)


def into_stream(stream: Any, seq: int, payload: Payload) -> None:
    """A live batch into its stream: what a replica's ``FeedTap`` over a ZeroMQ subscriber lets through
    (``KvEventSubscriber.feed``)."""
    stream.receive(seq, payload)


class MemoryKvBus:
    """Connects the in-memory publishers of all workers to the router's intake (one per router replica)."""

    def __init__(self, *, lag_ns: int = 0, vllm_version: str = "0.33", buffer_steps: int = 10_000,
                 wire_check: bool = False, hash_form: str = "int", block_hashes: str = "kvemu") -> None:
        if lag_ns < 0:
            raise InvalidArgument(f"KV-event lag must be >= 0 ns, got {lag_ns}", field="lag_ns")
        profile_for(vllm_version, hash_form)  # refuse a form the version cannot send now, not at the first publisher
        self._lag_ns = lag_ns
        self.wire_check = wire_check
        """Carry engine batches as vLLM bytes (encoded and decoded) instead of router-model structs."""
        self.vllm_version = vllm_version
        self.hash_form = hash_form
        """Block hashes in wire-check bytes: ``int`` or ``bytes`` (digests, vLLM >= 0.11)."""
        vllm_hashes(block_hashes)  # refuse an unknown name now
        self.block_hashes = block_hashes
        """Whose block hashes the events carry: ``kvemu`` or ``vllm-0.34`` (``kvemu.wire.vllm_hashes``)."""
        self.buffer_steps = buffer_steps
        self._intakes: dict[int, Deliver] = {}
        self._deliver_to: list[Deliver] = []  # the intakes in replica order
        self._publishers: dict[tuple[int, int], MemoryKvPublisher] = {}

    @property
    def lag_ns(self) -> int:
        """The publish lag of every publisher on the bus (setting it changes them all)."""
        return self._lag_ns

    @lag_ns.setter
    def lag_ns(self, value: int) -> None:
        if value < 0:
            raise InvalidArgument(f"KV-event lag must be >= 0 ns, got {value}", field="lag_ns")
        self._lag_ns = value
        for pub in self._publishers.values():
            pub.lag_ns = value

    def connect(self, intake: Deliver, replica: int = 0) -> None:
        """Where delivered batches go: one router replica's intake (connecting a replica again replaces its intake:
        a restarted router). Every replica gets every batch, in replica order."""
        self._intakes[replica] = intake
        self._deliver_to = [self._intakes[k] for k in sorted(self._intakes)]

    def publisher(self, worker_id: int, dp_rank: int) -> MemoryKvPublisher:
        """The publisher of one rank (created on first use)."""
        key = (worker_id, dp_rank)
        pub = self._publishers.get(key)
        if pub is None:
            pub = self._publishers[key] = MemoryKvPublisher(self, worker_id, dp_rank, self.vllm_version,
                                                            self.buffer_steps, self.hash_form, self.block_hashes)
        return pub

    def replay(self, worker_id: int, dp_rank: int) -> Callable[[int], Iterator[tuple[int, Payload]]]:
        """The replay function of one rank's stream, for the router's ``EventStream``."""
        return lambda start: self.publisher(worker_id, dp_rank).replay(start)

    def forget(self, worker_id: int) -> None:
        """Drop a removed worker's publishers (a re-added worker starts at sequence 0)."""
        for key in [k for k in self._publishers if k[0] == worker_id]:
            del self._publishers[key]

    def _deliver(self, worker_id: int, dp_rank: int, seq: int, payload: Payload) -> None:
        for intake in self._deliver_to:
            intake(worker_id, dp_rank, seq, payload)
