"""``EventStream`` on its own: gaps, restarts and replays, answered at once or later, against a model.

A publisher numbers batches 0, 1, 2...; some never arrive. A replay is answered either at once (an in-memory
buffer) or later (a socket), completely, partly, or not at all. Whatever the schedule, every batch up to the
newest delivered one is applied exactly once, in order, or counted lost; none is applied twice.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvemu.wire.stream import EventStream, WorkerEventStats


class Recording(EventStream):
    """Records the sequence numbers it applies instead of decoding payloads."""

    def apply(self, seq, payload):
        self.applied.append(seq)


class Replies:
    """The replay side: asks are recorded; answered at once (``sync``) or when the test says."""

    def __init__(self, sync: bool, keep_from: int = 0) -> None:
        self.sync = sync
        self.keep_from = keep_from  # the publisher's buffer lost what came before
        self.published: list[int] = []
        self.asked: list[int] = []

    def __call__(self, start):
        self.asked.append(start)
        if self.sync:
            return [(s, None) for s in self.published if s >= max(start, self.keep_from)]
        return None


def stream(replies, **kw) -> Recording:
    s = Recording(1, 0, sink=lambda ev: None, block_size=4, stats=WorkerEventStats(), replay=replies, **kw)
    s.applied = []
    return s


@settings(max_examples=300, deadline=None)
@given(
    delivered=st.lists(st.booleans(), min_size=1, max_size=40),
    sync=st.booleans(),
    answers=st.lists(st.sampled_from(["all", "part", "none", "wait"]), max_size=40),
    keep_from=st.integers(0, 5),
)
def test_every_batch_is_applied_once_in_order_or_counted_lost(delivered, sync, answers, keep_from):
    replies = Replies(sync, keep_from)
    s = stream(replies)
    answers = iter(answers)

    def answer_pending():
        if not s.replaying:
            return
        how = next(answers, "all")
        if how == "wait":
            return
        start = replies.asked[-1]
        buffered = [q for q in replies.published if q >= max(start, keep_from)]
        if how == "part":
            buffered = buffered[: len(buffered) // 2]
        for q in buffered if how != "none" else ():
            if not s.replay_batch(q, None):
                break
        s.replay_end()

    last = -1
    for seq, arrives in enumerate(delivered):
        replies.published.append(seq)
        if arrives:
            s.receive(seq, None)
            last = seq
        answer_pending()
    while s.replaying:  # the transport's deadline ends whatever is still open
        s.replay_end()

    assert s.applied == sorted(set(s.applied))  # in order, none twice
    assert len(s.applied) + s.stats.lost_batches == last + 1  # everything up to the newest: applied or lost
    assert s.expected == (last + 1 if last >= 0 else None)
    if sync and keep_from == 0:  # a complete, immediate replay loses nothing
        assert s.applied == list(range(last + 1)) and s.stats.lost_batches == 0


def test_live_batches_wait_for_the_replay_and_follow_it():
    replies = Replies(sync=False)
    s = stream(replies)
    replies.published += [0, 1, 2, 3, 4]
    s.receive(0, None)
    s.receive(3, None)  # 1 and 2 missed: a replay is asked for
    assert s.replaying and replies.asked == [1]
    s.receive(4, None)  # held behind the replay
    assert s.applied == [0]
    assert s.replay_batch(0, None)  # before the range asked for: ignored
    assert s.replay_batch(1, None)
    assert not s.replay_batch(2, None)  # the last one asked for: the replay needs no more
    assert not s.replay_batch(3, None)  # past the range: never applied by the replay
    s.replay_end()
    assert s.applied == [0, 1, 2, 3, 4] and not s.replaying
    assert (s.stats.gaps, s.stats.replays, s.stats.replayed_batches, s.stats.lost_batches) == (1, 1, 2, 0)


def test_a_failed_replay_counts_its_range_lost_and_the_stream_goes_on():
    replies = Replies(sync=False)
    s = stream(replies)
    s.receive(0, None)
    s.receive(5, None)
    s.receive(6, None)
    s.replay_end()  # the transport gave up: nothing came
    assert s.applied == [0, 5, 6] and s.stats.lost_batches == 4


def test_a_restart_during_a_replay_is_handled_after_it():
    replies = Replies(sync=False)
    s = stream(replies)
    replies.published += [0, 1, 2]
    s.receive(0, None)
    s.receive(2, None)  # gap: replay of 1
    s.receive(1, None)  # a restarted engine's batch 1 arrives while waiting: held
    s.replay_batch(1, None)
    s.replay_end()
    # 1 (replayed), 2 (live); then the held batch 1 goes backwards: a restart, which asks for 0 again
    assert s.applied == [0, 1, 2] and s.stats.restarts == 1 and s.replaying and replies.asked == [1, 0]
    s.replay_batch(0, None)
    s.replay_end()
    assert s.applied == [0, 1, 2, 0, 1] and s.expected == 2


def _payload(seq: int, epoch: int = 0) -> bytes:
    return f"epoch {epoch} batch {seq}".encode()


@settings(max_examples=300, deadline=None)
@given(
    joined=st.integers(0, 10),
    answered_after=st.integers(0, 10),
    read_during=st.integers(0, 10),
    later=st.integers(0, 10),
)
def test_batches_a_rebuild_brings_and_the_live_socket_delivers_too_are_applied_once(
        joined, answered_after, read_during, later):
    """A router connects: batches before ``joined`` reach it only by the rebuilding replay; those published
    after the subscription took effect but before the replay was answered come both ways. None is applied
    twice, none is mistaken for a restart, none is lost."""
    published: list[int] = []
    live: list[int] = []  # delivered by the live socket, not yet read
    s = stream(lambda start: None)

    def publish(k: int) -> None:
        for _ in range(k):
            seq = len(published)
            published.append(seq)
            if seq >= joined:
                live.append(seq)

    def read(k: int) -> None:
        for _ in range(min(k, len(live))):
            seq = live.pop(0)
            s.receive(seq, _payload(seq))

    publish(joined)
    s.sync()  # the connection's handshake
    publish(answered_after)
    read(read_during)  # held behind the replay
    for seq in published:
        assert s.replay_batch(seq, _payload(seq))
    s.replay_end()
    publish(later)
    read(len(live))
    assert s.applied == list(range(len(published)))
    assert (s.stats.restarts, s.stats.lost_batches, s.stats.gaps) == (0, 0, 0)


def test_a_restart_just_after_a_rebuild_is_still_a_restart():
    cleared = []
    s = Recording(1, 0, sink=cleared.append, block_size=4, stats=WorkerEventStats(), replay=lambda start: None)
    s.applied = []
    s.sync()
    for seq in range(3):
        s.replay_batch(seq, _payload(seq))
    s.replay_end()
    s.receive(2, _payload(2))  # the live copy of a replayed batch: skipped
    assert s.applied == [0, 1, 2] and s.stats.restarts == 0 and not cleared
    s.receive(0, _payload(0, epoch=1))  # a restarted engine's first batch: same number, other content
    assert s.stats.restarts == 1 and len(cleared) == 1 and s.applied == [0, 1, 2, 0] and s.expected == 1


def test_once_a_newer_live_batch_arrived_an_older_one_is_a_restart_even_if_replayed():
    s = stream(lambda start: None)
    s.sync()
    for seq in range(3):
        s.replay_batch(seq, _payload(seq))
    s.replay_end()
    s.receive(3, _payload(3))
    s.receive(1, _payload(1))  # the overlap is over: going backwards now means the engine restarted
    assert s.stats.restarts == 1 and s.replaying


def test_an_in_process_batch_repeating_a_hash_is_refused_whole_by_the_index_and_counted() -> None:
    """The stream does not check a router-model batch's chain again (kvemu's engine made it); the index does, and
    refuses it whole: nothing is indexed, one apply error is counted, and the stream goes on."""
    from kvemu.index import PrefixIndex
    from kvemu.router_events import BlocksStored, EventBatch, apply_event

    index = PrefixIndex()

    def sink(event) -> None:
        apply_event(index, event)

    stats = WorkerEventStats()
    stream = EventStream(1, 0, sink=sink, block_size=4, stats=stats, replay_on_connect=False)
    stream.receive(0, EventBatch(ts_ns=0, dp_rank=0, block_size=4,
                                 events=[BlocksStored(block_hashes=[7, 8, 7], local_hashes=[1, 2, 3])]))
    stream.receive(1, EventBatch(ts_ns=0, dp_rank=0, block_size=4,
                                 events=[BlocksStored(block_hashes=[7, 8], local_hashes=[1, 2])]))
    assert stats.apply_errors == 1 and stats.blocks_stored == 2
    assert index.find_matches([1, 2, 3]) == {(1, 0): 2}
