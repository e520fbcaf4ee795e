"""KV events over real ZeroMQ sockets (127.0.0.1 only, ports chosen by the OS).

Every wait is a bounded loop on a condition. The ZeroMQ slow joiner (a SUB misses what was published
before its subscription reached the PUB) is handled by ``sync``: it publishes empty probe batches until
the subscriber has caught up with every publisher's sequence number, so tests compare counters as
deltas taken after the handshake.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import pytest
import zmq

import kvemu
from kvemu.hooks import KvRange, KvReplay
from kvemu.hashing import local_block_hashes, sequence_hashes
from kvemu.runtime.kv_bus import MemoryKvBus
from kvemu.runtime.transport import message_socket
from kvemu.wire import limits
from kvemu.wire.codec import PROFILES, encode_batch, profile_for
from kvemu.wire.convert import convert_event
from kvemu.wire.endpoints import SEQ_END
from kvemu.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvemu.wire.publisher import KvEventPublisher
from kvemu.wire.subscriber import KvEventSubscriber, StreamSpec

BS = 16
HOST = "tcp://127.0.0.1:0"
TIMEOUT_S = 5.0


# --------------------------------------------------------------------------- helpers


def prompt(seed: int, n_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(32) for _ in range(n_blocks * BS)]


def chain_events(tokens: list[int], *, per_event: int = 1, first: int = 0, last: int | None = None,
                 **kw) -> list[BlockStored]:
    """Stores of blocks ``first..last-1`` of ``tokens`` as an engine would send them (engine-like hashes)."""
    hashes = sequence_hashes(local_block_hashes(tokens, BS, lora_name=kw.get("lora_name")))
    last = len(hashes) if last is None else last
    out = []
    for i in range(first, last, per_event):
        j = min(i + per_event, last)
        out.append(BlockStored(block_hashes=hashes[i:j], parent_block_hash=hashes[i - 1] if i else None,
                               token_ids=tokens[i * BS:j * BS], block_size=kw.pop("block_size", BS), **kw))
    return out


def hashes_of(tokens: list[int]) -> list[int]:
    return sequence_hashes(local_block_hashes(tokens, BS))


def batch(*events, rank: int | None = None) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=rank)


def probe(pub: KvEventPublisher) -> None:
    pub.publish(batch())


def wait_until(cond: Callable[[], bool], subs=(), *, tick: Callable[[], None] | None = None,
               tick_every_s: float = 0.1, timeout_s: float = TIMEOUT_S, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    next_tick = time.monotonic() + tick_every_s
    while True:
        for sub in subs:
            sub.poll(10)
        if not subs:
            time.sleep(0.005)
        if cond():
            return
        now = time.monotonic()
        if now > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        if tick is not None and now >= next_tick:
            tick()
            next_tick = now + tick_every_s


def sync(sub: KvEventSubscriber, pubs: dict[tuple[int, int], KvEventPublisher]) -> None:
    """Wait until ``sub`` has handled everything each publisher sent (probing lagging ranks)."""

    def lagging():
        return [k for k, p in pubs.items() if sub.expected_seq(*k) != p.next_seq]

    def tick():
        for k in lagging():
            probe(pubs[k])

    wait_until(lambda: not lagging(), [sub], tick=tick, what=f"subscriber to catch up with {sorted(pubs)}")


def counters(sub: KvEventSubscriber, worker_id: int) -> dict[str, int]:
    return sub.stats[worker_id].as_dict()


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def wait_port_free(port: int) -> None:
    def free():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    wait_until(free, what=f"port {port} to be released")


class Net:
    """Creates publishers/subscribers on one private context and closes them all at the end."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pubs: list[KvEventPublisher] = []
        self.subs: list[KvEventSubscriber] = []
        self.socks: list[zmq.Socket] = []

    def publisher(self, *, replay: bool = True, endpoint: str = HOST, replay_endpoint: str = HOST,
                  **kw) -> KvEventPublisher:
        pub = KvEventPublisher(endpoint, replay_endpoint=replay_endpoint if replay else None, bind=True,
                               context=self.ctx, **kw)
        self.pubs.append(pub)
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and port_of(pub.endpoint) > 0
        return pub

    def subscriber(self, sink, **kw) -> KvEventSubscriber:
        kw.setdefault("block_size", BS)
        sub = KvEventSubscriber(sink, context=self.ctx, **kw)
        self.subs.append(sub)
        return sub

    def socket(self, kind: int) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        self.socks.append(s)
        return s

    def close(self) -> None:
        for sub in self.subs:
            sub.close()
        for pub in self.pubs:
            pub.close(drain_timeout_s=0)
        for s in self.socks:
            s.close(linger=0)
        self.ctx.destroy(linger=0)


@pytest.fixture
def net():
    n = Net()
    yield n
    n.close()


def new_core(*workers: tuple[int, int]) -> kvemu.RoutingCore:
    core = kvemu.RoutingCore(block_size=BS)
    for worker_id, dp_size in workers:
        core.add_worker(kvemu.WorkerSpec(worker_id=worker_id, dp_size=dp_size))
    return core


def followed(net: Net, sub: KvEventSubscriber, *streams: tuple[int, int]) -> list[KvEventPublisher]:
    """A new publisher for each (worker id, DP rank) of ``streams``, its stream (with replay) added to ``sub``."""
    pubs = [net.publisher() for _ in streams]
    for (worker_id, dp_rank), pub in zip(streams, pubs):
        sub.add(StreamSpec(worker_id, dp_rank, pub.endpoint, pub.replay_endpoint))
    return pubs


def depth(core: kvemu.RoutingCore, tokens: list[int]) -> dict[tuple[int, int], int]:
    return core.overlaps(core.prepare(tokens))


# --------------------------------------------------------------------------- end to end, DP ranks


def test_dp_ranks_end_to_end(net):
    """One publisher per DP rank of worker 7; the wire path indexes exactly what direct conversion does."""
    core, direct = new_core((7, 4)), new_core((7, 4))
    sub = net.subscriber(core.apply_event)
    pubs = {r: net.publisher(dp_rank=r, vllm_version=v) for r, v in enumerate(["0.33", "0.22", "0.26", "0.10"])}
    for r, pub in pubs.items():
        sub.add(StreamSpec(7, r, pub.endpoint, pub.replay_endpoint))

    shared = prompt(1, 4)
    own = {r: prompt(100 + r, 2) for r in pubs}
    per_rank: dict[int, list[list]] = {r: [] for r in pubs}
    for r in pubs:  # rank r caches the first r+1 blocks of the shared prompt, one step per block
        per_rank[r] += [[ev] for ev in chain_events(shared, last=r + 1)]
        per_rank[r].append(chain_events(own[r], per_event=2))
    per_rank[3].append([BlockRemoved(block_hashes=[hashes_of(shared)[3]])])  # evict rank 3's leaf
    per_rank[2].append([AllBlocksCleared()])
    per_rank[2].append(chain_events(shared, last=1) + chain_events(own[2], last=1))
    script = [(r, steps[i]) for i in range(max(map(len, per_rank.values())))  # ranks interleaved
              for r, steps in per_rank.items() if i < len(steps)]
    for r, events in script:  # publish (batches without a rank: the publisher stamps its own)
        pubs[r].publish(batch(*events))
        for ev in events:
            converted = convert_event(ev, worker_id=7, dp_rank=r, block_size=BS)
            if converted is not None:
                direct.apply_event(converted)
    sync(sub, {(7, r): p for r, p in pubs.items()})

    assert depth(core, shared) == {(7, 0): 1, (7, 1): 2, (7, 2): 1, (7, 3): 3}
    for r in pubs:
        assert depth(core, own[r]) == {(7, r): 1 if r == 2 else 2}
    for tokens in [shared, *own.values()]:
        assert depth(core, tokens) == depth(direct, tokens)
    for r in pubs:
        assert core.index.tree_size(7, r) == direct.index.tree_size(7, r)
        for h in hashes_of(shared) + [h for t in own.values() for h in hashes_of(t)]:
            assert core.index.holds(7, h, r) == direct.index.holds(7, h, r)
    stats = sub.stats[7]
    assert (stats.lost_batches, stats.decode_errors, stats.apply_errors, stats.block_size_mismatches) == (0, 0, 0, 0)
    assert stats.restarts == 0 and stats.clears == 1
    assert stats.blocks_stored == (1 + 2 + 3 + 4) + 4 * 2 + 2 and stats.blocks_removed == 1


@pytest.mark.parametrize("version", ["0.33", "0.10"])
def test_rank_carried_in_the_batch_wins(net, version):
    core = new_core((8, 4))
    sub = net.subscriber(core.apply_event)
    pub = net.publisher(dp_rank=1, vllm_version=version)
    sub.add(StreamSpec(8, 1, pub.endpoint, pub.replay_endpoint))
    tokens = prompt(2, 2)
    pub.publish(batch(*chain_events(tokens, per_event=2), rank=3))
    sync(sub, {(8, 1): pub})
    assert depth(core, tokens) == {(8, 3): 2}


def test_without_rank_on_the_wire_the_stream_rank_is_used(net):
    """vLLM 0.9 batches carry no DP rank: the rank the stream was registered for applies."""
    core = new_core((8, 4))
    sub = net.subscriber(core.apply_event)
    pub = net.publisher(dp_rank=1, vllm_version="0.9")
    sub.add(StreamSpec(8, 2, pub.endpoint, pub.replay_endpoint))
    tokens = prompt(3, 2)
    pub.publish(batch(*chain_events(tokens, per_event=2), rank=3))
    sync(sub, {(8, 2): pub})
    assert depth(core, tokens) == {(8, 2): 2}


# --------------------------------------------------------------------------- gaps, replay, loss


@pytest.mark.parametrize("version", ["0.25", "0.33"])
def test_gap_is_repaired_by_replay(net, version):
    assert profile_for(version).replay_topic is (version == "0.33")  # old and new replay reply shapes
    core = new_core((1, 1))
    seen = []
    # replay_on_connect off: the handshake then never touches the replay socket, so the gap below is
    # the stream's first replay
    sub = net.subscriber(core.apply_event, replay_on_connect=False,
                         observer=lambda kind, w, r, d: seen.append((kind, w, r, d)))
    pub = net.publisher(vllm_version=version, topic="kv@pod-1@m")
    sub.add(StreamSpec(1, 0, pub.endpoint, pub.replay_endpoint))
    sync(sub, {(1, 0): pub})
    before, requests_before, seen[:] = counters(sub, 1), pub.stats.replay_requests, []

    tokens = prompt(4, 4)
    a, b, c, d = chain_events(tokens)
    start = pub.next_seq
    assert pub.publish(batch(a)) is True
    pub.drop_next = 2
    assert pub.publish(batch(b)) is False and pub.publish(batch(c)) is False
    assert pub.drop_next == 0 and pub.stats.dropped == 2
    assert pub.publish(batch(d)) is True  # its parent is c: only applicable after the replay
    sync(sub, {(1, 0): pub})

    assert delta(before, counters(sub, 1)) == {
        "batches": 4, "events": 4, "blocks_stored": 4, "gaps": 1, "replays": 1, "replayed_batches": 2}
    assert depth(core, tokens) == {(1, 0): 4}
    assert pub.stats.replay_requests - requests_before == 1
    assert [k for k, *_ in seen] == ["gap", "replay"]
    assert seen[0][3] == KvRange(start + 1, start + 3)
    assert seen[1][1:] == (1, 0, KvReplay(start + 1, start + 3, recovered=2))


@pytest.mark.parametrize("version", ["0.25", "0.33"])
def test_consecutive_gaps_on_one_stream_are_all_repaired(net, version):
    """Each replay reply includes batches at or after the live one plus an end marker; all of it must be
    consumed, or the next replay on the same socket reads the stale end marker and loses its batches."""
    core = new_core((1, 1))
    sub = net.subscriber(core.apply_event)
    pub = net.publisher(vllm_version=version)
    sub.add(StreamSpec(1, 0, pub.endpoint, pub.replay_endpoint))
    sync(sub, {(1, 0): pub})
    before = counters(sub, 1)
    tokens = prompt(5, 9)
    events = chain_events(tokens)
    for i in range(0, 9, 3):  # three rounds, each waited for: a gap whose live batch is the newest one
        pub.publish(batch(events[i]))
        pub.drop_next = 1
        pub.publish(batch(events[i + 1]))
        pub.publish(batch(events[i + 2]))
        sync(sub, {(1, 0): pub})
    d = delta(before, counters(sub, 1))
    assert d.get("lost_batches", 0) == 0 and d.get("apply_errors", 0) == 0
    assert d["gaps"] == 3 and d["replays"] == 3 and d["replayed_batches"] == 3
    assert depth(core, tokens) == {(1, 0): 9}


def test_batches_published_before_the_subscriber_are_replayed_on_connect(net):
    core = new_core((2, 1))
    pub = net.publisher()
    tokens = prompt(6, 3)
    for ev in chain_events(tokens):
        pub.publish(batch(ev))  # nobody is listening yet
    sub = net.subscriber(core.apply_event)
    sub.add(StreamSpec(2, 0, pub.endpoint, pub.replay_endpoint))
    sync(sub, {(2, 0): pub})
    assert depth(core, tokens) == {(2, 0): 3}
    stats = sub.stats[2]
    # the batches are applied as they come; a replay is counted at its end marker, which may come a poll later
    wait_until(lambda: stats.replays >= 1, [sub], what="the replay's end marker")
    assert stats.lost_batches == 0 and stats.replayed_batches >= 3, stats.as_dict()


def test_batches_published_before_the_subscription_took_hold_arrive_with_nothing_published_after(net):
    """ZeroMQ's slow joiner: what a rank published before the subscription reached it is gone from the live
    socket, and with no later batch no gap shows it; the stream catches up once its connection is up."""
    core = new_core((2, 1))
    pub = net.publisher()
    tokens = prompt(16, 3)
    for ev in chain_events(tokens):
        pub.publish(batch(ev))
    sub = net.subscriber(core.apply_event)
    sub.add(StreamSpec(2, 0, pub.endpoint, pub.replay_endpoint))
    wait_until(lambda: depth(core, tokens) == {(2, 0): 3}, [sub], what="the early batches (no probe, no later batch)")
    assert sub.stats[2].lost_batches == 0


def test_a_batch_the_connect_replay_brings_and_the_live_socket_delivers_too_is_no_restart(net):
    """Batches published after the subscription took hold but before the connect-time replay was answered come
    both ways. Each is applied once, and the rank is not cleared as if its engine had restarted (it was: a CI
    run of bench.events applied 5,001 of 5,000 batches)."""
    core = new_core((2, 1))
    pub = net.publisher(replay=False)
    late = net.socket(zmq.ROUTER)  # a replay endpoint that answers when this test says
    late.bind(HOST)
    early, after = prompt(31, 2), prompt(33, 1)
    payloads = [encode_batch(batch(*chain_events(early)), pub.profile)]
    pub.publish_payload(payloads[0])  # before the subscriber: only the replay brings it
    sub = net.subscriber(core.apply_event)
    live: list[int] = []

    def feed(stream, seq, payload):
        live.append(seq)
        stream.receive(seq, payload)

    sub.feed = feed
    sub.add(StreamSpec(2, 0, pub.endpoint, late.getsockopt_string(zmq.LAST_ENDPOINT)))
    wait_until(lambda: late.poll(0), [sub], what="the connect-time replay request")
    ident, _, start = late.recv_multipart()
    assert int.from_bytes(start, "big") == 0
    live_socket = sub._by_key[(2, 0)].sub  # not read while the replay is under way: peek at it

    def published_one_that_arrives():
        payloads.append(encode_batch(batch(), pub.profile))
        pub.publish_payload(payloads[-1])
        return live_socket.poll(50) != 0

    wait_until(published_one_that_arrives, what="a batch on the live socket")  # the subscription took hold
    for seq, payload in enumerate(payloads):
        late.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
    late.send_multipart([ident, b"", SEQ_END, b""])
    pub.publish(batch(*chain_events(after)))
    wait_until(lambda: depth(core, after) == {(2, 0): 1}, [sub], what="the batch after the overlap")
    overlap = len(payloads) - 1
    assert overlap in live and live[-1] == overlap + 1  # the last replayed batch came live too
    stats = counters(sub, 2)
    assert (stats["restarts"], stats["clears"], stats["lost_batches"]) == (0, 0, 0), stats
    assert stats["batches"] == len(payloads) + 1
    assert depth(core, early) == {(2, 0): 2}


def test_without_replay_endpoint_lost_batches_are_counted_and_the_stream_continues(net):
    core = new_core((3, 1))
    sub = net.subscriber(core.apply_event)
    pub = net.publisher(replay=False)
    assert pub.replay_endpoint is None
    sub.add(StreamSpec(3, 0, pub.endpoint, None))
    sync(sub, {(3, 0): pub})
    before = counters(sub, 3)

    first, lost = prompt(7, 1), prompt(8, 3)
    later = prompt(9, 2)
    pub.publish(batch(*chain_events(first)))
    pub.drop_next = 3
    for ev in chain_events(lost):
        assert pub.publish(batch(ev)) is False
    pub.publish(batch(*chain_events(later, per_event=2)))
    sync(sub, {(3, 0): pub})
    assert delta(before, counters(sub, 3)) == {
        "batches": 2, "events": 2, "blocks_stored": 3, "gaps": 1, "lost_batches": 3}
    assert depth(core, first) == {(3, 0): 1} and depth(core, later) == {(3, 0): 2} and depth(core, lost) == {}

    tail = prompt(10, 1)  # still consuming
    pub.publish(batch(*chain_events(tail)))
    sync(sub, {(3, 0): pub})
    assert depth(core, tail) == {(3, 0): 1}
    assert sub.stats[3].lost_batches - before["lost_batches"] == 3


def test_a_replay_endpoint_that_does_not_answer_counts_the_batches_lost(net):
    core = new_core((3, 1))
    sub = net.subscriber(core.apply_event, replay_timeout_s=0.2)
    pub = net.publisher(replay=False)
    mute = net.socket(zmq.ROUTER)  # accepts the request, never replies
    mute.bind(HOST)
    sub.add(StreamSpec(3, 0, pub.endpoint, mute.getsockopt_string(zmq.LAST_ENDPOINT)))
    sync(sub, {(3, 0): pub})
    before = counters(sub, 3)
    pub.drop_next = 2
    pub.publish(batch())
    pub.publish(batch())
    tokens = prompt(11, 1)
    pub.publish(batch(*chain_events(tokens)))
    sync(sub, {(3, 0): pub})
    d = delta(before, counters(sub, 3))
    assert d["lost_batches"] == 2 and d["replays"] == 1 and d.get("replayed_batches", 0) == 0
    assert depth(core, tokens) == {(3, 0): 1}


# --------------------------------------------------------------------------- restart


def test_restarted_publisher_resets_the_rank(net):
    core = new_core((4, 2))
    sub = net.subscriber(core.apply_event)
    old = net.publisher(dp_rank=1)
    sub.add(StreamSpec(4, 1, old.endpoint, old.replay_endpoint))
    before_state, after_state = prompt(12, 3), prompt(13, 2)
    for ev in chain_events(before_state):
        old.publish(batch(ev))
    # Push the old sequence well past what the restarted publisher can reach within the bounded wait
    # (<= 5 s of probes at one per 0.1 s), so that the restart shows as the sequence going backwards.
    for _ in range(80):
        old.publish(batch())
    sync(sub, {(4, 1): old})
    assert depth(core, before_state) == {(4, 1): 3}
    before = counters(sub, 4)
    live_port, replay_port = port_of(old.endpoint), port_of(old.replay_endpoint)

    old.close(drain_timeout_s=0)
    wait_port_free(live_port)
    wait_port_free(replay_port)
    # the same base endpoints as the engine's config: TCP port + DP rank (spec §3)
    new = net.publisher(dp_rank=1, endpoint=f"tcp://127.0.0.1:{live_port - 1}",
                        replay_endpoint=f"tcp://127.0.0.1:{replay_port - 1}")
    assert new.endpoint == old.endpoint and new.next_seq == 0
    for ev in chain_events(after_state):
        new.publish(batch(ev))
    sync(sub, {(4, 1): new})

    d = delta(before, counters(sub, 4))
    assert d["restarts"] == 1 and d.get("lost_batches", 0) == 0 and d.get("gaps", 0) == 0
    assert depth(core, before_state) == {}
    assert depth(core, after_state) == {(4, 1): 2}
    assert core.index.tree_size(4, 1) == 2


class HeldReplay:
    """A replay endpoint that answers only when the test says so (the connect replays: at once, with nothing)."""

    def __init__(self, net: Net) -> None:
        self.sock = net.socket(zmq.ROUTER)
        self.sock.bind(HOST)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.held: list[bytes] = []  # the identities of the requests not answered

    def answer_all_and_probe(self, pub: KvEventPublisher) -> Callable[[], None]:
        def tick() -> None:
            self.answer_all()
            probe(pub)
        return tick

    def answer_all(self) -> None:
        while self.sock.poll(0):
            ident, _, _start = self.sock.recv_multipart()
            self.sock.send_multipart([ident, b"", SEQ_END, b""])

    def hold_one(self) -> bool:
        if not self.held and self.sock.poll(0):
            self.held.append(self.sock.recv_multipart()[0])
        return bool(self.held)

    def end_held(self) -> None:
        self.sock.send_multipart([self.held.pop(), b"", SEQ_END, b""])


def a_replay_under_way_when_the_publisher_goes_away(net: Net, answer: bool):
    """Worker 3 rank 0 far into its sequence, a gap's replay held, then its publisher closed; returns once the
    disconnect (and, with ``answer``, the replay's end marker) waits for one poll of the subscriber."""
    core = new_core((3, 1))
    sub = net.subscriber(core.apply_event, replay_timeout_s=30)
    old = net.publisher(replay=False)
    replay = HeldReplay(net)
    sub.add(StreamSpec(3, 0, old.endpoint, replay.endpoint))
    wait_until(lambda: sub.expected_seq(3, 0) == old.next_seq and old.next_seq > 0, [sub],
               tick=replay.answer_all_and_probe(old), what="the subscriber to join")
    for _ in range(80):  # far past what a restarted publisher reaches: its restart shows as seq going back
        probe(old)
    wait_until(lambda: sub.expected_seq(3, 0) == old.next_seq, [sub], tick=replay.answer_all,
               what="the subscriber to catch up")
    before = counters(sub, 3)
    old.drop_next = 1  # a gap: the subscriber asks the held endpoint and waits for its answer
    old.publish(batch())
    old.publish(batch())
    wait_until(replay.hold_one, [sub], what="the replay request")
    stream = sub._by_key[(3, 0)]
    live_port = port_of(old.endpoint)
    old.close(drain_timeout_s=0)
    pending = zmq.Poller()
    pending.register(stream.monitor, zmq.POLLIN)
    if answer:
        replay.end_held()
        pending.register(stream.dealer, zmq.POLLIN)
    deadline = time.monotonic() + TIMEOUT_S
    while len(dict(pending.poll(10))) < 1 + answer:
        assert time.monotonic() < deadline, "the disconnect (and the replay's answer) did not arrive"
    return core, sub, replay, stream, live_port, before


def test_a_publisher_that_goes_away_while_its_replay_is_answered_is_reconnected_and_followed(net, caplog):
    """The live connection drops and the replay's answer arrives in the same poll: the stream reconnects, the
    replay ends, and the stream is followed afterwards (once, the ended replay re-armed a socket not yet open).
    A publisher that went away and came back is not called a broken frame."""
    core, sub, replay, _, live_port, before = a_replay_under_way_when_the_publisher_goes_away(net, answer=True)
    sub.poll(0)
    sub.poll(0)
    wait_port_free(live_port)
    new = net.publisher(replay=False, endpoint=f"tcp://127.0.0.1:{live_port}")
    wait_until(lambda: sub.expected_seq(3, 0) == new.next_seq, [sub],
               tick=replay.answer_all_and_probe(new), what="the restarted publisher")
    tokens = prompt(21, 2)
    for ev in chain_events(tokens):
        new.publish(batch(ev))
    wait_until(lambda: depth(core, tokens) == {(3, 0): 2}, [sub], what="the restarted publisher's blocks")
    d = delta(before, counters(sub, 3))
    assert d["disconnects"] == 1 and d["replays"] == 1 and d["restarts"] == 1
    assert not [r for r in caplog.records if "stayed up" in r.getMessage()]


def test_removing_a_worker_whose_stream_reconnects_during_a_replay_closes_the_replay(net):
    _, sub, replay, stream, _, _ = a_replay_under_way_when_the_publisher_goes_away(net, answer=False)
    dealer = stream.dealer
    sub.poll(0)  # the disconnect: the stream waits to reconnect, its replay still under way
    assert stream.sub is None and dealer in sub._replaying
    sub.remove_worker(3)
    assert dealer.closed and not sub._replaying
    replay.end_held()  # an answer for a removed stream is never read
    sub.poll(50)
    assert sub.expected_seq(3, 0) is None


# --------------------------------------------------------------------------- bad input


def test_garbage_payloads_are_counted_and_survived(net):
    core = new_core((5, 1), (6, 1))
    sub = net.subscriber(core.apply_event)
    bad, good = followed(net, sub, (5, 0), (6, 0))
    sync(sub, {(5, 0): bad, (6, 0): good})
    before5, before6 = counters(sub, 5), counters(sub, 6)

    valid = encode_batch(batch(*chain_events(prompt(14, 2), per_event=2)), PROFILES[(0, 33)])
    for payload in (b"", b"\xc1\xc1", b"not msgpack at all", valid[:-7], msgspec.msgpack.encode({"ts": "x"}),
                    msgspec.msgpack.encode([1.0, [["BlockMoved", [1]]], 0])):
        bad.publish_payload(payload)
    tokens = prompt(15, 2)
    bad.publish(batch(*chain_events(tokens, per_event=2)))
    good.publish(batch(*chain_events(tokens, per_event=2)))
    sync(sub, {(5, 0): bad, (6, 0): good})

    assert delta(before5, counters(sub, 5)) == {"decode_errors": 6, "batches": 1, "events": 1, "blocks_stored": 2}
    assert delta(before6, counters(sub, 6)) == {"batches": 1, "events": 1, "blocks_stored": 2}
    assert depth(core, tokens) == {(5, 0): 2, (6, 0): 2}


def test_malformed_frames_are_counted_and_survived(net):
    core = new_core((5, 1))
    sub = net.subscriber(core.apply_event)
    raw = net.socket(zmq.PUB)
    raw.bind(HOST)
    endpoint = raw.getsockopt_string(zmq.LAST_ENDPOINT)
    sub.add(StreamSpec(5, 0, endpoint, None))
    seq = 0
    empty = encode_batch(batch(rank=0))

    def send_valid(payload=empty):
        nonlocal seq
        raw.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1

    wait_until(lambda: sub.expected_seq(5, 0) == seq, [sub], tick=send_valid, what="raw PUB handshake")
    before = counters(sub, 5)
    for frames in ([b"only one frame"], [b"", b"\x00" * 4, empty], [b"", seq.to_bytes(8, "big")],
                   [b"", seq.to_bytes(8, "big"), empty, b"extra"], [b"", b"\x00" * 9, empty]):
        raw.send_multipart(frames)
    tokens = prompt(16, 1)
    send_valid(encode_batch(batch(*chain_events(tokens), rank=0)))
    wait_until(lambda: sub.expected_seq(5, 0) == seq, [sub], what="the valid batch after the malformed frames")
    assert delta(before, counters(sub, 5)) == {"decode_errors": 5, "batches": 1, "events": 1, "blocks_stored": 1}
    assert depth(core, tokens) == {(5, 0): 1}


def test_an_oversized_frame_is_refused_and_the_stream_reconnects(net, monkeypatch, caplog):
    monkeypatch.setattr(limits, "MAX_KV_BATCH_BYTES", 64 << 10)  # read when the subscriber's socket is made
    core = new_core((5, 1))
    sub = net.subscriber(core.apply_event)
    raw = net.socket(zmq.PUB)
    raw.bind(HOST)
    sub.add(StreamSpec(5, 0, raw.getsockopt_string(zmq.LAST_ENDPOINT), None))
    seq = 0

    def send(payload):
        nonlocal seq
        raw.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1

    empty = encode_batch(batch(rank=0))
    wait_until(lambda: sub.expected_seq(5, 0) == seq, [sub], tick=lambda: send(empty), what="raw PUB handshake")
    assert sub._by_key[(5, 0)].sub.getsockopt(zmq.MAXMSGSIZE) == 64 << 10
    before = counters(sub, 5)
    send(b"\x00" * (1 << 20))  # 1 MiB: ZeroMQ drops the connection instead of buffering it
    tokens = prompt(17, 1)
    wait_until(lambda: depth(core, tokens) == {(5, 0): 1}, [sub],
               tick=lambda: send(encode_batch(batch(*chain_events(tokens), rank=0))), what="a batch after the big one")
    d = delta(before, counters(sub, 5))
    assert d["disconnects"] == 1 and d["gaps"] == 1 and d["lost_batches"] >= 1  # counted, reconnected, gap seen
    assert d.get("decode_errors", 0) == 0 and d["blocks_stored"] >= 1  # the oversized frame never reached a decoder
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "dropped" in r.getMessage()]
    assert said == ["worker 5 rank 0: the KV-event connection dropped while its publisher stayed up (an oversized "
                    "or broken frame); reconnected"], said


def test_a_publisher_that_goes_away_is_not_called_a_broken_frame(net, caplog):
    """A worker that stops (or dies) closes its KV-event connection: counted, retried, and not logged as an
    oversized or broken frame (it is what every shutdown does)."""
    core = new_core((5, 1))
    sub = net.subscriber(core.apply_event)
    raw = net.socket(zmq.PUB)
    raw.bind(HOST)
    sub.add(StreamSpec(5, 0, raw.getsockopt_string(zmq.LAST_ENDPOINT), None))
    empty = encode_batch(batch(rank=0))
    seq = 0

    def send():
        nonlocal seq
        raw.send_multipart([b"", seq.to_bytes(8, "big"), empty])
        seq += 1

    wait_until(lambda: sub.expected_seq(5, 0) == seq, [sub], tick=send, what="raw PUB handshake")
    raw.close(linger=0)
    wait_until(lambda: counters(sub, 5).get("disconnects", 0) == 1, [sub], what="the drop")
    for _ in range(20):
        sub.poll(10)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "dropped" in r.getMessage()]


def test_actor_sockets_refuse_oversized_messages_and_keep_serving():
    async def main() -> None:
        router, big, small = (message_socket(k) for k in (zmq.ROUTER, zmq.DEALER, zmq.DEALER))
        try:
            assert router.getsockopt(zmq.MAXMSGSIZE) == limits.MAX_MESSAGE_BYTES
            router.bind(HOST)
            endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            big.connect(endpoint)
            small.connect(endpoint)
            await big.send(b"\x00" * (limits.MAX_MESSAGE_BYTES + 1))
            await small.send(b"hello")
            frames = await asyncio.wait_for(router.recv_multipart(), 5)
            assert frames[1] == b"hello"
            assert await router.poll(300) == 0  # the oversized message was never delivered
        finally:
            for sock in (router, big, small):
                sock.close(linger=0)

    asyncio.run(main())


# Payloads that used to escape the consumer loop: each must be counted, and the next batch applied.
CRASHERS = {
    "deep-nesting": (b"\x91" * 5000 + b"\xc0", RecursionError),
    "medium-int": (msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], 5]], 0]), AttributeError),
    "lora-name-int": (msgspec.msgpack.encode(
        [1.0, [["BlockStored", [1], None, [1] * BS, BS, None, "GPU", 7]], 0]), AttributeError),
    "token-negative": (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [-1] * BS, BS]], 0]),
                       kvemu.InvalidArgument),
    "token-over-u32": (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [2**32] * BS, BS]], 0]),
                       kvemu.InvalidArgument),
}


@pytest.mark.parametrize("name", sorted(CRASHERS))
def test_payloads_that_crash_the_consumer(net, name, request):
    payload, _ = CRASHERS[name]
    core = new_core((5, 1))
    sub = net.subscriber(core.apply_event)
    (pub,) = followed(net, sub, (5, 0))
    sync(sub, {(5, 0): pub})
    before = counters(sub, 5)
    pub.publish_payload(payload)
    tokens = prompt(17, 1)
    pub.publish(batch(*chain_events(tokens)))
    sync(sub, {(5, 0): pub})
    d = delta(before, counters(sub, 5))
    assert d.get("decode_errors", 0) + d.get("apply_errors", 0) == 1
    assert depth(core, tokens) == {(5, 0): 1}


def test_block_size_mismatch_is_counted_per_worker_and_nothing_is_indexed(net):
    core = new_core((1, 1), (2, 1))
    sub = net.subscriber(core.apply_event)
    right, wrong = followed(net, sub, (1, 0), (2, 0))
    tokens = prompt(18, 4)
    right.publish(batch(*chain_events(tokens, per_event=2)))
    wrong_hashes = [101, 102]  # an engine with 32-token blocks: 2 blocks for the same 64 tokens
    wrong.publish(batch(BlockStored(block_hashes=wrong_hashes, parent_block_hash=None, token_ids=tokens,
                                    block_size=32)))
    wrong.publish(batch(BlockStored(block_hashes=[103], parent_block_hash=102, token_ids=prompt(19, 2),
                                    block_size=32), BlockRemoved(block_hashes=[101])))
    sync(sub, {(1, 0): right, (2, 0): wrong})
    assert sub.stats[2].block_size_mismatches == 2 and sub.stats[1].block_size_mismatches == 0
    assert sub.stats[2].blocks_stored == 0
    assert core.index.tree_size(2, 0) == 0 and not core.index.holds(2, 101, 0)
    assert depth(core, tokens) == {(1, 0): 4}


def test_remove_worker_stops_its_streams_and_keeps_its_counters(net):
    core = new_core((1, 2), (2, 1))
    sub = net.subscriber(core.apply_event)
    p10, p11, p20 = net.publisher(dp_rank=0), net.publisher(dp_rank=1), net.publisher()
    for (w, r), p in {(1, 0): p10, (1, 1): p11, (2, 0): p20}.items():
        sub.add(StreamSpec(w, r, p.endpoint, p.replay_endpoint))
    sync(sub, {(1, 0): p10, (1, 1): p11, (2, 0): p20})
    batches = sub.stats[1].batches
    sub.remove_worker(1)
    assert sub.expected_seq(1, 0) is None and sub.expected_seq(1, 1) is None
    tokens = prompt(20, 1)
    for p in (p10, p11, p20):
        p.publish(batch(*chain_events(tokens)))
    sync(sub, {(2, 0): p20})
    sub.poll(50)
    assert depth(core, tokens) == {(2, 0): 1}
    assert sub.stats[1].batches == batches
    with pytest.raises(kvemu.InvalidArgument):
        sub.add(StreamSpec(2, 0, p20.endpoint))
    sub.add(StreamSpec(1, 0, p10.endpoint, p10.replay_endpoint))  # re-adding starts afresh
    sync(sub, {(1, 0): p10})
    assert depth(core, tokens) == {(1, 0): 1, (2, 0): 1}  # replayed on connect


# --------------------------------------------------------------------------- the protocol itself


@pytest.mark.parametrize("version", ["0.22", "0.25", "0.26", "0.33"])
def test_replay_reply_shapes(net, version):
    """≤ 0.25: [id, "", seq, payload] ... [id, "", END, ""]; ≥ 0.26 adds the topic frame (spec §3)."""
    pub = net.publisher(vllm_version=version, topic="kv@t")
    first = batch(*chain_events(prompt(21, 1)), rank=0)
    payloads = [encode_batch(first, pub.profile), b"raw-1", b"raw-2"]
    pub.publish(first)
    pub.publish_payload(payloads[1])
    pub.publish_payload(payloads[2])
    dealer = net.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    topic = [b"kv@t"] if profile_for(version).replay_topic else []

    def ask(frames):
        dealer.send_multipart(frames)
        replies = []
        while dealer.poll(int(TIMEOUT_S * 1000)):
            replies.append(dealer.recv_multipart())
            if SEQ_END in replies[-1]:
                return replies
        raise AssertionError(f"no end marker; got {replies}")

    replies = ask([b"", (1).to_bytes(8, "big")])
    assert replies == [[b"", *topic, (1).to_bytes(8, "big"), payloads[1]],
                       [b"", *topic, (2).to_bytes(8, "big"), payloads[2]],
                       [b"", *([b""] if topic else []), b"\xff" * 8, b""]]
    assert ask([b"", (0).to_bytes(8, "big")])[0] == [b"", *topic, (0).to_bytes(8, "big"), payloads[0]]
    assert len(ask([b"", (99).to_bytes(8, "big")])) == 1  # nothing buffered that late: just the end
    # malformed requests are ignored (no reply at all), and the socket keeps serving
    dealer.send_multipart([b"", b"\x01"])
    dealer.send_multipart([(0).to_bytes(8, "big")])
    dealer.send_multipart([b"", (0).to_bytes(8, "big"), b"x"])
    assert not dealer.poll(200)
    assert len(ask([b"", (2).to_bytes(8, "big")])) == 2


def test_replay_buffer_keeps_the_last_buffer_steps(net):
    pub = net.publisher(buffer_steps=3)
    for i in range(6):
        pub.publish_payload(b"p%d" % i)
    dealer = net.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    got = []
    while dealer.poll(int(TIMEOUT_S * 1000)):
        frames = dealer.recv_multipart()
        if frames[-2] == SEQ_END:
            break
        got.append((int.from_bytes(frames[-2], "big"), frames[-1]))
    assert got == [(3, b"p3"), (4, b"p4"), (5, b"p5")]


def test_live_frames(net):
    """[topic, seq as 8-byte big-endian from 0, payload]; the DP rank is stamped; topic prefix filtering."""
    pub = net.publisher(topic="kv@10.0.0.1:8000@m", dp_rank=2, vllm_version="0.24")
    sub = net.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(pub.endpoint)
    other = net.socket(zmq.SUB)
    other.setsockopt(zmq.SUBSCRIBE, b"other")
    other.connect(pub.endpoint)
    received = []

    def drain():
        while sub.poll(0):
            received.append(sub.recv_multipart())

    wait_until(lambda: (drain(), received)[1], tick=lambda: probe(pub), what="first live frame")
    first_seq = int.from_bytes(received[0][1], "big")
    events = chain_events(prompt(22, 2), per_event=2)
    pub.publish(batch(*events))
    wait_until(lambda: (drain(), received[-1][1] == (pub.next_seq - 1).to_bytes(8, "big"))[1],
               what="the store batch")
    topic, seq, payload = received[-1]
    assert topic == b"kv@10.0.0.1:8000@m" and len(seq) == 8
    assert [int.from_bytes(f[1], "big") for f in received] == list(range(first_seq, pub.next_seq))
    decoded = msgspec.msgpack.decode(payload)
    assert decoded[2] == 2 and decoded[1][0]["type"] == "BlockStored"  # rank stamped, 0.24 map events
    assert payload == encode_batch(KVEventBatch(ts=decoded[0], events=events, data_parallel_rank=2),
                                   PROFILES[(0, 24)])
    assert not other.poll(50)
    assert pub.stats.published == pub.next_seq and pub.stats.dropped == 0


def test_first_sequence_number_is_zero(net):
    pub = net.publisher(replay=True)
    assert pub.next_seq == 0
    pub.publish(batch())
    dealer = net.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    assert dealer.poll(int(TIMEOUT_S * 1000))
    assert dealer.recv_multipart()[-2] == (0).to_bytes(8, "big")


@pytest.mark.parametrize("version", ["0.11", "0.24", "0.33"])
def test_bytes_hashes_index_the_same_blocks_as_int_hashes(net, version):
    """One worker publishes block hashes as digest bytes (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), one
    as integers, the same events (a gap repaired by replay among them): the index holds the same blocks."""
    core = new_core((1, 1), (2, 1))
    sub = net.subscriber(core.apply_event)
    pubs = {1: net.publisher(vllm_version=version), 2: net.publisher(vllm_version=version, hash_form="bytes")}
    for worker_id, pub in pubs.items():
        sub.add(StreamSpec(worker_id, 0, pub.endpoint, pub.replay_endpoint))
    streams = {(w, 0): p for w, p in pubs.items()}
    sync(sub, streams)
    before = {w: counters(sub, w) for w in pubs}
    tokens, other = prompt(40, 4), prompt(41, 2)
    hashes = hashes_of(tokens)
    for pub in pubs.values():
        a, b, c, d = chain_events(tokens)
        pub.publish(batch(a))
        pub.drop_next = 1
        pub.publish(batch(b))  # not sent live: only the replay brings it
        pub.publish(batch(c, *chain_events(other, per_event=2)))
        pub.publish(batch(d))
        pub.publish(batch(BlockRemoved(block_hashes=[hashes[3]])))
    sync(sub, streams)

    assert depth(core, tokens) == {(1, 0): 3, (2, 0): 3}
    assert depth(core, other) == {(1, 0): 2, (2, 0): 2}
    for h in hashes + hashes_of(other):
        assert core.index.holds(1, h, 0) == core.index.holds(2, h, 0)
    assert core.index.tree_size(1, 0) == core.index.tree_size(2, 0) == 5
    d1, d2 = delta(before[1], counters(sub, 1)), delta(before[2], counters(sub, 2))
    assert d1 == d2 and d1["gaps"] == 1 and d1["blocks_stored"] == 6 and d1["blocks_removed"] == 1
    assert counters(sub, 2)["decode_errors"] == 0 and counters(sub, 2)["apply_errors"] == 0

    # what went out: every hash a 32-byte digest ending in the integer hash (read back through a replay)
    dealer = net.socket(zmq.DEALER)
    dealer.connect(pubs[2].replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    payloads = []
    while True:
        assert dealer.poll(int(TIMEOUT_S * 1000)), "no replay reply"
        frames = dealer.recv_multipart()
        if frames[-2] == SEQ_END:
            break
        payloads.append(frames[-1])
    sent = [msgspec.msgpack.decode(p)[1] for p in payloads]
    stored = [e for events in sent for e in events
              if (e["type"] if isinstance(e, dict) else e[0]) == "BlockStored"]
    wire_hashes = [h for e in stored for h in (e["block_hashes"] if isinstance(e, dict) else e[1])]
    assert len(wire_hashes) == 6 and all(type(h) is bytes and len(h) == 32 for h in wire_hashes)
    assert {int.from_bytes(h[-8:], "big") for h in wire_hashes} == set(hashes + hashes_of(other))


def test_bytes_hashes_before_vllm_0_11_are_refused(net):
    with pytest.raises(kvemu.InvalidArgument, match="bytes hashes need vLLM 0.11"):
        net.publisher(vllm_version="0.10", hash_form="bytes")
    with pytest.raises(kvemu.InvalidArgument, match="bytes hashes need vLLM 0.11"):
        MemoryKvBus(vllm_version="0.9", hash_form="bytes")
    assert MemoryKvBus(vllm_version="0.11", hash_form="bytes").publisher(0, 0).profile.bytes_hashes


# --------------------------------------------------------------------------- a consumer nobody here wrote


async def _dynamo_overlaps(svc, tokens) -> dict[tuple[int, int], int]:
    scores = await svc.overlap_scores({"model_name": "m", "token_ids": tokens})
    return {(w["worker_id"], w["dp_rank"]): w["device_blocks"] for w in scores["workers"] if w["device_blocks"]}


@pytest.mark.reference
@pytest.mark.parametrize("versions", [("0.33", "0.33"), ("0.22", "0.22"), ("0.25", "0.10")], ids="-".join)
def test_dynamo_selection_service_agrees_with_kvemu(net, versions, dynamo_core):
    dynamo = dynamo_core
    core = new_core((5, 2))
    sub = net.subscriber(core.apply_event)
    pubs = {r: net.publisher(dp_rank=r, vllm_version=v) for r, v in enumerate(versions)}
    for r, p in pubs.items():
        sub.add(StreamSpec(5, r, p.endpoint, p.replay_endpoint))
    probes = {r: prompt(300 + r, 1) for r in pubs}
    markers = {r: prompt(400 + r, 1) for r in pubs}
    shared, alt, gone = prompt(30, 5), prompt(31, 3), prompt(32, 2)
    fork = shared[: 2 * BS] + prompt(33, 2)

    async def scenario():
        svc = dynamo.SelectionService()
        try:
            await svc.upsert_worker({
                "worker_id": 5, "model_name": "m", "endpoint": "x", "block_size": BS,
                "data_parallel_start_rank": 0, "data_parallel_size": 2,
                "kv_events_endpoints": {r: p.endpoint for r, p in pubs.items()},
            })

            async def wait_both(tokens_by_rank, what):
                deadline = time.monotonic() + TIMEOUT_S
                next_tick = 0.0
                while True:
                    sub.poll(0)
                    ok = True
                    for r, t in tokens_by_rank.items():
                        ok = ok and (await _dynamo_overlaps(svc, t)).get((5, r)) == len(t) // BS
                    if ok and all(sub.expected_seq(5, r) == p.next_seq for r, p in pubs.items()):
                        return
                    if time.monotonic() > deadline:
                        raise AssertionError(f"timed out waiting for {what}")
                    if time.monotonic() >= next_tick and what == "probes":
                        for r, p in pubs.items():  # the same store again until both consumers have it
                            p.publish(batch(*chain_events(probes[r])))
                        next_tick = time.monotonic() + 0.1
                    await asyncio.sleep(0.02)

            await wait_both(probes, "probes")  # both consumers connected

            # rank 0: shared prompt in two steps, a fork off block 1, evict the fork's leaf
            pubs[0].publish(batch(*chain_events(shared, last=3)))
            pubs[0].publish(batch(*chain_events(shared, first=3, per_event=2)))
            pubs[0].publish(batch(*chain_events(fork, first=2, per_event=2)))
            pubs[0].publish(batch(BlockRemoved(block_hashes=[hashes_of(fork)[3]])))
            pubs[0].publish(batch(BlockRemoved(block_hashes=[hashes_of(shared)[4]])))
            # rank 1: a prompt that is then cleared, then the shared prefix and another prompt
            pubs[1].publish(batch(*chain_events(gone, per_event=2)))
            pubs[1].publish(batch(AllBlocksCleared()))
            pubs[1].publish(batch(*chain_events(shared, last=2, per_event=2), *chain_events(alt, per_event=3)))
            pubs[1].publish(batch(BlockRemoved(block_hashes=[hashes_of(alt)[2]])))
            for r, p in pubs.items():
                p.publish(batch(*chain_events(markers[r])))
            await wait_both(markers, "markers")  # per-socket order: everything before them is applied

            for tokens in (shared, fork, alt, gone, *probes.values(), *markers.values()):
                assert await _dynamo_overlaps(svc, tokens) == depth(core, tokens)
            out = {}
            for name, t in (("shared", shared), ("fork", fork), ("alt", alt), ("gone", gone), ("p1", probes[1])):
                out[name] = await _dynamo_overlaps(svc, t)
            return out
        finally:
            svc.shutdown()

    got = asyncio.run(scenario())
    # and what that is, so that agreement is not agreement on nothing
    assert got == {"shared": {(5, 0): 4, (5, 1): 2}, "fork": {(5, 0): 3, (5, 1): 2}, "alt": {(5, 1): 2},
                   "gone": {}, "p1": {}}


def test_a_replay_endpoint_that_streams_without_end_is_bounded_counted_and_backed_off(net):
    """A hostile replay endpoint that answers with an endless stream (no end marker) must cost one bounded
    wait, be counted, and not be asked again for a while: later gaps are counted lost at once."""
    core = new_core((3, 1))
    sub = net.subscriber(core.apply_event, replay_timeout_s=0.3)
    pub = net.publisher(replay=False)
    hostile = net.socket(zmq.ROUTER)
    hostile.bind(HOST)
    stop = threading.Event()
    armed = threading.Event()  # hostile only once the subscriber has joined
    asked = []

    def flood():  # answers every request with batches before the one asked for, forever
        while not stop.is_set():
            if hostile.poll(20):
                ident, _, start = hostile.recv_multipart()
                if not armed.is_set():  # a gap while the subscriber joins (a busy machine): nothing to replay
                    hostile.send_multipart([ident, b"", SEQ_END, b""])
                    continue
                asked.append(int.from_bytes(start, "big"))
                while not stop.is_set():
                    try:
                        hostile.send_multipart([ident, b"", (0).to_bytes(8, "big"), b"junk"], zmq.NOBLOCK)
                    except zmq.Again:
                        time.sleep(0.001)
                    if hostile.poll(0):
                        break

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        sub.add(StreamSpec(3, 0, pub.endpoint, hostile.getsockopt_string(zmq.LAST_ENDPOINT)))
        sync(sub, {(3, 0): pub})
        armed.set()
        before = counters(sub, 3)
        for _ in range(2):  # two gaps in a row
            pub.drop_next = 2
            pub.publish(batch())
            pub.publish(batch())
            pub.publish(batch())
            t0 = time.monotonic()
            sync(sub, {(3, 0): pub})
            assert time.monotonic() - t0 < 2.0  # bounded: one replay_timeout, not forever
        d = delta(before, counters(sub, 3))
        assert d["replay_failures"] == 1 and d["lost_batches"] == 4 and d["gaps"] == 2
        assert len(asked) == 1  # the second gap did not ask the endpoint again
    finally:
        stop.set()
        thread.join(5)


# --------------------------------------------------------------------------- replay peers that never read


def test_replay_peers_that_never_read_are_bounded_and_a_reading_peer_is_still_answered():
    """Each peer's queue holds at most replay_hwm messages (the rest waits as a cursor into the shared buffer),
    at most max_replay_peers answers are under way (others refused, counted), and a stalled answer is
    abandoned (counted) so that a peer that reads is answered. Before: every peer got its whole answer queued
    (SNDHWM 2 x buffer), 300 such peers took a worker to 187 MB."""
    from kvemu.wire.publisher import MAX_REPLAY_PEERS, REPLAY_HWM

    assert (MAX_REPLAY_PEERS, REPLAY_HWM) == (32, 1000)  # the documented defaults
    ctx = zmq.Context()
    steps, size = 300, 60_000  # 18 MB of replay buffer; pyzmq copies payloads under 64 KB into each queue
    pub = KvEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", bind=True, context=ctx,
                           buffer_steps=steps, max_replay_peers=2, replay_hwm=4, replay_stall_s=1.0)
    peers = []
    try:
        for s in range(steps):
            pub.publish_payload(bytes([s % 251]) * size)

        def peer() -> zmq.Socket:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(pub.replay_endpoint)
            peers.append(sock)
            return sock

        for _ in range(5):  # they ask for everything and never read
            peer().send_multipart([b"", (0).to_bytes(8, "big")])
        deadline = time.monotonic() + 10
        while pub.stats.replay_requests < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        assert pub.stats.replay_requests == 5 and pub.stats.replays_refused == 3
        # what the two answered peers were sent: their queue and what the kernel's socket buffers took, not 300
        assert pub.stats.replayed_batches < steps, pub.stats.as_dict()
        reader = peer()
        reader.setsockopt(zmq.RCVHWM, 1000)
        got, deadline = [], time.monotonic() + 20
        while time.monotonic() < deadline:  # refused while the stuck answers hold their slots; then answered
            reader.send_multipart([b"", (0).to_bytes(8, "big")])
            if reader.poll(1500):
                while True:
                    frames = reader.recv_multipart()
                    if frames[-2] == SEQ_END:
                        break
                    got.append(int.from_bytes(frames[-2], "big"))
                break
        assert got == list(range(steps))
        assert pub.stats.replays_abandoned == 2
    finally:
        for sock in peers:
            sock.close(linger=0)
        pub.close()
        ctx.term()
