"""The session player on virtual time: start times, think times, turns after their sub-agents, every session ends."""

from __future__ import annotations

import asyncio

import anyio

from kvemu.clock import ManualClock
from kvemu.runtime.loop import run_virtual

from harness.workload.sessions import SessionPlayer, awaiting
from harness.workload import Session, Turn
from harness.workload.turns import SessionList

MS = 1_000_000


def _sessions() -> SessionList:
    a = Session("a", 5 * MS, [Turn([1, 2], 4), Turn([3], 4, delay_ns=7 * MS, sub_agents=(([9], 2), ([8], 2))),
                              Turn([4], 4, delay_ns=1 * MS)], sticky=True)
    b = Session("b", 0, [Turn([5], 4)])
    return SessionList([a, b])


def _play(submit_factory):
    clock = ManualClock()
    log: list[tuple[int, str, str | None, str | None]] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await SessionPlayer(_sessions(), submit_factory(tg, clock, log), clock).run()

    run_virtual(main, clock)
    return log


def _callback_submit(tg, clock, log):
    def submit(req, on_end):  # every request takes 10 ms
        log.append((clock.now_ns(), req.request_id, req.session_id, req.parent_session_id))
        asyncio.get_running_loop().call_at_ns(clock.now_ns() + 10 * MS, on_end, None)
    return submit


def _awaiting_submit(tg, clock, log):
    async def submit(req):
        log.append((clock.now_ns(), req.request_id, req.session_id, req.parent_session_id))
        await anyio.sleep(0.010)
    return awaiting(tg, submit)


EXPECTED = [
    (0, "b-t0", None, None),
    (5 * MS, "a-t0", "a", None),
    (22 * MS, "a-t1", "a", None),            # 5 + 10 ms running + 7 ms think time
    (32 * MS, "a-t1-a0", None, "a"),         # sub-agents start when their turn ended
    (32 * MS, "a-t1-a1", None, "a"),
    (43 * MS, "a-t2", "a", None),            # after both sub-agents (42 ms) + 1 ms
]


def test_turns_follow_start_think_time_and_sub_agents():
    assert _play(_callback_submit) == EXPECTED


def test_an_awaitable_client_plays_the_same_sessions():
    assert _play(_awaiting_submit) == EXPECTED


def test_a_cancelled_player_sends_nothing_more():
    """Cut short (a drain deadline, a lost router), the timers it had set must not send turns afterwards."""
    clock = ManualClock()
    log: list[tuple[int, str, str | None, str | None]] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            with anyio.move_on_after(0.012):  # during a-t0: a-t1 and everything after it is still to come
                await SessionPlayer(_sessions(), _callback_submit(tg, clock, log), clock).run()
            await anyio.sleep(1.0)  # every timer the player had set comes due

    run_virtual(main, clock)
    assert [rid for _, rid, _, _ in log] == ["b-t0", "a-t0"]


def _closed(sessions, concurrency, submit_factory=_callback_submit, stall_ns=None):
    clock = ManualClock()
    log: list[tuple[int, str, str | None, str | None]] = []
    players = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            player = SessionPlayer(SessionList(sessions), submit_factory(tg, clock, log), clock, concurrency=concurrency,
                                   stall_timeout_ns=stall_ns)
            players.append(player)
            await player.run()

    run_virtual(main, clock)
    return log, players[0]


def test_closed_loop_starts_the_next_session_when_one_ends_ignoring_start_times():
    sessions = [Session(f"s{i}", 1000 * MS * i, [Turn([i], 4)]) for i in range(5)]
    log, player = _closed(sessions, 2)
    assert [(t // MS, rid) for t, rid, _, _ in log] == [
        (0, "s0-t0"), (0, "s1-t0"), (10, "s2-t0"), (10, "s3-t0"), (20, "s4-t0")]
    assert not player.stalled


def test_closed_loop_a_session_holds_its_slot_through_think_times_and_sub_agents():
    log, _ = _closed(_sessions(), 1)  # a (three turns, sub-agents, think times) first, then b
    assert [rid for _, rid, _, _ in log] == ["a-t0", "a-t1", "a-t1-a0", "a-t1-a1", "a-t2", "b-t0"]
    assert log[-1][0] == 48 * MS  # b starts when a's last turn ended: 0 + 10 + 7 + 10 + 10 + 1 + 10


def _never_ends(tg, clock, log):
    def submit(req, on_end):
        log.append((clock.now_ns(), req.request_id, req.session_id, req.parent_session_id))
    return submit


def test_closed_loop_stops_when_nothing_ends_for_the_stall_timeout():
    sessions = [Session(f"s{i}", 0, [Turn([i], 4)]) for i in range(3)]
    log, player = _closed(sessions, 2, _never_ends, stall_ns=50 * MS)
    assert player.stalled and [rid for _, rid, _, _ in log] == ["s0-t0", "s1-t0"]


def test_a_think_time_longer_than_the_stall_timeout_is_not_a_stall():
    sessions = [Session("s", 0, [Turn([1], 4), Turn([2], 4, delay_ns=500 * MS)])]
    log, player = _closed(sessions, 1, stall_ns=50 * MS)
    assert not player.stalled and [(t // MS, rid) for t, rid, _, _ in log] == [(0, "s-t0"), (510, "s-t1")]
