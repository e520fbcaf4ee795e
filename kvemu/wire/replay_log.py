"""One rank's outgoing KV-event batches: sequence numbers, the replay buffer and held-back batches.

The sans-IO core of every KV publisher, ZeroMQ or in-memory: ``append`` numbers a payload from 0,
keeps the last ``buffer_steps`` payloads for replay and says whether the batch goes out live;
``drop_next`` (fault injection) holds back that many coming batches, which only a replay recovers.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

from kvemu.clock import NS_PER_S
from kvemu.errors import InvalidArgument
from kvemu.router_events import EngineEvents
from kvemu.wire.codec import VllmProfile, encode_batch
from kvemu.kv_events import KVEventBatch

__all__ = ["ReplayLog", "LoggedPublisher", "wire_payload"]

P = TypeVar("P")


class ReplayLog(Generic[P]):
    """Sequence numbers and the replay buffer of one rank's batches (payloads of any form)."""

    __slots__ = ("_seq", "_buffer", "drop_next")

    def __init__(self, buffer_steps: int) -> None:
        if buffer_steps < 1:
            raise InvalidArgument(f"buffer_steps must be >= 1, got {buffer_steps}")
        self._seq = 0
        self._buffer: deque[tuple[int, P]] = deque(maxlen=buffer_steps)
        self.drop_next = 0
        """Fault injection: this many coming batches are buffered for replay but not sent live."""

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._seq

    def append(self, payload: P) -> tuple[int, bool]:
        """Number and buffer ``payload``: ``(seq, whether to send it live)``."""
        seq = self._seq
        self._seq = seq + 1
        self._buffer.append((seq, payload))  # deque appends are atomic: a replay thread may copy it whole
        if self.drop_next:
            self.drop_next -= 1
            return seq, False
        return seq, True

    def snapshot(self) -> list[tuple[int, P]]:
        """The buffered ``(seq, payload)``, in order (consecutive sequence numbers)."""
        return list(self._buffer)

    def since(self, start: int) -> list[tuple[int, P]]:
        """Buffered ``(seq, payload)`` with ``seq >= start``, in order."""
        return [(s, p) for s, p in list(self._buffer) if s >= start]

    def restart(self) -> None:
        """An engine restart: the sequence starts again at 0 and the buffer is empty."""
        self._seq = 0
        self._buffer.clear()


class LoggedPublisher(Generic[P]):
    """Base of the KV publishers: what they expose of their ``ReplayLog`` (of payloads ``P``), and the publish lag."""

    _log: ReplayLog[P]
    lag_ns: int = 0
    """Chaos: each batch is published this long after the engine hands it over (KV events arrive late)."""

    _late_until: float = 0.0  # loop time of the last batch held back by the lag

    def publish(self, batch: KVEventBatch | EngineEvents) -> bool:
        """Publish a batch now, or ``lag_ns`` later on the running loop; False if only the replay buffer got it.

        Late batches keep their order, as on one connection: a batch held back when the lag shrank is
        not overtaken by the next one."""
        if not self.lag_ns and not self._late_until:
            return self._publish_now(batch)
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not self.lag_ns and self._late_until <= now:
            self._late_until = 0.0
            return self._publish_now(batch)
        due = self._late_until = max(now + self.lag_ns / NS_PER_S, self._late_until)
        loop.call_at(due, self._publish_late, batch)
        return True

    def _publish_now(self, batch: KVEventBatch | EngineEvents) -> bool:
        raise NotImplementedError

    def _publish_late(self, batch: KVEventBatch | EngineEvents) -> None:
        if not self.closed:
            self._publish_now(batch)

    @property
    def closed(self) -> bool:
        """Whether this publisher was closed (a late batch is then dropped)."""
        return False

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._log.next_seq

    @property
    def drop_next(self) -> int:
        """Fault injection: this many coming batches are buffered for replay but not sent live."""
        return self._log.drop_next

    @drop_next.setter
    def drop_next(self, count: int) -> None:
        self._log.drop_next = count


def wire_payload(batch: KVEventBatch | EngineEvents, dp_rank: int, profile: VllmProfile) -> bytes:
    """The bytes vLLM ``profile.version`` sends for ``batch`` (an engine's events materialised first),
    stamped with ``dp_rank`` when the batch names none."""
    if type(batch) is not KVEventBatch:
        batch = batch.batch()
    if batch.data_parallel_rank is None:
        batch = KVEventBatch(ts=batch.ts, events=batch.events, data_parallel_rank=dp_rank)
    return encode_batch(batch, profile)
