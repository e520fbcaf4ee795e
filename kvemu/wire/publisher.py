"""KV-event publisher for one DP rank, speaking vLLM's ZeroMQ protocol.

Live frames are ``[topic, seq (8-byte big-endian, from 0), payload]`` on a publishing socket; the last
``buffer_steps`` payloads stay in a replay buffer served by an optional ROUTER socket. Publishing
never blocks the engine: a batch that the socket cannot take right now (a subscriber is at its high
water mark) is counted as dropped for live delivery but stays replayable, so consumers see a gap and
recover it — instead of the reference engine's blocking queue that can stall every DP rank.

Replay peers are untrusted: a peer that asks and never reads must not grow the rank's memory. Each peer's
outgoing queue holds at most ``replay_hwm`` messages (``ROUTER_MANDATORY``: a full queue says so instead of
dropping silently); what does not fit waits as a cursor into the shared replay buffer, sent as the peer
reads. At most ``max_replay_peers`` answers are under way at once — a request past that is refused
(counted) — and an answer that makes no progress for ``replay_stall_s`` is abandoned (counted).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import zmq

from kvemu.clock import NS_PER_S, Clock, WallClock
from kvemu.errors import InvalidArgument
from kvemu.router_events import EngineEvents
from kvemu.wire import limits, security
from kvemu.wire.codec import VllmProfile, profile_for
from kvemu.wire.endpoints import SEQ_END, offset_endpoint, should_bind
from kvemu.kv_events import KVEventBatch
from kvemu.wire.replay_log import LoggedPublisher, ReplayLog, wire_payload
from kvemu.wire.vllm_hashes import vllm_hashes

__all__ = ["KvEventPublisher", "PublisherStats", "MAX_REPLAY_PEERS", "REPLAY_HWM"]

MAX_REPLAY_PEERS = 32
"""Replay answers under way at once, per rank; a request from another peer past this is refused."""
REPLAY_HWM = 1000
"""Messages queued to one replay peer at most (ZeroMQ's SNDHWM): the rest waits until it reads."""

_send = zmq.backend.Socket.send  # the Cython send: a fraction of send_multipart's Python overhead
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE)


class PublisherStats:
    """Counters of one publisher."""

    __slots__ = ("published", "dropped", "replay_requests", "replayed_batches", "replays_refused",
                 "replays_abandoned")

    def __init__(self) -> None:
        self.published = self.dropped = self.replay_requests = self.replayed_batches = 0
        self.replays_refused = self.replays_abandoned = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by name."""
        return {name: getattr(self, name) for name in self.__slots__}


class KvEventPublisher(LoggedPublisher[bytes]):
    """Publishes ``KVEventBatch``es of one DP rank in the wire format of a chosen vLLM version, block hashes
    as integers or (``hash_form="bytes"``, vLLM >= 0.11) as digest bytes; kvemu's hashes, or (``block_hashes=
    "vllm-0.34"``) those vLLM computes for the same blocks (``kvemu.wire.vllm_hashes``)."""

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:5557",
        *,
        replay_endpoint: str | None = None,
        dp_rank: int = 0,
        topic: str = "",
        vllm_version: str = "0.33",
        hash_form: str = "int",
        block_hashes: str = "kvemu",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        bind: bool | None = None,
        context: zmq.SyncContext | None = None,
        max_replay_peers: int = MAX_REPLAY_PEERS,
        replay_hwm: int = REPLAY_HWM,
        replay_stall_s: float = 10.0,
        clock: Clock | None = None,
    ) -> None:
        if hwm < 0:
            raise InvalidArgument(f"hwm must be >= 0, got {hwm}")
        if max_replay_peers < 1 or replay_hwm < 2 or not replay_stall_s > 0:
            raise InvalidArgument(f"max_replay_peers ({max_replay_peers}) must be >= 1, replay_hwm ({replay_hwm}) "
                                  f">= 2 and replay_stall_s ({replay_stall_s}) > 0")
        self.max_replay_peers = max_replay_peers
        self.replay_stall_s = replay_stall_s
        self._clock: Clock = clock or WallClock()  # times a stalled replay answer
        # identity -> (next sequence number to send, or -1 when only the end marker is left; when it last moved)
        self._answers: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self.profile: VllmProfile = profile_for(vllm_version, hash_form)  # before any socket: it may refuse
        self._vllm_hashes = vllm_hashes(block_hashes)
        self.dp_rank = dp_rank
        self.topic = topic.encode()
        self.stats = PublisherStats()
        self._ctx = context or zmq.Context.instance()
        self._log: ReplayLog[bytes] = ReplayLog(buffer_steps)
        self._closed = False
        pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.SNDHWM, hwm)
        pub.setsockopt(zmq.XPUB_NODROP, 1)  # full → EAGAIN (counted) rather than a silent drop
        pub.setsockopt(zmq.LINGER, 0)
        limits.limit_inbound(pub, limits.MAX_CONTROL_BYTES)  # subscriptions only
        live = offset_endpoint(endpoint, dp_rank)
        if should_bind(live) if bind is None else bind:
            self.endpoint = security.bind_securely(pub, live)
        else:
            security.connect_securely(pub)
            pub.connect(live)
            self.endpoint = live
        self._pub = pub
        self._router: zmq.SyncSocket | None = None
        self.replay_endpoint: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.SNDHWM, replay_hwm)  # per peer: one that never reads holds no more
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full (or gone) peer raises instead of a silent drop
            router.setsockopt(zmq.LINGER, 0)
            limits.limit_inbound(router, limits.MAX_CONTROL_BYTES)  # replay requests only
            try:
                self.replay_endpoint = security.bind_securely(router, offset_endpoint(replay_endpoint, dp_rank))
            except InvalidArgument:
                pub.close(linger=0)
                raise
            self._router = router
            self._thread = threading.Thread(target=self._serve_replay, name=f"kv-replay-dp{dp_rank}", daemon=True)
            self._thread.start()

    def _publish_now(self, batch: KVEventBatch | EngineEvents) -> bool:
        """Send a batch (stamping this rank if it has none); False if only the replay buffer got it."""
        if self._closed:
            raise InvalidArgument("publish on a closed KvEventPublisher")
        if self._vllm_hashes is not None:
            batch = self._vllm_hashes.batch(batch)
        return self.publish_payload(wire_payload(batch, self.dp_rank, self.profile))

    def publish_payload(self, payload: bytes) -> bool:
        """Send an already encoded payload with the next sequence number."""
        seq, live = self._log.append(payload)
        if not live:
            self.stats.dropped += 1
            return False
        pub = self._pub
        try:
            _send(pub, self.topic, _MORE_NOBLOCK)  # a multipart message is admitted whole at its first part
        except zmq.Again:
            self.stats.dropped += 1
            return False
        _send(pub, seq.to_bytes(8, "big"), _MORE)
        _send(pub, payload, 0)
        self.stats.published += 1
        return True

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._closed

    def close(self, drain_timeout_s: float = 1.0) -> None:
        """Stop serving replays and close the sockets, giving queued live frames up to the timeout."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(drain_timeout_s, 0.5))
        self._pub.setsockopt(zmq.LINGER, int(drain_timeout_s * 1000))
        self._pub.close()

    def __enter__(self) -> KvEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(20 if self._answers else 50):
                    while True:
                        try:
                            frames = router.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._answer(router, frames)
                if self._answers:  # what waited for its peer to read (one copy of the buffer for them all)
                    snapshot = self._log.snapshot()
                    for identity in list(self._answers):
                        self._pump(router, identity, snapshot)
        finally:
            router.close(linger=0)

    def _answer(self, router: zmq.SyncSocket, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            return  # vLLM logs and ignores malformed requests
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        self.stats.replay_requests += 1
        if identity not in self._answers and len(self._answers) >= self.max_replay_peers:
            self.stats.replays_refused += 1  # (the peer's replay times out; it asks again, or resyncs)
            return
        self._answers[identity] = (start, self._clock.now_ns())  # a new request from a peer restarts its answer
        self._pump(router, identity, self._log.snapshot())

    def _pump(self, router: zmq.SyncSocket, identity: bytes, snapshot: list[tuple[int, bytes]]) -> None:
        """Send ``identity`` what its queue takes of its answer; forget the answer when sent, its peer gone,
        or stalled past ``replay_stall_s``."""
        start, moved = self._answers[identity]
        replay_topic = self.profile.replay_topic
        topic = [self.topic] if replay_topic else []
        sent = 0
        try:
            if start >= 0:
                first = snapshot[0][0] if snapshot else 0
                for seq, payload in snapshot[max(0, start - first):]:
                    router.send_multipart([identity, b"", *topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
                    sent += 1
                    start = seq + 1
                start = -1  # every batch is queued: the end marker is left
            router.send_multipart([identity, b"", *([b""] if replay_topic else []), SEQ_END, b""], flags=zmq.NOBLOCK)
        except zmq.Again:  # the peer's queue is full: the rest waits until it reads
            self.stats.replayed_batches += sent
            now = self._clock.now_ns()
            if sent:
                moved = now
            elif (now - moved) / NS_PER_S > self.replay_stall_s:
                del self._answers[identity]
                self.stats.replays_abandoned += 1
                return
            self._answers[identity] = (start, moved)
            return
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer went away
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.stats.replayed_batches += sent
            del self._answers[identity]
            return
        self.stats.replayed_batches += sent
        del self._answers[identity]
