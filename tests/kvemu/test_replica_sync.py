"""Replica sync (``kvemu.replica_sync``): a peer's load view holds what the origin booked, and nothing else."""

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvemu.approx import ApproxIndex
from kvemu.clock import ManualClock
from kvemu.load import LoadTracker
from kvemu.replica_sync import (PEER_BOOKING_TTL_NS, SyncBatch, SyncBook, SyncFree, SyncInbox, SyncOutbox,
                                SyncPrefillDone)

RANKS = [(0, 0), (0, 1), (1, 0)]


def view(load: LoadTracker) -> dict:
    """What the selector reads of each rank (the order bookings came in does not matter)."""
    return {k: (rl.active_requests, rl.active_prefill_tokens, rl.prefilling, rl.distinct_blocks)
            for k, rl in sorted(load.ranks().items()) if rl.active_requests}


class SyncMachine(RuleBasedStateMachine):
    """An origin replica books, completes prefills and frees; a peer with bookings of its own applies the
    origin's batches; once every batch is delivered the peer's view equals both replicas' bookings applied to one
    tracker."""

    def __init__(self) -> None:
        super().__init__()
        self.origin = LoadTracker()
        self.outbox = SyncOutbox(0)
        self.opened = 0
        self.closed = 0
        self.outbox.on_open = self._opened
        self.peer = LoadTracker()
        self.inbox = SyncInbox(1, self.peer)
        self.model: dict[str, list] = {}  # the origin's open bookings: [key, blocks, prefill]
        self.local: dict[str, list] = {}  # the peer's own
        self.in_flight: list[SyncBatch] = []
        self.now = 0
        self.next = 0

    def _opened(self) -> None:
        self.opened += 1

    def _id(self) -> str:
        self.next += 1
        return f"r{self.next}"

    @rule(key=st.sampled_from(RANKS), blocks=st.lists(st.integers(0, 6), max_size=5), prefill=st.integers(0, 50))
    def book(self, key, blocks, prefill):
        rid = self._id()
        self.origin.add(rid, key, blocks, prefill, now_ns=self.now)
        self.outbox.booked(rid, key, list(blocks), prefill, [], [])
        self.model[rid] = [key, blocks, prefill]

    @rule(key=st.sampled_from(RANKS), blocks=st.lists(st.integers(0, 6), max_size=5), prefill=st.integers(0, 50))
    def book_locally_on_the_peer(self, key, blocks, prefill):
        rid = f"r{self.next}"  # (the origin's latest id: the peer's keys stay apart from it)
        if rid in self.local:
            return
        self.peer.add(rid, key, blocks, prefill, now_ns=self.now)
        self.local[rid] = [key, blocks, prefill]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def prefill_done(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        if self.origin.mark_prefill_completed(rid):
            self.outbox.prefill_done(rid)
            self.model[rid][2] = 0

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        assert self.origin.free(rid) is not None
        self.outbox.freed(rid)
        del self.model[rid]

    @rule()
    def close_batch(self):
        batch = self.outbox.take()
        if batch is not None:
            self.in_flight.append(batch)
            self.closed += 1

    @precondition(lambda self: self.in_flight)
    @rule()
    def deliver_the_oldest(self):
        self.now += 1000
        self.inbox.apply(self.in_flight.pop(0), self.now)

    @rule()
    def its_own_batch_changes_nothing(self):
        before = view(self.peer)
        self.inbox.apply(SyncBatch(1, [SyncFree(r) for r in sorted(self.local)]), self.now)
        assert view(self.peer) == before

    @invariant()
    def a_batch_opens_once(self):
        assert self.opened == self.closed + (1 if self.outbox.events else 0)

    @invariant()
    def once_delivered_the_peer_sees_both(self):
        if self.in_flight or self.outbox.events:
            return
        reference = LoadTracker()
        for rid, (key, blocks, prefill) in [*self.model.items(), *(("local-" + r, v) for r, v in self.local.items())]:
            reference.add(rid, key, blocks, prefill)
        assert view(self.peer) == view(reference)
        assert self.inbox.ignored == self.inbox.refused == 0


TestSyncMachine = SyncMachine.TestCase
TestSyncMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_an_event_about_an_unknown_request_changes_nothing():
    peer = LoadTracker()
    inbox = SyncInbox(1, peer)
    inbox.apply(SyncBatch(0, [SyncPrefillDone("x"), SyncFree("x")]), 5)
    assert len(peer) == 0 and inbox.ignored == 2 and inbox.applied == 0


def test_a_repeated_booking_is_refused_and_counted():
    peer = LoadTracker()
    inbox = SyncInbox(1, peer)
    book = SyncBook("x", 0, 0, [1, 2], 10)
    inbox.apply(SyncBatch(0, [book, book]), 5)
    assert len(peer) == 1 and inbox.refused == 1
    assert view(peer) == {(0, 0): (1, 10, 1, 2)}


def test_two_peers_may_book_the_same_request_id():
    """Client ids are unique per replica, not across them: each origin's bookings are kept apart."""
    peer = LoadTracker()
    inbox = SyncInbox(2, peer)
    inbox.apply(SyncBatch(0, [SyncBook("x", 0, 0, [1], 4)]), 5)
    inbox.apply(SyncBatch(1, [SyncBook("x", 1, 0, [1], 4)]), 5)
    inbox.apply(SyncBatch(0, [SyncFree("x")]), 6)
    assert view(peer) == {(1, 0): (1, 4, 1, 1)}


def test_a_peer_booking_whose_free_never_came_expires():
    peer = LoadTracker()
    inbox = SyncInbox(1, peer)
    inbox.apply(SyncBatch(0, [SyncBook("dead", 0, 0, [1], 4)]), 0)
    inbox.apply(SyncBatch(0, [SyncBook("alive", 0, 0, [2], 4)]), PEER_BOOKING_TTL_NS - 1)
    inbox.apply(SyncBatch(0, []), PEER_BOOKING_TTL_NS)
    assert inbox.expired == 1
    assert view(peer) == {(0, 0): (1, 4, 1, 1)}


def test_a_rebooked_id_is_not_expired_by_its_first_booking():
    peer = LoadTracker()
    inbox = SyncInbox(1, peer)
    inbox.apply(SyncBatch(0, [SyncBook("x", 0, 0, [1], 4), SyncFree("x")]), 0)
    inbox.apply(SyncBatch(0, [SyncBook("x", 0, 1, [1], 4)]), 10)
    inbox.apply(SyncBatch(0, []), PEER_BOOKING_TTL_NS + 5)
    assert inbox.expired == 0 and len(peer) == 1


def test_predictions_reach_a_peers_approximate_index():
    clock = ManualClock()
    index = ApproxIndex(clock, ttl_secs=60.0)
    out = SyncOutbox(0, predictions=True)
    out.booked("x", (3, 1), [11, 12], 32, [5, 6], [11, 12])
    inbox = SyncInbox(1, LoadTracker(), index)
    inbox.apply(out.take(), 0)
    assert index.index.find_matches([5, 6]) == {(3, 1): 2}
    plain = SyncOutbox(0)
    plain.booked("y", (3, 1), [11], 16, [5], [11])
    assert plain.take().events[0].seq_hashes == []


def test_the_wire_form_round_trips_and_is_bounded():
    batch = SyncBatch(3, [SyncBook("a", 1, 0, [1 << 63], 7), SyncPrefillDone("a"), SyncFree("a")])
    data = msgspec.msgpack.encode(batch)
    assert msgspec.msgpack.decode(data, type=SyncBatch) == batch
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"type": "sync_batch", "origin": 64, "events": []}),
                               type=SyncBatch)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(SyncBatch(0, [SyncFree("a")] * 4097)), type=SyncBatch)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(
            {"type": "sync_batch", "origin": 0, "events": [["book", "a", -1, 0, [], 0]]}), type=SyncBatch)
