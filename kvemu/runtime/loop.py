"""Event loops for the two modes: uvloop on wall time, and a deterministic loop on virtual time.

The virtual loop is a plain ``asyncio.SelectorEventLoop`` whose ``time()`` reads a ``ManualClock`` and
whose selector, whenever nothing is ready to run, jumps the clock to the earliest timer instead of
waiting. Everything built on loop timers — ``anyio.sleep``, timeouts, task groups, memory streams —
then runs unchanged in virtual time. Timers due at the same instant fire in the order they were set.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import selectors
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kvemu.clock import NS_PER_S, ManualClock

__all__ = ["VirtualDeadlock", "VirtualEventLoop", "run_virtual", "run_live", "new_live_loop"]

T = TypeVar("T")


class VirtualDeadlock(RuntimeError):
    """Nothing is ready, no timer is set and no I/O is pending: virtual time would stop forever."""


class _VirtualSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Polls real file descriptors without blocking; advances the clock instead of sleeping."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise VirtualDeadlock(
                "virtual time deadlock: no callback is ready and no timer is set "
                "(a task awaits something that nothing will ever deliver)"
            )
        self.clock.advance(max(1, round(timeout * NS_PER_S)))
        return []


class _OrderedTimerHandle(asyncio.TimerHandle):
    """A timer that, among timers due at the same instant, fires in creation order."""

    __slots__ = ("_order",)

    def __init__(self, when: float, callback: Callable, args: tuple, loop: asyncio.AbstractEventLoop,
                 context: Any, order: int) -> None:
        super().__init__(when, callback, args, loop, context)
        self._order = order

    def __lt__(self, other: object) -> bool:
        if isinstance(other, _OrderedTimerHandle) and self._when == other._when:
            return self._order < other._order
        return super().__lt__(other)  # type: ignore[operator]

    def __le__(self, other: object) -> bool:
        return self == other or self.__lt__(other)


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on virtual time (``time()`` = the clock, in seconds)."""

    def __init__(self, clock: ManualClock | None = None) -> None:
        self.clock = clock or ManualClock()
        super().__init__(_VirtualSelector(self.clock))
        self._clock_resolution = 1e-9
        self._timer_order = itertools.count()

    def time(self) -> float:
        """Virtual seconds since the clock's epoch."""
        return self.clock.now_ns() / NS_PER_S

    def call_at(self, when: float, callback: Callable, *args: Any, context: Any = None) -> asyncio.TimerHandle:
        """Schedule ``callback`` at virtual time ``when``; same-instant timers keep their order."""
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()  # type: ignore[attr-defined]
        timer = _OrderedTimerHandle(when, callback, args, self, context, next(self._timer_order))
        heapq.heappush(self._scheduled, timer)  # type: ignore[attr-defined]
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer


def run_virtual(main: Callable[[], Awaitable[T]], clock: ManualClock | None = None) -> T:
    """Run ``main()`` to completion on a fresh virtual-time loop driven by ``clock``."""
    loop = VirtualEventLoop(clock)
    with asyncio.Runner(loop_factory=lambda: loop) as runner:
        return runner.run(main())  # type: ignore[arg-type]


def new_live_loop() -> asyncio.AbstractEventLoop:
    """uvloop where available (not on Windows), else the default asyncio loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_live(main: Callable[[], Awaitable[T]]) -> T:
    """Run ``main()`` to completion on a wall-time loop (uvloop)."""
    with asyncio.Runner(loop_factory=new_live_loop) as runner:
        return runner.run(main())  # type: ignore[arg-type]
