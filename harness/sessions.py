"""Plays a workload's sessions against a router, as timers and callbacks rather than a task per session.

A session waits for its start, then sends each turn after the previous one (and that turn's sub-agents)
ended, after the turn's think time. ``submit(request, on_end)`` starts one request and calls ``on_end``
once it ended, completed or failed: in process that is the router's own ``submit``; a ZeroMQ client
adapts its awaitable call (``awaiting``). The same player drives virtual and live runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from kvemu.clock import NS_PER_S, Clock
from kvemu.runtime.messages import ClientRequest

from harness.workload import Session, Turn

__all__ = ["SessionPlayer", "Submit", "awaiting"]

Submit = Callable[[ClientRequest, Callable[[Any], None]], None]
"""Starts one request; the callable is called once with its outcome when it ended."""


def awaiting(tg: anyio.abc.TaskGroup, submit: Callable[[ClientRequest], Awaitable[Any]]) -> Submit:
    """A ``Submit`` over an awaitable request call (a network client): one task per request, in ``tg``."""

    async def run(req: ClientRequest, on_end: Callable[[Any], None]) -> None:
        on_end(await submit(req))

    return lambda req, on_end: tg.start_soon(run, req, on_end)


class SessionPlayer:
    """Runs every session to its end (see the module doc); ``run`` returns when all have ended."""

    def __init__(self, sessions: list[Session], submit: Submit, clock: Clock) -> None:
        self.sessions = sessions
        self.submit = submit
        self.clock = clock
        self._open = 0
        self._done: anyio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False

    async def run(self) -> None:
        """Schedule every session's start, then wait until every session ended."""
        self._loop = asyncio.get_running_loop()
        self._done = anyio.Event()
        self._open = len(self.sessions)
        if not self._open:
            return
        for s in self.sessions:
            self._at(s.start_ns, self._turn, s, 0)
        try:
            await self._done.wait()
        finally:  # finished, or cancelled (a drain deadline, a lost router): timers still set send nothing
            self._stopped = True

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
        self.submit(_request(rid, turn, s.session_id if s.sticky else None, None),
                    lambda _outcome: self._loop.call_soon(self._turn_ended, s, k))  # type: ignore[union-attr]

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
            self.submit(_request(f"{rid}-a{j}", sub, None, s.session_id), sub_ended)

    def _next(self, s: Session, k: int) -> None:
        if k + 1 < len(s.turns):
            self._turn(s, k + 1)
            return
        self._open -= 1
        if not self._open:
            assert self._done is not None
            self._done.set()


def _request(rid: str, turn: Turn, session_id: str | None, parent: str | None) -> ClientRequest:
    return ClientRequest(request_id=rid, tokens=turn.prompt(), max_tokens=turn.max_tokens, session_id=session_id,
                         parent_session_id=parent, worker_id=turn.worker_id)
