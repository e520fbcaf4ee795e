"""Event loops for the two modes: uvloop on wall time, and a deterministic loop on virtual time.

The virtual loop is an ``asyncio.SelectorEventLoop`` whose ``time()`` reads a ``ManualClock``. Its
timers live in a heap of ``(when_ns, order, handle)`` tuples: integer nanoseconds (no float drift),
ordered by C tuple comparison (no Python ``__lt__``), same-instant timers in the order they were set.
Whenever no callback is ready it jumps the clock to the earliest timer instead of waiting, so
everything built on loop timers (``anyio.sleep``, timeouts, task groups, events) runs unchanged in
virtual time. Real file descriptors are polled without blocking every ``POLL_EVERY`` iterations and
before declaring a deadlock.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import selectors
from collections.abc import Awaitable, Callable, Iterator
from contextvars import Context
from typing import TypeVar, TypeVarTuple, Unpack

from kvemu.clock import NS_PER_S, ManualClock

__all__ = ["VirtualDeadlock", "VirtualEventLoop", "VirtualTimer", "run_virtual", "run_live", "new_live_loop"]

T = TypeVar("T")
_Ts = TypeVarTuple("_Ts")

POLL_EVERY = 1024
"""Iterations between non-blocking polls of real file descriptors (signals wake the loop directly)."""


class VirtualDeadlock(RuntimeError):
    """Nothing is ready, no timer is set and no I/O is pending: virtual time would stop forever."""


class VirtualTimer:
    """A bare virtual-loop timer: the loop calls ``fn()`` itself, with no handle, arguments or context.

    For hot internal drivers (``Wakeup``) whose callback handles its own errors; ``cancel()`` as a handle's.
    """

    __slots__ = ("_fn", "_loop", "_cancelled", "_scheduled")

    def __init__(self, fn: Callable[[], object], loop: VirtualEventLoop) -> None:
        self._fn = fn
        self._loop = loop
        self._cancelled = False
        self._scheduled = True

    def cancel(self) -> None:
        """Do not call ``fn`` (no-op once it ran or was cancelled)."""
        if not self._cancelled:
            self._cancelled = True
            if self._scheduled:
                self._loop._cancelled_timers += 1

    def cancelled(self) -> bool:
        """Whether ``cancel`` was called."""
        return self._cancelled

    def _run(self) -> None:
        self._fn()


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on virtual time (``time()`` = the clock, in seconds)."""

    def __init__(self, clock: ManualClock | None = None) -> None:
        self.clock = clock or ManualClock()
        super().__init__(selectors.DefaultSelector())
        self._clock_resolution = 1e-9
        self._timers: list[tuple[int, int, asyncio.TimerHandle | VirtualTimer]] = []
        self._timer_order = 0
        self._cancelled_timers = 0
        self._polls = 0

    def time(self) -> float:
        """Virtual seconds since the clock's epoch."""
        return self.clock._now / NS_PER_S

    def call_at(self, when: float, callback: Callable[[Unpack[_Ts]], object], *args: *_Ts,
                context: Context | None = None) -> asyncio.TimerHandle:
        """Schedule ``callback`` at virtual time ``when`` (seconds); same-instant timers keep their order."""
        if when is None:
            raise TypeError("when cannot be None")
        when_ns = round(when * NS_PER_S)
        if when_ns / NS_PER_S < when:  # fire when time() >= when holds, as callers (anyio deadlines) check
            when_ns += 1
        return self.call_at_ns(when_ns, callback, *args, context=context)

    def call_later(self, delay: float, callback: Callable[[Unpack[_Ts]], object], *args: *_Ts,
                   context: Context | None = None) -> asyncio.TimerHandle:
        """Schedule ``callback`` ``delay`` seconds from now (exactly, in nanoseconds)."""
        if delay is None:
            raise TypeError("delay must not be None")
        return self.call_at_ns(self.clock._now + round(delay * NS_PER_S), callback, *args, context=context)

    def call_at_ns(self, when_ns: int, callback: Callable[[Unpack[_Ts]], object], *args: *_Ts,
                   context: Context | None = None) -> asyncio.TimerHandle:
        """Schedule ``callback`` at virtual time ``when_ns`` (integer nanoseconds)."""
        self._check_closed()  # type: ignore[attr-defined]
        timer = asyncio.TimerHandle(when_ns / NS_PER_S, callback, args, self, context)
        order = self._timer_order = self._timer_order + 1
        heapq.heappush(self._timers, (when_ns, order, timer))
        timer._scheduled = True  # type: ignore[attr-defined]  # CPython's TimerHandle slot, not in typeshed
        return timer

    def timer_at_ns(self, when_ns: int, fn: Callable[[], object]) -> VirtualTimer:
        """Call ``fn()`` at virtual time ``when_ns``, in timer order like ``call_at_ns`` but without a handle's
        context and error handling (``fn`` must not raise): the cheap path for per-event drivers."""
        self._check_closed()  # type: ignore[attr-defined]
        timer = VirtualTimer(fn, self)
        order = self._timer_order = self._timer_order + 1
        heapq.heappush(self._timers, (when_ns, order, timer))
        return timer

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        if handle._scheduled:  # type: ignore[attr-defined]  # CPython's TimerHandle slot, not in typeshed
            self._cancelled_timers += 1

    def _run_once(self) -> None:
        timers = self._timers
        ready = self._ready  # type: ignore[attr-defined]
        if self._cancelled_timers > 256 and self._cancelled_timers * 2 > len(timers):
            self._compact_timers()
        while timers and timers[0][2]._cancelled:
            heapq.heappop(timers)[2]._scheduled = False  # type: ignore[union-attr]  # TimerHandle's, not in typeshed
            self._cancelled_timers -= 1
        self._polls += 1
        if self._polls >= POLL_EVERY or not (ready or timers or self._stopping):  # type: ignore[attr-defined]
            self._polls = 0
            self._process_events(self._selector.select(0))  # type: ignore[attr-defined]
        clock = self.clock
        if not ready and not self._stopping:  # type: ignore[attr-defined]
            if not timers:
                raise VirtualDeadlock(
                    "virtual time deadlock: no callback is ready and no timer is set "
                    "(a task awaits something that nothing will ever deliver)"
                )
            if timers[0][0] > clock._now:
                clock.advance_to(timers[0][0])
        now = clock._now
        while timers and timers[0][0] <= now:
            timer = heapq.heappop(timers)[2]
            timer._scheduled = False  # type: ignore[union-attr]  # TimerHandle's slot, not in typeshed
            if timer._cancelled:
                self._cancelled_timers -= 1
            else:
                ready.append(timer)
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()

    def _compact_timers(self) -> None:
        live = []
        for entry in self._timers:
            if entry[2]._cancelled:
                entry[2]._scheduled = False  # type: ignore[union-attr]  # TimerHandle's slot, not in typeshed
            else:
                live.append(entry)
        heapq.heapify(live)
        self._timers = live
        self._cancelled_timers = 0

    def close(self) -> None:
        """Close the loop and drop its timers."""
        self._timers.clear()
        super().close()


@contextlib.contextmanager
def _asyncio_named() -> Iterator[None]:
    """Name asyncio as the running async library for this thread while a kvemu loop runs.

    Transports and timers call actors' handlers from loop callbacks, outside any task; where ``sniffio`` is
    installed (httpx, openai and many others bring it) anyio finds no library there and every anyio call
    in a handler fails. sniffio's per-thread name answers for callbacks too."""
    try:
        import sniffio
    except ImportError:
        yield
        return
    before = sniffio.thread_local.name
    sniffio.thread_local.name = "asyncio"
    try:
        yield
    finally:
        sniffio.thread_local.name = before


def run_virtual(main: Callable[[], Awaitable[T]], clock: ManualClock | None = None) -> T:
    """Run ``main()`` to completion on a fresh virtual-time loop driven by ``clock``."""
    loop = VirtualEventLoop(clock)
    with _asyncio_named(), asyncio.Runner(loop_factory=lambda: loop) as runner:
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
    with _asyncio_named(), asyncio.Runner(loop_factory=new_live_loop) as runner:
        return runner.run(main())  # type: ignore[arg-type]
