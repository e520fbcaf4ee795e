"""Plays a workload's sessions against a router, as timers and callbacks rather than a task per session.

A session waits for its start, then sends each turn after the previous one (and that turn's sub-agents)
ended, after the turn's think time. ``submit(request, on_end)`` starts one request and calls ``on_end``
once it ended, completed or failed: in process that is the router's own ``submit``; a ZeroMQ client
adapts its awaitable call (``awaiting``). The same player drives virtual and live runs.

Closed loop (``concurrency=N``, the reference replay's ``replay_concurrency``): start times are ignored; the
first N sessions start at once and each next one, in start order, when a session ends (a session holds its
slot through its think times). A closed loop has no last start to time a drain from, so it stops instead when
no request has ended for ``stall_timeout_ns`` while some were in flight.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from itertools import islice
from typing import Any

import anyio

from kvemu.clock import NS_PER_S, Clock
from kvemu.messages import ClientRequest

from harness.scenario import Scenario
from harness.trace_sessions import start_times
from harness.turns import Session, Turn

__all__ = ["SessionPlayer", "Submit", "awaiting", "play_workload", "drain_deadline_s"]

Submit = Callable[[ClientRequest, Callable[[Any], None]], None]
"""Starts one request; the callable is called once with its outcome when it ended."""


def awaiting(tg: anyio.abc.TaskGroup, submit: Callable[[ClientRequest], Awaitable[Any]]) -> Submit:
    """A ``Submit`` over an awaitable request call (a network client): one task per request, in ``tg``."""

    async def run(req: ClientRequest, on_end: Callable[[Any], None]) -> None:
        on_end(await submit(req))

    def start(req: ClientRequest, on_end: Callable[[Any], None]) -> None:
        tg.start_soon(run, req, on_end)

    return start


class SessionPlayer:
    """Runs every session to its end (see the module doc); ``run`` returns when all have ended.

    A session is taken from ``sessions`` only when it starts (a loaded trace materializes it then)."""

    def __init__(self, sessions: Sequence[Session], submit: Submit, clock: Clock, *, concurrency: int | None = None,
                 stall_timeout_ns: int | None = None) -> None:
        self.sessions = sessions
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
        self._queue: Iterator[Session] = iter(())  # closed loop: the sessions not started yet, in start order
        self._in_flight = 0
        self._last_end_ns = 0
        self._watching = False

    async def run(self) -> None:
        """Start the sessions (at their start times, or closed loop), then wait until every session ended."""
        self._loop = asyncio.get_running_loop()
        self._done = anyio.Event()
        self._open = len(self.sessions)
        if not self._open:
            return
        if self.concurrency is None:
            for i, start_ns in enumerate(start_times(self.sessions)):
                self._at(start_ns, self._start, i)
        else:
            self._queue = iter(self.sessions)
            for s in islice(self._queue, self.concurrency):
                self._turn(s, 0)
        try:
            await self._done.wait()
        finally:  # finished, or cancelled (a drain deadline, a lost router): timers still set send nothing
            self._stopped = True

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

    def _start(self, i: int) -> None:
        """Open loop: session ``i`` is due (its index waited in the timer, not the session)."""
        if not self._stopped:
            self._turn(self.sessions[i], 0)

    def _turn(self, s: Session, k: int) -> None:
        """Turn ``k`` of ``s`` is due: wait its think time, then send it."""
        if self._stopped:
            return
        turn = s.turns[k]
        if turn.delay_ns:
            self._at(self.clock.now_ns() + turn.delay_ns, self._send, s, k)
        else:
            self._send(s, k)

    def _send(self, s: Session, k: int) -> None:
        if self._stopped:
            return
        turn = s.turns[k]
        rid = f"{s.session_id}-t{k}"

        def ended(_outcome: Any) -> None:
            self._loop.call_soon(self._turn_ended, s, k)  # type: ignore[union-attr]

        self._submit(_request(rid, turn, s.session_id if s.sticky else None, None), ended)

    def _turn_ended(self, s: Session, k: int) -> None:
        if self._stopped:
            return
        turn = s.turns[k]
        if not turn.sub_agents:
            self._next(s, k)
            return
        left = [len(turn.sub_agents)]

        def sub_ended(_outcome: Any) -> None:
            left[0] -= 1
            if not left[0]:
                self._loop.call_soon(self._next, s, k)  # type: ignore[union-attr]

        rid = f"{s.session_id}-t{k}"
        for j, (tokens, osl) in enumerate(turn.sub_agents):
            sub = Turn(tokens, osl, worker_id=turn.worker_id)
            self._submit(_request(f"{rid}-a{j}", sub, None, s.session_id), sub_ended)

    def _next(self, s: Session, k: int) -> None:
        if k + 1 < len(s.turns):
            self._turn(s, k + 1)
            return
        self._open -= 1
        if not self._open:
            assert self._done is not None
            self._done.set()
            return
        if self.concurrency is not None:  # its slot goes to the next session
            following = next(self._queue, None)
            if following is not None:
                self._turn(following, 0)


def _request(rid: str, turn: Turn, session_id: str | None, parent: str | None) -> ClientRequest:
    # in process ClientRequest.tokens is any Sequence[int] (its doc); the field declares the wire forms
    return ClientRequest(request_id=rid, tokens=turn.prompt(),  # type: ignore[arg-type]
                         max_tokens=turn.max_tokens, session_id=session_id,
                         parent_session_id=parent, worker_id=turn.worker_id)


def drain_deadline_s(scenario: Scenario, sessions: Sequence[Session]) -> float:
    """Scenario seconds after which an open-loop run stops waiting: the last session start plus
    ``run.drain_timeout_s`` (a closed loop has none: it watches for stalls instead)."""
    if scenario.workload.concurrency is not None:
        return math.inf
    last = max(start_times(sessions), default=0) / NS_PER_S
    return last + scenario.run.drain_timeout_s


async def play_workload(scenario: Scenario, sessions: Sequence[Session], submit: Submit, clock: Clock) -> bool:
    """Play ``sessions`` as the scenario says (open or closed loop, drain deadline); False if cut short."""
    player = SessionPlayer(sessions, submit, clock, concurrency=scenario.workload.concurrency,
                           stall_timeout_ns=round(scenario.run.drain_timeout_s * NS_PER_S))
    with anyio.move_on_after(drain_deadline_s(scenario, sessions)) as scope:
        await player.run()
    return not (scope.cancelled_caught or player.stalled)
