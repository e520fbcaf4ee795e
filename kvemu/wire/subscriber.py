"""Router-side KV-event subscriber: one SUB per ``(worker, dp_rank)`` stream, with gap recovery.

Each stream tracks the sequence number it expects. A gap asks the stream's replay endpoint for the
missing batches (DEALER, ``[b"", start]``) and applies them in order before the live batch; a sequence
going backwards means the engine restarted, so that rank is cleared and rebuilt from a replay from 0.
Without a replay endpoint the lost batches are counted and logged once per gap. Undecodable payloads,
block-size mismatches and unappliable events are counted per worker; none of them stops the consumer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import zmq

from kvemu.errors import InvalidArgument, KvCacheEventError
from kvemu.events import AllCleared, RouterEvent
from kvemu.wire.codec import WireDecodeError, decode_batch
from kvemu.wire.convert import BlockSizeMismatch, convert_event
from kvemu.wire.endpoints import SEQ_END
from kvemu.wire.kv_events import BlockRemoved, BlockStored

__all__ = ["StreamSpec", "WorkerEventStats", "KvEventSubscriber"]

log = logging.getLogger(__name__)

_recv = zmq.backend.Socket.recv  # the Cython calls: a fraction of recv_multipart's Python overhead
_get = zmq.backend.Socket.get
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)


def _recv_frames(sock: zmq.Socket) -> list[bytes]:
    """One whole multipart message without blocking (``zmq.Again`` if none is waiting)."""
    frames = [_recv(sock, _NOBLOCK)]
    while _get(sock, _RCVMORE):
        frames.append(_recv(sock, 0))
    return frames


class StreamSpec(NamedTuple):
    """Where one rank of one worker publishes."""

    worker_id: int
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None


class WorkerEventStats:
    """Per-worker counters for reports."""

    __slots__ = ("batches", "events", "blocks_stored", "blocks_removed", "clears", "gaps", "replays",
                 "replayed_batches", "lost_batches", "decode_errors", "block_size_mismatches", "apply_errors",
                 "restarts")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        """The counters by name."""
        return {name: getattr(self, name) for name in self.__slots__}


class _Stream:
    __slots__ = ("spec", "sub", "dealer", "expected", "event_id")

    def __init__(self, spec: StreamSpec, sub: zmq.Socket) -> None:
        self.spec = spec
        self.sub = sub
        self.dealer: zmq.Socket | None = None
        self.expected: int | None = None  # next sequence number; None before the first batch
        self.event_id = 0


class KvEventSubscriber:
    """Consumes the KV-event streams of many ranks and hands router events to ``sink``."""

    def __init__(
        self,
        sink: Callable[[RouterEvent], None],
        *,
        block_size: int,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        replay_on_connect: bool = True,
        eagle: bool = False,
        context: zmq.Context | None = None,
        observer: Callable[[str, int, int, dict], None] | None = None,
    ) -> None:
        self.sink = sink
        self.block_size = block_size
        self.topic = topic.encode()
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self.replay_on_connect = replay_on_connect
        self.eagle = eagle
        self.observer = observer
        """Told ``(kind, worker_id, dp_rank, details)`` for ``gap``, ``replay``, ``lost``, ``restart``."""
        self._ctx = context or zmq.Context.instance()
        self._streams: dict[zmq.Socket, _Stream] = {}
        self._by_key: dict[tuple[int, int], _Stream] = {}
        self._poller = zmq.Poller()
        self.stats: dict[int, WorkerEventStats] = {}

    # ------------------------------------------------------------------ streams

    def add(self, spec: StreamSpec) -> None:
        """Start consuming one rank's stream."""
        key = (spec.worker_id, spec.dp_rank)
        if key in self._by_key:
            raise InvalidArgument(f"worker {spec.worker_id} rank {spec.dp_rank} is already subscribed")
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(spec.endpoint)
        stream = _Stream(spec, sub)
        self._streams[sub] = stream
        self._by_key[key] = stream
        self._poller.register(sub, zmq.POLLIN)
        self.stats.setdefault(spec.worker_id, WorkerEventStats())

    def remove_worker(self, worker_id: int) -> None:
        """Stop consuming every stream of ``worker_id`` (its counters stay for the report)."""
        for key in sorted(k for k in self._by_key if k[0] == worker_id):
            stream = self._by_key.pop(key)
            self._poller.unregister(stream.sub)
            del self._streams[stream.sub]
            stream.sub.close(linger=0)
            if stream.dealer is not None:
                stream.dealer.close(linger=0)

    def close(self) -> None:
        """Close every socket."""
        for worker_id in sorted({k[0] for k in self._by_key}):
            self.remove_worker(worker_id)

    def expected_seq(self, worker_id: int, dp_rank: int) -> int | None:
        """The next sequence number expected on that stream (``None`` before its first batch)."""
        stream = self._by_key.get((worker_id, dp_rank))
        return None if stream is None else stream.expected

    # ------------------------------------------------------------------ consuming

    def poll(self, timeout_ms: int = 0, max_batches: int = 100_000) -> int:
        """Process what has arrived (waiting up to ``timeout_ms`` for the first); returns batches handled."""
        handled = 0
        ready = self._poller.poll(timeout_ms)
        while ready and handled < max_batches:
            for sock, _ in ready:
                stream = self._streams.get(sock)
                for _ in range(1024):  # drain a burst per stream, then give the others a turn
                    if stream is None or stream.sub is not sock:
                        break
                    try:
                        frames = _recv_frames(sock)
                    except zmq.Again:
                        break
                    self._on_frames(stream, frames)
                    handled += 1
                    stream = self._streams.get(sock)
            ready = self._poller.poll(0)
        return handled

    def _on_frames(self, stream: _Stream, frames: list[bytes]) -> None:
        stats = self.stats[stream.spec.worker_id]
        if len(frames) != 3 or len(frames[1]) != 8:
            stats.decode_errors += 1
            log.warning("worker %s rank %s: malformed frame (%d parts)", *stream.spec[:2], len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        expected = stream.expected
        if expected is None:
            if seq and self.replay_on_connect:
                self._recover(stream, 0, seq)  # batches published before we connected
            elif seq:
                self._lost(stream, 0, seq)
        elif seq < expected:
            stats.restarts += 1
            self._notify("restart", stream, {"seq": seq, "expected": expected})
            self._clear(stream)
            if seq:
                self._recover(stream, 0, seq)
        elif seq > expected:
            stats.gaps += 1
            self._notify("gap", stream, {"from": expected, "to": seq})
            self._recover(stream, expected, seq)
        self._apply(stream, seq, frames[2])
        stream.expected = seq + 1

    def _recover(self, stream: _Stream, start: int, until: int) -> None:
        """Fetch batches ``start..until-1`` from the replay endpoint and apply them; count the rest lost."""
        stats = self.stats[stream.spec.worker_id]
        spec = stream.spec
        if spec.replay_endpoint is None:
            self._lost(stream, start, until)
            return
        if stream.dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(spec.replay_endpoint)
            stream.dealer = dealer
        dealer = stream.dealer
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        stats.replays += 1
        got = start
        while dealer.poll(self.replay_timeout_ms):
            frames = dealer.recv_multipart()
            # ≤ 0.25: ["", seq, payload]; ≥ 0.26: ["", topic, seq, payload]
            if len(frames) not in (3, 4) or frames[0] != b"":
                continue
            seq_bytes, payload = frames[-2], frames[-1]
            if seq_bytes == SEQ_END:
                break
            seq = int.from_bytes(seq_bytes, "big")
            if seq < got or seq >= until:
                continue
            if seq > got:
                self._lost(stream, got, seq)
            self._apply(stream, seq, payload)
            stats.replayed_batches += 1
            got = seq + 1
        else:  # timed out: the endpoint is gone; start over next time
            dealer.close(linger=0)
            stream.dealer = None
        if got < until:
            self._lost(stream, got, until)
        self._notify("replay", stream, {"from": start, "to": until, "recovered": got - start})

    def _lost(self, stream: _Stream, start: int, until: int) -> None:
        self.stats[stream.spec.worker_id].lost_batches += until - start
        log.warning("worker %s rank %s: KV-event batches %d..%d lost", *stream.spec[:2], start, until - 1)
        self._notify("lost", stream, {"from": start, "to": until})

    def _clear(self, stream: _Stream) -> None:
        w, r = stream.spec[:2]
        try:
            self.sink(RouterEvent(worker_id=w, dp_rank=r, data=AllCleared()))
        except KvCacheEventError:  # pragma: no cover - clearing never fails
            self.stats[w].apply_errors += 1

    def _apply(self, stream: _Stream, seq: int, payload: bytes) -> None:
        spec = stream.spec
        stats = self.stats[spec.worker_id]
        try:
            batch = decode_batch(payload, endpoint=spec.endpoint, seq=seq)
        except WireDecodeError as exc:
            stats.decode_errors += 1
            log.warning("%s", exc)
            return
        stats.batches += 1
        rank = batch.data_parallel_rank if batch.data_parallel_rank is not None else spec.dp_rank
        for ev in batch.events:
            stats.events += 1
            stream.event_id += 1
            try:
                converted = convert_event(
                    ev, worker_id=spec.worker_id, dp_rank=rank, block_size=self.block_size,
                    event_id=stream.event_id, eagle=self.eagle,
                )
                if converted is None:
                    continue
                self.sink(converted)
            except BlockSizeMismatch as exc:
                stats.block_size_mismatches += 1
                if stats.block_size_mismatches <= 3:
                    log.error("%s", exc)
                continue
            except KvCacheEventError:
                stats.apply_errors += 1
                continue
            t = type(ev)
            if t is BlockStored:
                stats.blocks_stored += len(ev.block_hashes)  # type: ignore[union-attr]
            elif t is BlockRemoved:
                stats.blocks_removed += len(ev.block_hashes)  # type: ignore[union-attr]
            else:
                stats.clears += 1

    def _notify(self, kind: str, stream: _Stream, details: dict) -> None:
        if self.observer is not None:
            self.observer(kind, stream.spec.worker_id, stream.spec.dp_rank, details)
