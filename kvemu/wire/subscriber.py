"""Router-side KV-event subscriber over ZeroMQ: one SUB per ``(worker, dp_rank)`` stream.

The ordering, recovery and accounting live in ``kvemu.wire.stream.EventStream``; this module adds the
sockets: SUB for live frames and a DEALER (``[b"", start]``) to the rank's replay ROUTER for gaps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvemu.clock import NS_PER_S, Clock, WallClock
from kvemu.errors import InvalidArgument
from kvemu.router_events import RouterEvent
from kvemu.wire import limits, security
from kvemu.wire.endpoints import SEQ_END
from kvemu.wire.stream import EventStream, StreamObserver, WorkerEventStats

__all__ = ["StreamSpec", "WorkerEventStats", "KvEventSubscriber"]  # WorkerEventStats re-exported

log = logging.getLogger(__name__)

_recv = zmq.backend.Socket.recv  # the Cython calls: a fraction of recv_multipart's Python overhead
_get = zmq.backend.Socket.get
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)


def _recv_frames(sock: zmq.SyncSocket) -> list[bytes]:
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
    groups: tuple[tuple[str, int | None], ...] = ()
    """A hybrid engine's KV cache groups (``Register.kv_groups``), for events that do not name their kind."""


SOCKETS_PER_STREAM = 3
"""A stream's SUB socket, its connection monitor, and the DEALER it replays on."""


FDS_PER_STREAM = 5
"""Open files one stream holds: its SUB socket and connection, the monitor's two sockets, and a share of the
replay DEALER and its connection (measured: 3 with no connection, 4 connected)."""
FDS_RESERVED = 512
"""Open files kept for the rest of the process (the router's own sockets, logs, the report)."""


def open_file_limit(want: int) -> int:
    """Raise this process's open-file limit towards ``want`` (up to the hard limit); returns the limit now."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < want:
            soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        return want if soft == resource.RLIM_INFINITY else soft
    except (ImportError, ValueError, OSError):  # pragma: no cover - no resource module, or not allowed
        return want


FILES_RECOUNT_NS = NS_PER_S // 10
"""How long a count of this process's open files stands (a count costs about 2 ms per 4,000 files)."""


def open_files() -> tuple[int, int] | None:
    """This process's open files and its open-file limit now, or None where they cannot be counted cheaply
    (no ``/proc/self/fd``)."""
    try:
        import os
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            return None
        return len(os.listdir("/proc/self/fd")), soft
    except (ImportError, OSError):  # pragma: no cover - not Linux
        return None


def sized_context(streams: int) -> zmq.SyncContext:
    """A ZeroMQ context allowed enough sockets for ``streams`` ranks (ZeroMQ's default stops at 1,023), with
    the process's open-file limit raised towards what they need (up to the hard limit)."""
    sockets = SOCKETS_PER_STREAM * streams + 64
    open_file_limit(FDS_PER_STREAM * streams + FDS_RESERVED)
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, max(sockets, ctx.get(zmq.MAX_SOCKETS)))
    return ctx


RECONNECT_IVL_MAX_MS = 5000
"""An endpoint that refuses connections is retried ever more slowly, up to this interval (ZeroMQ would retry
every 100 ms: thousands of dead endpoints announced by fake workers keep its I/O thread busy)."""
CONNECTS_PER_POLL = 32
"""Streams connected per ``poll`` (a SUB and its monitor cost about 0.3 ms)."""
MAX_REPLAY_BATCHES = 20_000
"""Most frames one replay may bring (twice the publishers' default buffer); more fails it."""
REPLAY_BACKOFF_NS = 10 * NS_PER_S
"""After a failed replay, how long a stream asks for none (its gaps are counted lost at once)."""


class _Stream:
    __slots__ = ("spec", "sub", "monitor", "dealer", "events", "replay_blocked_until_ns", "replay_deadline_ns",
                 "replay_frames", "dropped")

    def __init__(self, spec: StreamSpec) -> None:
        self.spec = spec
        self.sub: zmq.SyncSocket = None  # type: ignore[assignment]  # connected by the subscriber's poll
        self.monitor: zmq.SyncSocket = None  # type: ignore[assignment]
        """Tells when ZeroMQ dropped the connection (an oversized frame): the stream then reconnects."""
        self.dealer: zmq.SyncSocket | None = None
        self.replay_blocked_until_ns = 0
        self.replay_deadline_ns = 0
        self.replay_frames = 0
        self.dropped = False
        """The connection dropped and is not up again: said (a warning) only if it comes back up, since a publisher
        that went away (its worker stopped or died) is no fault of the stream's."""
        self.events: EventStream  # set by the subscriber


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
        context: zmq.SyncContext | None = None,
        observer: StreamObserver | None = None,
        max_streams: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.sink = sink
        self.block_size = block_size
        self.topic = topic.encode()
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self.replay_on_connect = replay_on_connect
        self.eagle = eagle
        self.observer = observer
        """Told ``(kind, worker_id, dp_rank, details)`` for ``gap``, ``replay``, ``lost``, ``restart``."""
        self.clock = clock or WallClock()
        """Times replays (live mode: wall time)."""
        self.feed: Callable[[EventStream, int, bytes], None] | None = None
        """Where a live batch goes instead of straight into its stream (``feed(stream, seq, payload)``): a router
        replica's feed with its own faults (``kvemu.runtime.kv_bus.FeedTap``); None: straight in."""
        self._own_ctx = context is None and max_streams is not None
        self._ctx = context or (sized_context(max_streams) if max_streams is not None else zmq.Context.instance())
        self.file_limited = False
        """Whether the open-file limit lowered ``max_streams`` (a cluster that needs more ranks gets warned by
        whoever knows its size; ``add`` says so when it refuses one)."""
        if max_streams is not None:
            fit = max(1, (open_file_limit(FDS_PER_STREAM * max_streams + FDS_RESERVED) - FDS_RESERVED) // FDS_PER_STREAM)
            if fit < max_streams:
                log.debug("the open-file limit allows KV streams for %d ranks, not %d", fit, max_streams)
                max_streams, self.file_limited = fit, True
        self.max_streams = max_streams
        """Most ranks consumed at once (``add`` refuses more): as asked, or what the open-file limit allows."""
        self._files_counted_ns: int | None = None
        self._files_free = 0
        """Open files left at the last count, beyond ``FDS_RESERVED``: other connections (every peer that
        connects to the router holds one) take from the same limit as the streams."""
        self._connected_at_count = 0
        self._streams: dict[zmq.SyncSocket, _Stream] = {}
        self._by_key: dict[tuple[int, int], _Stream] = {}
        self._poller = zmq.Poller()
        self._secret = security.secret()  # sockets made later (in poll) use the secret of the start
        self._replaying: dict[zmq.SyncSocket, _Stream] = {}
        """Replays under way, by the DEALER their answer comes on."""
        self._unconnected: dict[tuple[int, int], _Stream] = {}
        """Streams added and not connected yet, in order."""
        self.stats: dict[int, WorkerEventStats] = {}

    # ------------------------------------------------------------------ streams

    def add(self, spec: StreamSpec) -> None:
        """Start consuming one rank's stream."""
        key = (spec.worker_id, spec.dp_rank)
        if key in self._by_key:
            raise InvalidArgument(f"worker {spec.worker_id} rank {spec.dp_rank} is already subscribed")
        if self.max_streams is not None and len(self._by_key) >= self.max_streams:
            why = ("the open-file limit allows (raise the hard limit, ulimit -Hn, to take more)" if self.file_limited
                   else "this subscriber was sized for")
            raise InvalidArgument(f"worker {spec.worker_id} rank {spec.dp_rank}: already consuming {self.max_streams} "
                                  f"streams, the most {why}")
        stream = _Stream(spec)
        stats = self.stats.setdefault(spec.worker_id, WorkerEventStats())
        replay_at = spec.replay_endpoint
        stream.events = EventStream(
            spec.worker_id, spec.dp_rank, sink=self.sink, block_size=self.block_size, stats=stats,
            replay=(lambda start: self._ask_replay(stream, start, replay_at)) if replay_at else None,
            replay_on_connect=self.replay_on_connect, eagle=self.eagle, observer=self.observer,
            endpoint=spec.endpoint, groups=list(spec.groups) or None,
        )
        self._by_key[key] = stream
        self._unconnected[key] = stream  # sockets are made in poll, a few per turn: a burst of
        # registrations costs the caller nothing and never stalls the live streams

    def _connect_some(self) -> None:
        for _ in range(min(CONNECTS_PER_POLL, len(self._unconnected))):
            stream = self._unconnected.pop(next(iter(self._unconnected)))
            try:
                stream.sub, stream.monitor = self._connect(stream.spec)
            except zmq.ZMQError as exc:  # out of files or sockets: this stream is lost, the others go on
                stream.events.stats.connect_failures += 1
                log.error("worker %s rank %s: cannot open its KV-event stream (%s); its events are not indexed",
                          *stream.spec[:2], exc)
                continue
            self._watch(stream)

    def streams_left(self) -> int | None:
        """How many more streams can be opened (None: no bound): what ``add`` takes, and fewer when other
        connections (a flood of peers) hold the open files the streams were sized with."""
        if self.max_streams is None:
            return None
        left = self.max_streams - len(self._by_key)
        free = self._files_left()
        return left if free is None else max(0, min(left, free // FDS_PER_STREAM - len(self._unconnected)))

    def _files_left(self) -> int | None:
        """Open files left beyond ``FDS_RESERVED`` (None: not countable): counted at most every
        ``FILES_RECOUNT_NS``, less what the streams connected since then hold."""
        connected = len(self._by_key) - len(self._unconnected)
        now = self.clock.now_ns()
        if self._files_counted_ns is None or now - self._files_counted_ns >= FILES_RECOUNT_NS:
            counted = open_files()
            if counted is None:
                return None
            used, limit = counted
            self._files_counted_ns, self._connected_at_count = now, connected
            self._files_free = limit - FDS_RESERVED - used
        return self._files_free - FDS_PER_STREAM * (connected - self._connected_at_count)

    def _connect(self, spec: StreamSpec) -> tuple[zmq.SyncSocket, zmq.SyncSocket]:
        sub = self._ctx.socket(zmq.SUB)
        try:
            return self._connect_sub(sub, spec)
        except zmq.ZMQError:
            sub.close(linger=0)
            raise

    def _connect_sub(self, sub: zmq.SyncSocket, spec: StreamSpec) -> tuple[zmq.SyncSocket, zmq.SyncSocket]:
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        limits.limit_inbound(sub, limits.MAX_KV_BATCH_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        security.connect_securely(sub, self._secret)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                                         | zmq.EVENT_CONNECT_RETRIED)
        sub.connect(spec.endpoint)
        return sub, monitor

    def _watch(self, stream: _Stream) -> None:
        self._streams[stream.sub] = stream
        self._streams[stream.monitor] = stream
        if stream.dealer not in self._replaying:  # during a replay the live socket waits
            self._poller.register(stream.sub, zmq.POLLIN)
        self._poller.register(stream.monitor, zmq.POLLIN)

    def _unwatch(self, stream: _Stream) -> None:
        if stream.dealer not in self._replaying:
            self._poller.unregister(stream.sub)
        for sock in (stream.sub, stream.monitor):
            del self._streams[sock]
        self._poller.unregister(stream.monitor)
        stream.sub.disable_monitor()
        stream.monitor.close(linger=0)
        stream.sub.close(linger=0)

    def _on_monitor(self, stream: _Stream) -> None:
        """The live connection came up or dropped. Up: batches published before the subscription reached the
        publisher are lost without a trace (ZeroMQ's slow joiner), and with no later batch no gap would show
        them, so the stream catches up from its replay endpoint; with a replay under way it waits for that."""
        try:
            event = recv_monitor_message(stream.monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if stream.dropped:  # its publisher stayed up: ZeroMQ dropped what it sent
                stream.dropped = False
                log.warning("worker %s rank %s: the KV-event connection dropped while its publisher stayed up (an "
                            "oversized or broken frame); reconnected", *stream.spec[:2])
            if self.replay_on_connect:
                stream.events.sync()
            return
        if event["event"] == zmq.EVENT_CONNECT_RETRIED:  # refused: the publisher went away (a restart)
            stream.dropped = False
            return
        self._reconnect(stream)

    def _reconnect(self, stream: _Stream) -> None:
        """ZeroMQ dropped the stream's connection (it does not reconnect after refusing an oversized frame):
        count it and connect afresh; the next batch's sequence number tells what to replay."""
        while True:  # drain the monitor
            try:
                stream.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
        stream.events.stats.disconnects += 1
        stream.dropped = True  # a warning if it comes back up; a publisher that went away is not a broken frame
        log.debug("worker %s rank %s: the KV-event connection dropped; reconnecting", *stream.spec[:2])
        self._unwatch(stream)
        stream.sub = stream.monitor = None  # type: ignore[assignment]
        self._unconnected[stream.spec[:2]] = stream  # connected again by the next poll

    def remove_worker(self, worker_id: int) -> None:
        """Stop consuming every stream of ``worker_id`` (its counters stay for the report)."""
        for key in sorted(k for k in self._by_key if k[0] == worker_id):
            stream = self._by_key.pop(key)
            self._unconnected.pop(key, None)
            if stream.sub is not None:  # else never connected, or reconnecting (a replay may still be under way)
                self._unwatch(stream)
            if stream.dealer is not None:
                if self._replaying.pop(stream.dealer, None) is not None:
                    self._poller.unregister(stream.dealer)
                stream.dealer.close(linger=0)

    def close(self) -> None:
        """Close every socket (and the subscriber's own context)."""
        for worker_id in sorted({k[0] for k in self._by_key}):
            self.remove_worker(worker_id)
        if self._own_ctx:
            self._ctx.destroy(linger=0)

    def expected_seq(self, worker_id: int, dp_rank: int) -> int | None:
        """The next sequence number expected on that stream (``None`` before its first batch)."""
        stream = self._by_key.get((worker_id, dp_rank))
        return None if stream is None else stream.events.expected

    # ------------------------------------------------------------------ consuming

    def poll(self, timeout_ms: int = 0, max_batches: int = 100_000) -> int:
        """Process what has arrived (waiting up to ``timeout_ms`` for the first); returns live batches handled.
        Never blocks longer than that: replays are read as their frames come and fail when their time is up."""
        if self._unconnected:
            self._connect_some()
            if self._unconnected:
                timeout_ms = 0  # more to connect at the next call
        self._check_replays()
        handled = 0
        ready = self._poller.poll(timeout_ms)
        while ready and handled < max_batches:
            for sock, _ in ready:
                stream = self._streams.get(sock)
                if stream is None:
                    stream = self._replaying.get(sock)
                    if stream is not None:
                        self._on_replay(stream)
                    continue
                if sock is stream.monitor:
                    self._on_monitor(stream)
                    continue
                for _ in range(1024):  # drain a burst per stream, then give the others a turn
                    if stream.sub is not sock or stream.dealer in self._replaying:
                        break  # reconnected, or a gap opened a replay: the rest waits
                    try:
                        frames = _recv_frames(sock)
                    except zmq.Again:
                        break
                    self._on_frames(stream, frames)
                    handled += 1
                    if self._streams.get(sock) is not stream:
                        break
            self._check_replays()
            ready = self._poller.poll(0)
        return handled

    def _on_frames(self, stream: _Stream, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            stream.events.stats.decode_errors += 1
            log.warning("worker %s rank %s: malformed frame (%d parts)", *stream.spec[:2], len(frames))
            return
        if self.feed is not None:
            self.feed(stream.events, int.from_bytes(frames[1], "big"), frames[2])
        else:
            stream.events.receive(int.from_bytes(frames[1], "big"), frames[2])

    def _ask_replay(self, stream: _Stream, start: int, endpoint: str) -> tuple[()] | None:
        """Ask the rank's replay endpoint (``endpoint``) for the batches from ``start``; the answer is read by
        ``poll``.

        A replay is bounded: ``replay_timeout_s`` in all and ``MAX_REPLAY_BATCHES`` frames. While it is under
        way the stream's live socket is not read (ZeroMQ queues its batches), so nothing overtakes it. One
        that fails (silence, no end marker in time, too many frames) is counted, and the stream asks none
        for ``REPLAY_BACKOFF_NS``: what it misses meanwhile is counted lost at once.
        """
        now = self.clock.now_ns()
        if now < stream.replay_blocked_until_ns:
            return ()  # backing off: nothing comes
        if stream.dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            limits.limit_inbound(dealer, limits.MAX_KV_BATCH_BYTES)
            security.connect_securely(dealer, self._secret)
            dealer.connect(endpoint)
            stream.dealer = dealer
        stream.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        stream.replay_deadline_ns = now + self.replay_timeout_ms * 1_000_000
        stream.replay_frames = 0
        self._replaying[stream.dealer] = stream
        self._poller.register(stream.dealer, zmq.POLLIN)
        if stream.sub is not None:  # else it is reconnecting, and its new socket waits for the replay (_watch)
            self._poller.unregister(stream.sub)
        return None

    def _on_replay(self, stream: _Stream) -> None:
        """Read what the replay endpoint sent; end the replay at its end marker or once it has enough."""
        dealer = stream.dealer
        events = stream.events
        for _ in range(1024):
            try:
                frames = _recv_frames(dealer)  # type: ignore[arg-type]
            except zmq.Again:
                return
            stream.replay_frames += 1
            # ≤ 0.25: ["", seq, payload]; ≥ 0.26: ["", topic, seq, payload]
            if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                pass
            elif frames[-2] == SEQ_END:
                self._end_replay(stream, keep_dealer=True)
                return
            elif not events.replay_batch(int.from_bytes(frames[-2], "big"), frames[-1]):
                self._end_replay(stream, keep_dealer=False)  # the rest of the reply is stale
                return
            if stream.replay_frames >= MAX_REPLAY_BATCHES:
                self._fail_replay(stream, f"{MAX_REPLAY_BATCHES} frames and no end marker")
                return

    def _check_replays(self) -> None:
        """Fail the replays whose time is up."""
        if not self._replaying:
            return
        now = self.clock.now_ns()
        for stream in [s for s in self._replaying.values() if s.replay_deadline_ns <= now]:
            self._fail_replay(stream, f"no end marker within {self.replay_timeout_ms / 1000:.1f} s")

    def _fail_replay(self, stream: _Stream, why: str) -> None:
        stream.events.stats.replay_failures += 1
        stream.replay_blocked_until_ns = self.clock.now_ns() + REPLAY_BACKOFF_NS
        log.warning("worker %s rank %s: KV replay failed (%s); no replay for %.0f s", *stream.spec[:2], why,
                    REPLAY_BACKOFF_NS / NS_PER_S)
        self._end_replay(stream, keep_dealer=False)

    def _end_replay(self, stream: _Stream, *, keep_dealer: bool) -> None:
        dealer = cast("zmq.SyncSocket", stream.dealer)  # a replaying stream has its dealer (the _replaying key)
        self._poller.unregister(dealer)
        del self._replaying[dealer]
        if not keep_dealer:  # timed out, or stopped reading: whatever is still coming is stale
            dealer.close(linger=0)
            stream.dealer = None
        if stream.sub is not None:  # else it is reconnecting: _watch registers its new socket
            self._poller.register(stream.sub, zmq.POLLIN)
        stream.events.replay_end()  # may ask for another replay at once
