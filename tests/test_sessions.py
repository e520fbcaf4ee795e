"""The session player on virtual time: start times, think times, turns after their sub-agents, every session ends."""

from __future__ import annotations

import asyncio

import anyio

from kvemu.clock import ManualClock
from kvemu.runtime.loop import run_virtual

from harness.sessions import SessionPlayer, awaiting
from harness.workload import Session, Turn

MS = 1_000_000


def _sessions() -> list[Session]:
    a = Session("a", 5 * MS, [Turn([1, 2], 4), Turn([3], 4, delay_ns=7 * MS, sub_agents=(([9], 2), ([8], 2))),
                              Turn([4], 4, delay_ns=1 * MS)], sticky=True)
    b = Session("b", 0, [Turn([5], 4)])
    return [a, b]


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
