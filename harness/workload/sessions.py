"""Plays a workload's sessions against a router, as timers and callbacks rather than a task per session.

A session waits for its start, then sends each turn after the previous one (and that turn's sub-agents)
ended, after the turn's think time. ``submit(request, on_end)`` starts one request and calls ``on_end``
once it ended, completed or failed: in process that is the router's own ``submit``; a ZeroMQ client
adapts its awaitable call (``awaiting``). The same player drives virtual and live runs.

Closed loop (``concurrency=N``, the reference replay's ``replay_concurrency``): start times are ignored; the
first N sessions start at once and each next one, in start order, when a session ends (a session holds its
slot through its think times). A closed loop has no last start to time a drain from, so it stops instead when
no request has ended for ``stall_timeout_ns`` while some were in flight.

A trace's dependency graph (``harness.workload.traces``) plays the same way with plays for sessions (``GraphPlayer``):
a request goes when the requests it depends on were sent or ended, as its edges say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from array import array
from collections.abc import Awaitable, Callable, Iterator
from itertools import islice
from typing import Any

import anyio

from kvemu.clock import MAX_TIME_NS, NS_PER_S, Clock
from kvemu.messages import ClientRequest
from workers.hash_id_prompt import HashIdTokens

from harness.workload.lanes import LaneFigures, LanePlayer
from harness.workload.players import Player, Submit, awaiting
from harness.scenario import Scenario
from harness.workload.forms import Sessions
from harness.workload.trace_sessions import TraceSessions
from harness.workload.traces.graph import COMPLETION, DISPATCH, TraceGraph, grouped, indegrees, successors, targets
from harness.workload.turns import Session, SessionList, Turn, Workload

__all__ = ["Player", "Played", "SessionPlayer", "GraphPlayer", "Submit", "awaiting", "play_workload", "drain_deadline_s"]
# (``Player``, ``Submit`` and ``awaiting`` live in ``harness.workload.players``, shared with ``harness.workload.lanes``)


class SessionPlayer(Player):
    """Runs every session to its end (see the module doc); ``run`` returns when all have ended.

    A session is taken from ``sessions`` only when it starts (a loaded trace materializes it then)."""

    def __init__(self, sessions: SessionList | TraceSessions, submit: Submit, clock: Clock, *,
                 concurrency: int | None = None,
                 stall_timeout_ns: int | None = None) -> None:
        super().__init__(submit, clock, concurrency=concurrency, stall_timeout_ns=stall_timeout_ns)
        self.sessions = sessions
        self._queue: Iterator[Session] = iter(())  # closed loop: the sessions not started yet, in start order

    def _units(self) -> int:
        return len(self.sessions)

    def _begin(self) -> None:
        if self.concurrency is None:
            for i, start_ns in enumerate(self.sessions.start_times()):
                self._at(start_ns, self._start, i)
        else:
            self._queue = iter(self.sessions)
            for s in islice(self._queue, self.concurrency):
                self._turn(s, 0)

    def _start_next(self) -> None:
        following = next(self._queue, None)
        if following is not None:
            self._turn(following, 0)

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
        self._unit_ended()


class GraphPlayer(Player):
    """Plays a trace's dependency graph (``harness.workload.traces``): a unit is a play.

    Open loop: a root goes at its ``not_before``. Closed loop (``concurrency`` plays at a time, in order of their
    first root): a play's times count from when it started. Any other node goes once every incoming edge's
    trigger (its source's dispatch, or its end, completed or failed) happened plus the edge's delay, and not
    before its own ``not_before``. A request carries its node's session as its affinity key (``<play>:<session>``
    where plays share a session name): a sub-agent, being its own session, keeps its own. A failed request
    counts as ended: what waits for it still goes."""

    def __init__(self, graph: TraceGraph, submit: Submit, clock: Clock, *, concurrency: int | None = None,
                 stall_timeout_ns: int | None = None) -> None:
        super().__init__(submit, clock, concurrency=concurrency, stall_timeout_ns=stall_timeout_ns)
        self.graph = graph
        g = graph
        n = len(g)
        self._pending = indegrees(g.edge_end)
        self._due = array("q", bytes(8 * n))
        self._out_start, self._out = successors(g.edge_end, g.edge_source)
        self._target = targets(g.edge_end)
        plays = len(g.plays)
        self._play = array("I", (g.session_play[s] for s in g.session))  # node → its play
        self._play_start, self._members = grouped(self._play, plays)
        self._left = array("I", (self._play_start[p + 1] - self._play_start[p] for p in range(plays)))
        self._first = array("q", [MAX_TIME_NS]) * plays  # play → its earliest root's not_before
        for i in range(n):
            if not self._pending[i] and g.not_before_ns[i] < self._first[self._play[i]]:
                self._first[self._play[i]] = g.not_before_ns[i]
        self._queue: Iterator[int] = iter(())

    def _units(self) -> int:
        return len(self.graph.plays)

    def _begin(self) -> None:
        if self.concurrency is None:
            for p in range(len(self.graph.plays)):
                self._open_play(p, 0)
            return
        order = sorted(range(len(self.graph.plays)), key=self._first.__getitem__)
        self._queue = iter(order)
        for p in islice(self._queue, self.concurrency):
            self._open_play(p, self.clock.now_ns() - self._first[p])

    def _start_next(self) -> None:
        p = next(self._queue, None)
        if p is not None:
            self._open_play(p, self.clock.now_ns() - self._first[p])

    def _open_play(self, p: int, origin_ns: int) -> None:
        """Play ``p`` begins at ``origin_ns`` (its times count from there): its roots are timed."""
        g = self.graph
        for i in self._members[self._play_start[p]:self._play_start[p + 1]]:
            self._due[i] = origin_ns + g.not_before_ns[i]
            if not self._pending[i]:
                self._at(self._due[i], self._release, i)

    def _release(self, i: int) -> None:
        if self._stopped:
            return
        g = self.graph

        def ended(_outcome: Any) -> None:
            self._loop.call_soon(self._ended, i)  # type: ignore[union-attr]

        prompt = HashIdTokens(g.hash_ids(i), g.input_length[i], g.block_size)
        req = ClientRequest(request_id=g.request_id(i), tokens=prompt,  # type: ignore[arg-type]
                            max_tokens=max(1, g.output_length[i]), session_id=g.session_keys[g.session[i]])
        self._submit(req, ended)
        self._fire(i, DISPATCH)

    def _ended(self, i: int) -> None:
        if self._stopped:
            return
        self._fire(i, COMPLETION)
        p = self._play[i]
        self._left[p] -= 1
        if not self._left[p]:
            self._unit_ended()

    def _fire(self, i: int, trigger: int) -> None:
        """Node ``i``'s ``trigger`` happened now: each edge it times counts down its target."""
        g = self.graph
        now = self.clock.now_ns()
        for e in self._out[self._out_start[i]:self._out_start[i + 1]]:
            if g.edge_kind[e] & 1 != trigger:
                continue
            j = self._target[e]
            self._due[j] = max(self._due[j], now + g.edge_delay_ns[e])
            self._pending[j] -= 1
            if not self._pending[j]:
                self._at(self._due[j], self._release, j)


def _request(rid: str, turn: Turn, session_id: str | None, parent: str | None) -> ClientRequest:
    # in process ClientRequest.tokens is any Sequence[int] (its doc); the field declares the wire forms
    return ClientRequest(request_id=rid, tokens=turn.prompt(),  # type: ignore[arg-type]
                         max_tokens=turn.max_tokens, session_id=session_id,
                         parent_session_id=parent, worker_id=turn.worker_id)


def drain_deadline_s(scenario: Scenario, sessions: Workload) -> float:
    """Scenario seconds after which an open-loop run stops waiting: the last session start plus
    ``run.drain_timeout_s`` (a closed loop has none: it watches for stalls instead)."""
    if scenario.workload.concurrency is not None or getattr(scenario.workload, "lanes", None) is not None:
        return math.inf
    last = max(sessions.start_times(), default=0) / NS_PER_S
    return last + scenario.run.drain_timeout_s


@dataclass
class Played:
    """What ``play_workload`` leaves for the report beside the records: with lanes, their figures
    (``LanePlayer.report``) and each request's phase; both None without lanes."""

    lanes: LaneFigures | None = None
    phases: dict[str, str] | None = None

    @property
    def requests_cancelled(self) -> int:
        """Requests the lanes cancelled at their deadline (0 without lanes)."""
        return self.lanes.requests_cancelled if self.lanes is not None else 0


async def play_workload(scenario: Scenario, sessions: Sessions, submit: Submit, clock: Clock, *,
                        cancel: Callable[[str, str], Any] | None = None,
                        in_server: Callable[[], Awaitable[int | None]] | None = None,
                        out: Played | None = None) -> bool:
    """Play ``sessions`` (or a trace's graph) as the scenario says (open or closed loop, drain deadline, or lanes);
    False if cut short. With ``workload.lanes``, ``cancel(request_id, reason)`` ends the requests still open after
    the grace period (without it they are only given up on), the warm-up's barrier waits until ``await
    in_server()`` (requests the workers still work for) is 0 (without it, only for the warm-up's responses), and
    ``out`` gets the lanes' figures and each request's phase."""
    stall = round(scenario.run.drain_timeout_s * NS_PER_S)
    player: Player
    if isinstance(sessions, TraceGraph):  # (the one place that asks which form a workload is: to pick its player)
        lanes = getattr(scenario.workload, "lanes", None)
        if lanes is not None:
            lane_player = LanePlayer(sessions, lanes, submit, clock, cancel=cancel, in_server=in_server,
                                     stall_timeout_ns=stall)
            try:
                await lane_player.run()
            finally:
                if out is not None:
                    out.lanes, out.phases = lane_player.report(), lane_player.phases
            return not (lane_player.stalled or lane_player.failed_preparation)
        player = GraphPlayer(sessions, submit, clock, concurrency=scenario.workload.concurrency,
                             stall_timeout_ns=stall)
    else:
        player = SessionPlayer(sessions, submit, clock, concurrency=scenario.workload.concurrency,
                               stall_timeout_ns=stall)
    with anyio.move_on_after(drain_deadline_s(scenario, sessions)) as scope:
        await player.run()
    return not (scope.cancelled_caught or player.stalled)
