"""What every player of a workload shares: ``Player`` (units started open or closed loop, requests counted, timers in
exact virtual nanoseconds, the closed loop's stall watch) and ``Submit``, how a player starts one request.

The players build on it: ``harness.workload.sessions`` (sessions, a trace's graph) and ``harness.workload.lanes`` (lanes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from kvemu.clock import NS_PER_S, Clock
from kvemu.messages import ClientRequest

__all__ = ["Player", "Submit", "awaiting"]


Submit = Callable[[ClientRequest, Callable[[Any], None]], None]
"""Starts one request; the callable is called once with its outcome when it ended."""


def awaiting(tg: anyio.abc.TaskGroup, submit: Callable[[ClientRequest], Awaitable[Any]]) -> Submit:
    """A ``Submit`` over an awaitable request call (a network client): one task per request, in ``tg``."""

    async def run(req: ClientRequest, on_end: Callable[[Any], None]) -> None:
        on_end(await submit(req))

    def start(req: ClientRequest, on_end: Callable[[Any], None]) -> None:
        tg.start_soon(run, req, on_end)

    return start


class Player:
    """What every player shares: units (sessions, plays) started open or closed loop, requests submitted and
    counted, timers in exact virtual nanoseconds, the closed loop's stall watch. ``run`` returns when every unit
    ended; a subclass says how many units there are, how one starts and when one ended (``_unit_ended``)."""

    def __init__(self, submit: Submit, clock: Clock, *, concurrency: int | None = None,
                 stall_timeout_ns: int | None = None) -> None:
        self.submit = submit
        self.clock = clock
        self.concurrency = concurrency
        self.stall_timeout_ns = stall_timeout_ns
        self.stalled = False
        """Closed loop: the run stopped because no request ended for ``stall_timeout_ns``."""
        self._open = 0
        self._done: anyio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        self._in_flight = 0
        self._last_end_ns = 0
        self._watching = False

    def _units(self) -> int:
        raise NotImplementedError

    def _begin(self) -> None:
        """Start the units: at their start times (open loop), or the first ``concurrency`` of them."""
        raise NotImplementedError

    def _start_next(self) -> None:
        """Closed loop: a unit ended; start the next one not started yet, if any."""
        raise NotImplementedError

    async def run(self) -> None:
        """Start the units (at their start times, or closed loop), then wait until every unit ended."""
        self._loop = asyncio.get_running_loop()
        self._done = anyio.Event()
        self._open = self._units()
        if not self._open:
            return
        self._begin()
        try:
            await self._done.wait()
        finally:  # finished, or cancelled (a drain deadline, a lost router): timers still set send nothing
            self._stopped = True

    def _unit_ended(self) -> None:
        self._open -= 1
        if not self._open:
            assert self._done is not None
            self._done.set()
            return
        if self.concurrency is not None:  # its slot goes to the next unit
            self._start_next()

    def _watch(self) -> None:
        """Closed loop: stop when requests are in flight and none ended (or started) for the stall timeout."""
        if self._stopped or self._done is None or self._done.is_set() or not self._in_flight:
            self._watching = False  # idle (think times): the next submit arms it again
            return
        due = self._last_end_ns + self.stall_timeout_ns  # type: ignore[operator]
        if self.clock.now_ns() >= due:
            self.stalled = True
            self._stopped = True
            self._done.set()
            return
        self._at(due, self._watch)

    def _submit(self, req: ClientRequest, on_end: Callable[[Any], None]) -> None:
        if not self._in_flight:  # the stall clock starts when work does
            self._last_end_ns = self.clock.now_ns()
            if self.concurrency is not None and self.stall_timeout_ns is not None and not self._watching:
                self._watching = True
                self._at(self._last_end_ns + self.stall_timeout_ns, self._watch)
        self._in_flight += 1

        def ended(outcome: Any) -> None:
            self._in_flight -= 1
            self._last_end_ns = self.clock.now_ns()
            on_end(outcome)

        self.submit(req, ended)

    def _at(self, when_ns: int, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        assert loop is not None
        delay = when_ns - self.clock.now_ns()
        if delay <= 0:
            loop.call_soon(fn, *args)
            return
        call_at_ns = getattr(loop, "call_at_ns", None)
        if call_at_ns is not None:  # virtual time: exact nanoseconds
            call_at_ns(when_ns, fn, *args)
        else:
            loop.call_later(delay / NS_PER_S, fn, *args)
