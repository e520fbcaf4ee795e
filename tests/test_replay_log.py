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
