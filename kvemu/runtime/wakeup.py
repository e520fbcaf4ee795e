"""A re-armable timer that drives a sans-IO core from the event loop, without a task per step.

``step()`` advances the core to the clock's time and returns the instant (ns, on that clock) it next
needs to run, or ``None``; ``poke()`` asks for a step soon (new input changed the plan); ``arm(t)``
asks for a step by ``t`` (the owner already knows the new plan's next instant). The owner's
task awaits ``run()``, which re-raises anything ``step`` raised, so a failing core fails its actor as a
receive loop would, instead of vanishing into the loop's exception handler. On the virtual loop the
instant is exact (a bare ``timer_at_ns`` timer); on any other loop it becomes a delay from the clock's now.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import anyio

from kvemu.clock import NS_PER_S
from kvemu.runtime.loop import VirtualTimer

__all__ = ["Wakeup"]


class Wakeup:
    """Calls ``step`` at the instants it asks for, and soon after every ``poke``."""

    __slots__ = ("_step", "_now", "_loop", "_handle", "_soon", "_error", "_failed", "_at")

    def __init__(self, step: Callable[[], int | None], now_ns: Callable[[], int]) -> None:
        self._step = step
        self._now = now_ns
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.Handle | VirtualTimer | None = None
        self._at: int | None = None  # the instant the pending timer steps at (None: none pending, or soon)
        self._soon = False
        self._error: BaseException | None = None
        self._failed: anyio.Event | None = None

    async def run(self) -> None:
        """Step now, then keep stepping until cancelled (re-raising whatever a step raised)."""
        self._loop = asyncio.get_running_loop()
        self._failed = anyio.Event()
        self.poke()
        try:
            await self._failed.wait()
        finally:
            self._cancel()
            self._loop = None
        assert self._error is not None
        raise self._error

    def poke(self) -> None:
        """Step on the next loop turn (no-op before ``run`` or while one is already due)."""
        if self._loop is None or self._soon:
            return
        self._cancel()
        self._soon = True
        self._handle = self._loop.call_soon(self._fire)

    def arm(self, when_ns: int | None) -> None:
        """Step at ``when_ns`` unless a step is already due by then (no-op before ``run`` or for None)."""
        if self._loop is None or when_ns is None or self._soon:
            return
        at = self._at
        if at is not None and at <= when_ns:
            return
        self._cancel()
        self._schedule(when_ns)

    def _cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._soon = False
        self._at = None

    def _schedule(self, when_ns: int) -> None:
        assert self._loop is not None
        timer_at_ns = getattr(self._loop, "timer_at_ns", None)
        if timer_at_ns is not None:  # the virtual loop: its clock is the step's clock, exact nanoseconds
            self._handle = timer_at_ns(when_ns, self._fire)
        else:
            self._handle = self._loop.call_later(max(0, when_ns - self._now()) / NS_PER_S, self._fire)
        self._at = when_ns

    def _fire(self) -> None:
        self._handle = None
        self._soon = False
        self._at = None
        try:
            when_ns = self._step()
        except BaseException as exc:  # noqa: BLE001 - re-raised by run() in the owner's task
            self._error = exc
            assert self._failed is not None
            self._failed.set()
            return
        self.arm(when_ns)  # (the step may have armed or poked already: the earlier instant wins)
