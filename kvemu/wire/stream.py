"""One ``(worker, dp_rank)`` KV-event stream as the router consumes it; sans-IO.

It tracks the sequence number it expects next. A gap asks ``replay(start)`` for the missing batches and
applies them in order before the live one; a sequence going backwards means the engine restarted, so
that rank is cleared and rebuilt from a replay from 0. What cannot be recovered is counted as lost.
Undecodable payloads, block-size mismatches and unappliable events are counted; none stops the stream.
The transport (ZeroMQ sockets, or in-memory links in virtual time) supplies frames and replays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from kvemu.errors import KvemuError
from kvemu.events import AllCleared, RouterEvent
from kvemu.wire.codec import WireDecodeError, decode_batch
from kvemu.wire.convert import BlockSizeMismatch, convert_event
from kvemu.wire.kv_events import BlockRemoved, BlockStored

__all__ = ["WorkerEventStats", "EventStream", "Replay"]

log = logging.getLogger("kvemu.wire")

Replay = Callable[[int], Iterable[tuple[int, bytes]]]
"""``replay(start)`` yields buffered ``(seq, payload)`` with ``seq >= start``, in order (maybe none)."""


class WorkerEventStats:
    """Per-worker KV-event counters for reports."""

    __slots__ = ("batches", "events", "blocks_stored", "blocks_removed", "clears", "gaps", "replays",
                 "replayed_batches", "lost_batches", "decode_errors", "block_size_mismatches", "apply_errors",
                 "restarts")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        """The counters by name."""
        return {name: getattr(self, name) for name in self.__slots__}


class EventStream:
    """Consumes one rank's batches: ordering, recovery, decoding, conversion, and the sink."""

    __slots__ = ("worker_id", "dp_rank", "sink", "block_size", "stats", "replay", "replay_on_connect", "eagle",
                 "observer", "endpoint", "expected", "event_id")

    def __init__(
        self,
        worker_id: int,
        dp_rank: int,
        *,
        sink: Callable[[RouterEvent], None],
        block_size: int,
        stats: WorkerEventStats,
        replay: Replay | None = None,
        replay_on_connect: bool = True,
        eagle: bool = False,
        observer: Callable[[str, int, int, dict], None] | None = None,
        endpoint: str | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.sink = sink
        self.block_size = block_size
        self.stats = stats
        self.replay = replay
        self.replay_on_connect = replay_on_connect
        self.eagle = eagle
        self.observer = observer
        """Told ``(kind, worker_id, dp_rank, details)`` for ``gap``, ``replay``, ``lost`` and ``restart``."""
        self.endpoint = endpoint
        self.expected: int | None = None
        self.event_id = 0

    def receive(self, seq: int, payload: bytes) -> None:
        """Handle the live batch ``seq``, recovering whatever came before it that was missed."""
        expected = self.expected
        if expected is None:
            if seq:
                if self.replay_on_connect:
                    self._recover(0, seq)  # published before we connected
                else:
                    self._lost(0, seq)
        elif seq < expected:
            self.stats.restarts += 1
            self._notify("restart", {"seq": seq, "expected": expected})
            self.sink(RouterEvent(worker_id=self.worker_id, dp_rank=self.dp_rank, data=AllCleared()))
            if seq:
                self._recover(0, seq)
        elif seq > expected:
            self.stats.gaps += 1
            self._notify("gap", {"from": expected, "to": seq})
            self._recover(expected, seq)
        self.apply(seq, payload)
        self.expected = seq + 1

    def sync(self) -> int:
        """Replay everything the publisher still buffers from where this stream stands (a new or
        restarted router rebuilding its view); returns the batches applied."""
        if self.replay is None:
            return 0
        start = self.expected or 0
        applied = 0
        for seq, payload in self.replay(start):
            if seq < start:
                continue
            if seq > start and self.expected is not None:
                self._lost(start, seq)
            self.apply(seq, payload)
            self.stats.replayed_batches += 1
            applied += 1
            start = self.expected = seq + 1
        if applied:
            self.stats.replays += 1
        return applied

    def _recover(self, start: int, until: int) -> None:
        if self.replay is None:
            self._lost(start, until)
            return
        self.stats.replays += 1
        got = start
        for seq, payload in self.replay(start):
            if seq < got:
                continue
            if seq >= until:
                continue
            if seq > got:
                self._lost(got, seq)
            self.apply(seq, payload)
            self.stats.replayed_batches += 1
            got = seq + 1
        if got < until:
            self._lost(got, until)
        self._notify("replay", {"from": start, "to": until, "recovered": got - start})

    def _lost(self, start: int, until: int) -> None:
        self.stats.lost_batches += until - start
        log.warning("worker %s rank %s: KV-event batches %d..%d lost", self.worker_id, self.dp_rank, start, until - 1)
        self._notify("lost", {"from": start, "to": until})

    def apply(self, seq: int, payload: bytes) -> None:
        """Decode one batch and hand its events to the sink (the batch's own rank wins)."""
        stats = self.stats
        try:
            batch = decode_batch(payload, endpoint=self.endpoint, seq=seq)
        except WireDecodeError as exc:
            stats.decode_errors += 1
            log.warning("%s", exc)
            return
        stats.batches += 1
        rank = batch.data_parallel_rank if batch.data_parallel_rank is not None else self.dp_rank
        for ev in batch.events:
            stats.events += 1
            self.event_id += 1
            try:
                converted = convert_event(
                    ev, worker_id=self.worker_id, dp_rank=rank, block_size=self.block_size,
                    event_id=self.event_id, eagle=self.eagle,
                )
                if converted is None:
                    continue
                self.sink(converted)
            except BlockSizeMismatch as exc:
                stats.block_size_mismatches += 1
                if stats.block_size_mismatches <= 3:
                    log.error("%s", exc)
                continue
            except KvemuError:  # unknown parent, missing block, out-of-range token ids...
                stats.apply_errors += 1
                continue
            except Exception:  # noqa: BLE001 - a malformed event must never stop the stream
                stats.apply_errors += 1
                log.exception("worker %s rank %s: event could not be applied", self.worker_id, self.dp_rank)
                continue
            t = type(ev)
            if t is BlockStored:
                stats.blocks_stored += len(ev.block_hashes)  # type: ignore[union-attr]
            elif t is BlockRemoved:
                stats.blocks_removed += len(ev.block_hashes)  # type: ignore[union-attr]
            else:
                stats.clears += 1

    def _notify(self, kind: str, details: dict) -> None:
        if self.observer is not None:
            self.observer(kind, self.worker_id, self.dp_rank, details)
