"""Replica sync over ZeroMQ (127.0.0.1): a peer's batch reaches the other replica's load view after the delay; a
message is accepted only from the peer its socket belongs to; malformed and oversize ones are dropped, counted."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import anyio
import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvemu.clock import WallClock
from kvemu.load import LoadTracker
from kvemu.replica_sync import MAX_SYNC_BATCH_EVENTS, SyncBatch, SyncBook, SyncFree
from kvemu.runtime.loop import run_live
from kvemu.runtime.replica_sync_zmq import ZmqSyncLink, wire_messages


def _core() -> Any:
    return SimpleNamespace(load=LoadTracker(), approx=None, load_listener=None)


def _peer_key(origin: int, rid: str) -> str:
    return f"\x00{origin}\x00{rid}"


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    with anyio.fail_after(timeout_s):
        while not cond():
            await anyio.sleep(0.005)


def test_a_peers_bookings_and_frees_reach_the_other_replica_after_the_delay() -> None:
    async def main() -> None:
        a = ZmqSyncLink(0, WallClock(), delay_ns=50_000_000)
        b = ZmqSyncLink(1, WallClock(), delay_ns=0)
        core_a, core_b = _core(), _core()
        woken: list[int] = []
        a.attach(core_a, lambda: None)
        b.attach(core_b, lambda: woken.append(1))
        a.connect(1, b.endpoint)
        b.connect(0, a.endpoint)
        async with anyio.create_task_group() as tg:
            await tg.start(a.serve)
            await tg.start(b.serve)
            await anyio.sleep(0.3)  # (the SUBs' connections: a PUB sends only to subscribers it has)
            t = time.monotonic()
            core_a.load_listener.booked("r1", (3, 0), [11, 12], 100, [], [])
            await _until(lambda: _peer_key(0, "r1") in core_b.load)
            assert time.monotonic() - t >= 0.045  # the batch left delay_ms after its first event
            assert core_b.load.booked_rank(_peer_key(0, "r1")) == (3, 0)
            assert not woken  # a booking adds load: nothing to wake for
            core_a.load_listener.freed("r1")
            await _until(lambda: _peer_key(0, "r1") not in core_b.load)
            assert woken  # a free took load off a rank: the lifecycle looks at its queue again
            assert "r1" not in core_a.load  # (a replica never applies its own)
            tg.cancel_scope.cancel()
        assert a.stats()["announced"] == 2 and a.stats()["batches_sent"] == 2
        assert b.stats()["applied"] == 2 and b.stats()["batches_applied"] == 2
        await a.aclose()
        await b.aclose()

    run_live(main)


def test_only_the_sockets_own_peer_is_believed_and_bad_messages_do_no_harm() -> None:
    async def main() -> None:
        link = ZmqSyncLink(0, WallClock(), delay_ns=0, max_bytes=4096)
        core = _core()
        link.attach(core, lambda: None)
        enc = msgspec.msgpack.encode
        book = SyncBook("r", 1, 0, [5], 10)
        assert not link.receive(1, enc(SyncBatch(2, [book])))  # replica 2's batch on replica 1's socket
        assert not link.receive(0, enc(SyncBatch(0, [book])))  # (its own origin, on no peer's socket)
        assert link.counts["dropped_foreign"] == 2 and len(core.load) == 0
        assert not link.receive(1, b"\xc1 not msgpack")
        assert not link.receive(1, enc({"type": "sync_batch", "origin": 1, "events": [["book", "x"]]}))
        assert not link.receive(1, enc({"type": "sync_batch", "origin": 99, "events": []}))  # past MAX_REPLICAS
        assert link.counts["dropped_malformed"] == 3
        assert not link.receive(1, b"\x00" * 5000)
        assert link.counts["dropped_oversize"] == 1 and len(core.load) == 0
        assert link.receive(1, enc(SyncBatch(1, [book])))  # and the link still works
        assert _peer_key(1, "r") in core.load
        await link.aclose()

    run_live(main)


def test_a_large_batch_leaves_split_within_the_bounds_and_whole() -> None:
    events = [SyncBook(f"r{i}", 0, 0, list(range(20)), 5) for i in range(MAX_SYNC_BATCH_EVENTS + 10)]
    events.append(SyncBook("huge", 0, 0, list(range(1 << 20, (1 << 20) + 20_000)), 5))  # alone past the bound: left out, counted
    events.append(SyncFree("r0"))
    messages, left_out = wire_messages(SyncBatch(2, events), max_bytes=64 << 10)
    decoded = [msgspec.msgpack.decode(m, type=SyncBatch) for m in messages]
    assert left_out == 1 and all(len(m) <= 64 << 10 for m in messages) and len(messages) > 2
    assert all(b.origin == 2 and len(b.events) <= MAX_SYNC_BATCH_EVENTS for b in decoded)
    assert [e for b in decoded for e in b.events] == [e for e in events if e.request_id != "huge"]


_events = st.lists(st.one_of(
    st.builds(SyncBook, st.text(max_size=8), st.integers(0, 9), st.integers(0, 3),
              st.lists(st.integers(0, (1 << 64) - 1), max_size=300), st.integers(0, 1 << 20)),
    st.builds(SyncFree, st.text(max_size=8))), max_size=60)


@settings(max_examples=200, deadline=None)
@given(_events, st.integers(64, 4096))
def test_wire_messages_keep_every_event_that_fits_in_order(events, max_bytes) -> None:
    messages, left_out = wire_messages(SyncBatch(1, events), max_bytes=max_bytes)
    assert all(len(m) <= max_bytes for m in messages)
    sent = [e for m in messages for e in msgspec.msgpack.decode(m, type=SyncBatch).events]
    too_big = [e for e in events if len(msgspec.msgpack.encode(SyncBatch(1, [e]))) > max_bytes]
    assert left_out == len(too_big) and sent == [e for e in events if e not in too_big]
