"""The virtual-time event loop: exact integer-nanosecond timers, FIFO at one instant, no drift, no hangs."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from kvemu.clock import ManualClock
from kvemu.runtime.loop import VirtualDeadlock, VirtualEventLoop, run_virtual


def test_same_instant_timers_fire_in_the_order_they_were_set():
    clock = ManualClock()
    order: list[str] = []

    async def main() -> None:
        lp = asyncio.get_running_loop()
        lp.call_later(0.002, order.append, "a")
        lp.call_at_ns(2_000_000, order.append, "b")  # type: ignore[attr-defined]
        lp.call_at(0.002, order.append, "c")
        lp.call_later(0.001, order.append, "early")
        await anyio.sleep(0.01)

    run_virtual(main, clock)
    assert order == ["early", "a", "b", "c"]
    assert clock.now_ns() == 10_000_000


def test_timers_are_exact_in_nanoseconds_over_long_runs():
    clock = ManualClock()
    seen: list[int] = []

    async def main() -> None:
        for _ in range(10_000):
            await anyio.sleep(0.000_000_333)  # 333 ns: not exact in binary floating point
            seen.append(clock.now_ns())

    run_virtual(main, clock)
    assert seen[-1] == 10_000 * 333
    assert all(b - a == 333 for a, b in zip(seen, seen[1:]))


def test_deadlines_fire_once_and_timeouts_cancel_their_timers():
    clock = ManualClock()

    async def main() -> int:
        fired = 0
        for k in range(2_000):
            with anyio.move_on_after(0.0001 * (k % 7 + 1)) as scope:
                await anyio.sleep(1)
            fired += scope.cancelled_caught
        return fired

    assert run_virtual(main, clock) == 2_000
    # anyio deadlines are float seconds: each fires at its instant rounded up to the next nanosecond
    exact = sum(100_000 * (k % 7 + 1) for k in range(2_000))
    assert exact <= clock.now_ns() <= exact + 2_000


def test_cancelled_timers_do_not_advance_the_clock_or_pile_up():
    clock = ManualClock()
    loop = VirtualEventLoop(clock)
    try:
        handles = [loop.call_later(100.0 + i, print) for i in range(1_000)]
        for h in handles:
            h.cancel()
        loop.call_later(1.0, loop.stop)
        loop.run_forever()
        assert clock.now_ns() == 1_000_000_000
        assert len(loop._timers) < 300  # compacted, not kept until their instants
    finally:
        loop.close()


def test_waiting_for_nothing_is_a_deadlock_not_a_hang():
    async def main() -> None:
        await anyio.Event().wait()

    with pytest.raises(VirtualDeadlock):
        run_virtual(main, ManualClock())


def test_bare_timers_share_the_handles_order_and_cancel_like_them():
    clock = ManualClock()
    order: list[str] = []

    async def main() -> None:
        lp = asyncio.get_running_loop()
        lp.call_at_ns(2_000, order.append, "handle 1")  # type: ignore[attr-defined]
        lp.timer_at_ns(2_000, lambda: order.append("bare 1"))  # type: ignore[attr-defined]
        dropped = lp.timer_at_ns(1_000, lambda: order.append("cancelled"))  # type: ignore[attr-defined]
        lp.call_at_ns(2_000, order.append, "handle 2")  # type: ignore[attr-defined]
        lp.timer_at_ns(1_500, lambda: order.append(f"bare early at {clock.now_ns()}"))  # type: ignore[attr-defined]
        dropped.cancel()
        dropped.cancel()  # idempotent: counted once
        assert dropped.cancelled() and lp._cancelled_timers == 1  # type: ignore[attr-defined]
        await anyio.sleep(0.00001)

    run_virtual(main, clock)
    assert order == ["bare early at 1500", "handle 1", "bare 1", "handle 2"]
    assert clock.now_ns() == 10_000


def test_many_cancelled_bare_timers_are_compacted_away():
    clock = ManualClock()

    async def main() -> None:
        lp = asyncio.get_running_loop()
        for i in range(5_000):
            lp.timer_at_ns(10_000_000 + i, lambda: None).cancel()  # type: ignore[attr-defined]
        await anyio.sleep(0.001)
        assert len(lp._timers) < 600  # type: ignore[attr-defined]

    run_virtual(main, clock)
    assert clock.now_ns() == 1_000_000  # the cancelled timers never moved the clock
