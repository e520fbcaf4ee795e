"""One ``(worker, dp_rank)`` KV-event stream as the router consumes it; sans-IO.

It tracks the sequence number it expects next. A gap asks ``replay(start)`` for the missing batches and
applies them in order before the live one; a sequence going backwards means the engine restarted, so
that rank is cleared and rebuilt from a replay from 0, unless the batch is one a rebuilding replay
already brought (the live socket delivers it too). What cannot be recovered is counted as lost.
Undecodable payloads, block-size mismatches and unappliable events are counted; none stops the stream.
The transport (ZeroMQ sockets, or in-memory links in virtual time) supplies frames and replays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import xxhash
from mypy_extensions import mypyc_attr

from kvemu.errors import KvemuError
from kvemu.hooks import KvDetails, KvRange, KvReplay, KvRestart
from kvemu.router_events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    EventData,
    RouterEvent,
    StorageTier,
    wire_event_count,
)
from kvemu.wire.codec import WireDecodeError, decode_batch
from kvemu.wire.convert import BlockSizeMismatch, convert_event
from kvemu.kv_events import KvEvent, KVEventBatch

__all__ = ["WorkerEventStats", "EventStream", "Replay", "Payload", "StreamObserver"]

log = logging.getLogger("kvemu.wire")

_FAILED = object()
"""What ``EventStream._counted`` returns for a call that raised."""

Payload = bytes | KVEventBatch | EventBatch
"""One batch as a transport carries it: vLLM bytes, decoded vLLM structs, or the router's model."""
Replay = Callable[[int], Iterable[tuple[int, Payload]] | None]
"""``replay(start)`` asks for the buffered batches from ``start`` on. An in-memory buffer returns them as
``(seq, payload)`` in order; a transport that answers later returns None and then feeds the stream's
``replay_batch`` and ``replay_end``."""
StreamObserver = Callable[[str, int, int, KvDetails], None]
"""``observer(kind, worker_id, dp_rank, details)``: told of a ``gap``, ``replay``, ``lost`` or ``restart`` with its
typed details (``KvRange``, ``KvReplay``, ``KvRestart``: sequence numbers, what a replay recovered)."""

MAX_HELD_BATCHES = 20_000
"""Most live batches one stream holds while a replay is under way."""


def _payload_key(payload: Payload) -> object:
    """What tells two deliveries of one batch apart from a restarted engine's batch of the same number."""
    if type(payload) is bytes:
        return xxhash.xxh3_64_intdigest(payload)
    return payload  # decoded structs and model batches compare by value


_STAT_NAMES = ("batches", "events", "blocks_stored", "blocks_removed", "clears", "gaps", "replays",
               "replayed_batches", "lost_batches", "decode_errors", "block_size_mismatches", "apply_errors",
               "restarts", "disconnects", "replay_failures", "connect_failures")
"""``WorkerEventStats``' counters in report order (a compiled class has no ``__slots__`` to read back)."""


class WorkerEventStats:
    """Per-worker KV-event counters for reports."""

    __slots__ = _STAT_NAMES
    batches: int
    events: int
    blocks_stored: int
    blocks_removed: int
    clears: int
    gaps: int
    replays: int
    replayed_batches: int
    lost_batches: int
    decode_errors: int
    block_size_mismatches: int
    apply_errors: int
    restarts: int
    disconnects: int
    replay_failures: int
    connect_failures: int

    def __init__(self) -> None:
        for name in _STAT_NAMES:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        """The counters by name."""
        return {name: getattr(self, name) for name in _STAT_NAMES}


@mypyc_attr(allow_interpreted_subclasses=True)  # subclassed outside the compiled build
class EventStream:
    """Consumes one rank's batches: ordering, recovery, decoding, conversion, and the sink."""

    __slots__ = ("worker_id", "dp_rank", "sink", "block_size", "stats", "replay", "replay_on_connect", "eagle",
                 "observer", "endpoint", "groups", "expected", "event_id", "_want", "_got", "_replayed", "_held",
                 "_rebuilt")

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
        observer: StreamObserver | None = None,
        endpoint: str | None = None,
        groups: list[tuple[str, int | None]] | None = None,
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
        self.groups = groups
        """A hybrid engine's (kind, window) per ``group_idx`` (``Register.kv_groups``), for events that name no kind."""
        self.expected: int | None = None
        self.event_id = 0
        self._want: tuple[int, int | None] | None = None
        """The replay under way: ``(start, until)``, ``until`` None when rebuilding from everything buffered."""
        self._got = 0
        self._replayed = 0
        self._held: list[tuple[int, Payload]] = []
        self._rebuilt: dict[int, object] | None = None
        """The batches the last rebuilding replay brought (``sync``), by sequence number, until a live batch
        past them arrives: the live socket may deliver them again, and that is no restart."""

    def receive(self, seq: int, payload: Payload) -> None:
        """Handle the live batch ``seq``, recovering whatever came before it that was missed."""
        if self._want is not None:  # a replay is under way: the live batches wait for it, in order
            if len(self._held) < MAX_HELD_BATCHES:
                self._held.append((seq, payload))
            return  # past the bound the batch is dropped: the next one's gap asks for it again
        expected = self.expected
        if expected is None:
            if seq:
                if self.replay_on_connect:
                    self._recover(0, seq, seq, payload)  # published before we connected
                    return
                self._lost(0, seq)
        elif seq < expected:
            rebuilt = self._rebuilt
            if rebuilt is not None and seq in rebuilt and rebuilt[seq] == _payload_key(payload):
                return  # brought by the rebuilding replay, and now live too
            self._rebuilt = None
            self.stats.restarts += 1
            self._notify("restart", KvRestart(seq, expected))
            self.sink(RouterEvent(worker_id=self.worker_id, dp_rank=self.dp_rank, data=AllCleared()))
            if seq:
                self.expected = None
                self._recover(0, seq, seq, payload)
                return
        elif seq > expected:
            self.stats.gaps += 1
            self._notify("gap", KvRange(expected, seq))
            self._recover(expected, seq, seq, payload)
            return
        self._rebuilt = None
        self.apply(seq, payload)
        self.expected = seq + 1

    @property
    def replaying(self) -> bool:
        """Whether a replay was asked for and has not ended (live batches are held meanwhile)."""
        return self._want is not None

    def sync(self) -> None:
        """Replay everything the publisher still buffers from where this stream stands (a new or
        restarted router rebuilding its view)."""
        if self.replay is None or self._want is not None:
            return
        self._ask(self.expected or 0, None)

    def _recover(self, start: int, until: int, seq: int, payload: Payload) -> None:
        """Replay ``start..until-1``, then handle the live batch ``seq`` that revealed they were missing."""
        if self.replay is None:
            self._lost(start, until)
            self.apply(seq, payload)
            self.expected = seq + 1
            return
        self.stats.replays += 1
        self._held.append((seq, payload))
        self._ask(start, until)

    def _ask(self, start: int, until: int | None) -> None:
        self._want = (start, until)
        self._rebuilt = {} if until is None else None
        self._got = start
        self._replayed = 0
        supplied = self.replay(start)  # type: ignore[misc]
        if supplied is not None:  # an in-memory buffer answers at once
            for seq, payload in supplied:
                if not self.replay_batch(seq, payload):
                    break
            self.replay_end()

    def replay_batch(self, seq: int, payload: Payload) -> bool:
        """One batch of the replay under way; False once the replay needs no more (past the range asked
        for, or none asked). Batches before the range, or repeated, are ignored."""
        want = self._want
        if want is None:
            return False
        until = want[1]
        if until is not None and seq >= until:
            return False
        got = self._got
        if seq < got:
            return True
        if seq > got and (until is not None or self.expected is not None):
            self._lost(got, seq)
        self.apply(seq, payload)
        self.stats.replayed_batches += 1
        self._replayed += 1
        self._got = seq + 1
        if until is None:
            self.expected = seq + 1
            rebuilt = self._rebuilt
            if rebuilt is not None:
                rebuilt[seq] = _payload_key(payload)
        return until is None or seq + 1 < until

    def replay_end(self) -> None:
        """The replay under way ended (its end marker, or the transport gave up): what it did not bring
        is counted lost, and the live batches held meanwhile are handled in order."""
        want = self._want
        if want is None:
            return
        self._want = None
        start, until = want
        if until is None:
            if self._replayed:
                self.stats.replays += 1
        else:
            if self._got < until:
                self._lost(self._got, until)
            self.expected = until
            self._notify("replay", KvReplay(start, until, self._replayed))
        held, self._held = self._held, []
        for i, (seq, payload) in enumerate(held):
            if self._want is not None:  # one of them opened another replay: the rest wait for it
                self._held.extend(held[i:])
                return
            if until is None and self.expected is not None and seq < self.expected:
                continue  # already brought by the replay that rebuilt the stream
            self.receive(seq, payload)

    def _lost(self, start: int, until: int) -> None:
        self.stats.lost_batches += until - start
        log.warning("worker %s rank %s: KV-event batches %d..%d lost", self.worker_id, self.dp_rank, start, until - 1)
        self._notify("lost", KvRange(start, until))

    def apply(self, seq: int, payload: Payload) -> None:
        """Decode one batch and hand its events to the sink (the batch's own rank wins).

        Consecutive removals of one tier reach the sink as one ``BlocksRemoved`` (the index cuts a
        run of blocks in one operation); counters still count one event per removed block.
        """
        stats = self.stats
        t = type(payload)
        if t is EventBatch:
            rank = payload.dp_rank  # type: ignore[union-attr]
            items = self._model_items(payload)  # type: ignore[arg-type]
        else:
            if t is KVEventBatch:
                batch = payload
            else:
                try:
                    batch = decode_batch(payload, endpoint=self.endpoint, seq=seq)  # type: ignore[arg-type]
                except WireDecodeError as exc:
                    stats.decode_errors += 1
                    log.warning("%s", exc)
                    return
            rank = batch.data_parallel_rank if batch.data_parallel_rank is not None else self.dp_rank  # type: ignore[union-attr]
            items = self._wire_items(batch, rank)  # type: ignore[arg-type]
        stats.batches += 1
        removed: list[int] = []
        removed_tier, removed_id = StorageTier.DEVICE, 0
        for data, tier, event_id in items:
            if type(data) is BlocksRemoved:
                if removed and tier is not removed_tier:
                    self._sink(rank, BlocksRemoved(removed), removed_tier, removed_id)
                    removed = []
                removed += data.block_hashes
                removed_tier, removed_id = tier, event_id
                continue
            if removed:
                self._sink(rank, BlocksRemoved(removed), removed_tier, removed_id)
                removed = []
            self._sink(rank, data, tier, event_id)
        if removed:
            self._sink(rank, BlocksRemoved(removed), removed_tier, removed_id)

    def _wire_items(self, batch: KVEventBatch, rank: int) -> Iterator[tuple[EventData, StorageTier, int]]:
        """The router events of a vLLM batch, converted with Dynamo's rules (drops and errors counted)."""
        for ev in batch.events:
            self.stats.events += 1
            self.event_id += 1
            converted = self._counted("converted", rank, self._convert, (ev, rank))
            if converted is not None and converted is not _FAILED:
                yield converted.data, converted.tier, self.event_id

    def _convert(self, ev: KvEvent, rank: int) -> RouterEvent | None:
        return convert_event(ev, worker_id=self.worker_id, dp_rank=rank, block_size=self.block_size,
                             event_id=self.event_id, eagle=self.eagle, groups=self.groups)

    def _model_items(self, batch: EventBatch) -> Iterator[tuple[EventData, StorageTier, int]]:
        """The events of a router-model batch, under the same rules as converted wire events."""
        stats = self.stats
        host = batch.host_events
        for data, tier in ((d, StorageTier.DEVICE) for d in batch.events) if not host else [
                *((d, StorageTier.DEVICE) for d in batch.events), *((d, StorageTier.HOST_PINNED) for d in host)]:
            n = wire_event_count(data)
            stats.events += n
            self.event_id += n
            if type(data) is BlocksStored:
                if batch.block_size != self.block_size:
                    self._mismatch(BlockSizeMismatch(
                        f"worker {self.worker_id} rank {batch.dp_rank} sent blocks of {batch.block_size} tokens but "
                        f"the router uses block_size {self.block_size}; its {len(data.block_hashes)} blocks were "
                        "not indexed (configure both the same)", worker_id=self.worker_id, dp_rank=batch.dp_rank))
                    continue
                if self.eagle:
                    continue
                # (no is_chain here: a router-model batch is made in this process by kvemu's own engine, whose
                # pool holds one block per hash; the index still refuses a store that repeats a hash, whole)
            yield data, tier, self.event_id

    def _mismatch(self, exc: BlockSizeMismatch) -> None:
        self.stats.block_size_mismatches += 1
        if self.stats.block_size_mismatches <= 3:
            log.error("%s", exc)

    def _counted(self, what: str, rank: int, fn: Callable[..., Any], args: tuple[object, ...]) -> Any:
        """``fn(*args)``, or ``_FAILED`` with the failure counted (and logged if unexpected): a malformed
        event must never stop the stream."""
        try:
            return fn(*args)
        except BlockSizeMismatch as exc:
            self._mismatch(exc)
        except KvemuError:  # missing token ids, unknown parent, removed blocks not held...
            self.stats.apply_errors += 1
        except Exception:  # noqa: BLE001
            self.stats.apply_errors += 1
            log.exception("worker %s rank %s: event could not be %s", self.worker_id, rank, what)
        return _FAILED

    def _sink(self, rank: int, data: EventData, tier: StorageTier, event_id: int) -> None:
        event = RouterEvent(worker_id=self.worker_id, dp_rank=rank, data=data, tier=tier, event_id=event_id)
        if self._counted("applied", rank, self.sink, (event,)) is _FAILED:
            return
        stats = self.stats
        if type(data) is BlocksStored:
            stats.blocks_stored += len(data.block_hashes)
        elif type(data) is BlocksRemoved:
            stats.blocks_removed += len(data.block_hashes)
        else:
            stats.clears += 1

    def _notify(self, kind: str, details: KvDetails) -> None:
        if self.observer is not None:
            self.observer(kind, self.worker_id, self.dp_rank, details)
