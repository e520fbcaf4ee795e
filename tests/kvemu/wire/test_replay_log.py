"""The publishers' shared core: sequence numbers, the bounded replay buffer and held-back batches."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvemu.errors import InvalidArgument
from kvemu.wire.replay_log import ReplayLog


@given(steps=st.integers(1, 6), ops=st.lists(st.one_of(st.just("append"), st.integers(0, 3), st.just("restart")),
                                            max_size=40))
def test_replay_log_against_a_list_model(steps, ops):
    log: ReplayLog[str] = ReplayLog(steps)
    seq, kept, held = 0, [], 0
    for op in ops:
        if op == "append":
            got = log.append(f"p{seq}")
            assert got == (seq, held == 0)
            held = max(0, held - 1)
            kept = (kept + [(seq, f"p{seq}")])[-steps:]
            seq += 1
        elif op == "restart":
            log.restart()
            seq, kept = 0, []
        else:
            log.drop_next = held = op
        assert log.next_seq == seq
        for start in range(seq + 2):
            assert log.since(start) == [(s, p) for s, p in kept if s >= start]


def test_a_replay_log_needs_room_for_one_batch():
    with pytest.raises(InvalidArgument, match="buffer_steps"):
        ReplayLog(0)


def test_a_lagging_publisher_numbers_its_batches_when_it_publishes_them_in_order():
    from kvemu.clock import ManualClock
    from kvemu.runtime.kv_bus import MemoryKvBus
    from kvemu.runtime.loop import run_virtual
    from kvemu.kv_events import AllBlocksCleared, KVEventBatch

    clock = ManualClock()
    bus = MemoryKvBus(lag_ns=5_000_000)
    got: list[tuple[int, int, int]] = []
    bus.connect(lambda w, r, seq, payload: got.append((clock.now_ns(), w, seq)))
    batch = KVEventBatch(ts=0.0, events=[AllBlocksCleared()])

    async def main() -> None:
        import anyio
        early = bus.publisher(0, 0)
        assert early.publish(batch) and early.next_seq == 0  # held: not numbered yet
        await anyio.sleep(0.001)
        bus.lag_ns = 1_000_000  # chaos: every publisher, and the ones created later
        assert bus.publisher(1, 0).lag_ns == 1_000_000
        bus.publisher(1, 0).publish(batch)
        early.publish(batch)
        await anyio.sleep(0.010)

    run_virtual(main, clock)
    # rank 0's second batch waits for its first (order kept), rank 1's goes after the shorter lag
    assert got == [(2_000_000, 1, 0), (5_000_000, 0, 0), (5_000_000, 0, 1)]


def test_every_router_replica_gets_every_batch_and_a_restarted_one_replaces_its_intake():
    from kvemu.runtime.kv_bus import MemoryKvBus
    from kvemu.kv_events import AllBlocksCleared, KVEventBatch

    bus = MemoryKvBus()
    got: dict[str, list[tuple[int, int]]] = {"a": [], "b": [], "b2": []}
    bus.connect(lambda w, r, seq, payload: got["b"].append((w, seq)), replica=1)
    bus.connect(lambda w, r, seq, payload: got["a"].append((w, seq)), replica=0)
    batch = KVEventBatch(ts=0.0, events=[AllBlocksCleared()])
    bus.publisher(3, 0).publish(batch)
    bus.connect(lambda w, r, seq, payload: got["b2"].append((w, seq)), replica=1)  # replica 1 restarted
    bus.publisher(3, 0).publish(batch)
    assert got == {"a": [(3, 0), (3, 1)], "b": [(3, 0)], "b2": [(3, 1)]}
