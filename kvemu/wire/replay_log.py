"""One rank's outgoing KV-event batches: sequence numbers, the replay buffer and held-back batches.

The sans-IO core of every KV publisher, ZeroMQ or in-memory: ``append`` numbers a payload from 0,
keeps the last ``buffer_steps`` payloads for replay and says whether the batch goes out live;
``drop_next`` (fault injection) holds back that many coming batches, which only a replay recovers.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from kvemu.errors import InvalidArgument
from kvemu.events import EngineEvents
from kvemu.wire.codec import VllmProfile, encode_batch
from kvemu.wire.kv_events import KVEventBatch

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

    def since(self, start: int) -> list[tuple[int, P]]:
        """Buffered ``(seq, payload)`` with ``seq >= start``, in order."""
        return [(s, p) for s, p in list(self._buffer) if s >= start]

    def restart(self) -> None:
        """An engine restart: the sequence starts again at 0 and the buffer is empty."""
        self._seq = 0
        self._buffer.clear()


class LoggedPublisher:
    """Base of the KV publishers: what they expose of their ``ReplayLog``."""

    _log: ReplayLog

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
        batch = batch.batch()  # type: ignore[union-attr]
    if batch.data_parallel_rank is None:  # type: ignore[union-attr]
        batch = KVEventBatch(ts=batch.ts, events=batch.events, data_parallel_rank=dp_rank)  # type: ignore[union-attr]
    return encode_batch(batch, profile)  # type: ignore[arg-type]
