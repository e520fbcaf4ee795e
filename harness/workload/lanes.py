"""Continuous agentic lanes: a fixed number of client lanes replaying whole plays of a trace graph, in phases.

A lane holds one *play instance* at a time: a copy of one play of the corpus with its own request ids
(``i<k>:<request id>``), conversation ids (``i<k>:<session key>``) and cache identity (its hash ids renumbered
into a range no other instance uses, so instances never share KV while the prefixes inside one still do). When
an instance ended (every request it sent ended, completed or failed), its lane takes the next play from one
shared corpus cursor, in the corpus order (plays by their first root, then by index).

* Lanes only (``duration_s`` None, no snapshot): the corpus runs once, at most ``lanes`` plays at a time.
* Snapshot (``snapshot_seed``): each lane's first play is cut at a seeded point of its recorded span; what
  started before is history and is not sent, and an edge from history becomes a timer (see ``_snapshot``).
  Without ``duration_s`` only those first plays run.
* Warm-up (``warmup``): before measuring, each lane sends, one after another, a *primer* per conversation that
  has history and requests left (the input of its last historical request, 1 output token), then
  ``warmup_requests`` requests repeating its primers (or its earliest remaining request), 1 output token each.
  When every lane is done and the server settled (``in_server`` is 0, or ``settle_timeout_s`` passed: the barrier),
  measurement starts and the plays' timers start.
* Continuous profile (``duration_s``): lanes keep taking plays, the cursor wrapping around the corpus, until
  ``duration_s`` after the start of measurement. Then nothing new is sent; responses count for ``grace_s`` more,
  and what is still open is then cancelled (reason ``lanes_deadline``). Idle guards: a play with nothing in flight
  whose next timer is more than ``tree_idle_cap_s`` away, or a client with nothing in flight whose next timer is
  more than ``global_idle_cap_s`` away, has its pending timers moved earlier (keeping their gaps) to that cap.

Affinity comes from the play's lineage: a request's ``session_id`` is its instance's conversation; a conversation
spawned (a ``spawn`` edge) by exactly one other conversation carries it as ``parent_session_id`` (the router's
sibling group). Several distinct parents, a spawn from itself, or such an ancestor, gives no parent.

Everything is a function of the graph, the options and the outcomes' times: the snapshot's draw is a blake3 of
the seed and the play, and no set of strings is iterated.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import blake3
import msgspec

from kvemu.clock import MAX_TIME_NS, NS_PER_S, Clock
from kvemu.messages import ClientRequest
from workers.hash_id_prompt import HashIdTokens

from harness.workload.players import Player, Submit
from harness.scenario import LanesSpec
from harness.workload.traces.graph import COMPLETION, DISPATCH, MAX_SESSION_BYTES, SPAWN, TraceGraph, grouped, indegrees
from harness.workload.traces.graph import successors, targets
from harness.workload.traces.timing import release_times

__all__ = ["LanePlayer", "LaneFigures", "Cancel", "PRIMER", "WARMUP", "PROFILE", "DEADLINE_REASON", "WARMUP_FAILED_REASON",
           "conversation_parents",
           "snapshot_cut"]

PRIMER, WARMUP, PROFILE = "primer", "warmup", "profile"
DEADLINE_REASON = "lanes_deadline"
"""The failure of a request still open when the grace period after ``duration_s`` ended."""
WARMUP_FAILED_REASON = "warmup_failed"
"""The failure of a warm-up request still open when another one failed (the run stops)."""
SNAPSHOT_DOMAIN = b"kvemu.lanes.snapshot.v1"

Cancel = Callable[[str, str], Any]
"""``cancel(request_id, reason)``: ends an open request at the server (the router's ``cancel``)."""
InServer = Callable[[], Awaitable[int | None]]
"""``await in_server()``: how many requests the server's workers still work for (unfinished, KV held for a
transfer, being offloaded); 0 when the server has settled, None when it cannot tell (a worker did not answer).
The warm-up's barrier waits for 0."""
CANCEL_DRAIN_S = 10.0
"""A live load generator that cancelled requests at the deadline waits at most this long (wall clock) for the
server to acknowledge them (their records back, or the workers settled) before it reports."""
SETTLE_POLL_NS = 10_000_000
"""How often the barrier asks the server whether it settled (10 ms; virtual time in a virtual run)."""

# a node's state within its instance
_WAITING, _TIMED, _SENT, _ENDED, _HISTORY, _DROPPED = range(6)


def conversation_parents(g: TraceGraph) -> list[int]:
    """Each session's parent session (index), or -1: the one other session whose requests spawn its requests.
    Several distinct parents, a spawn from the session itself, a cycle, or such an ancestor: -1 (no lineage)."""
    spawners: list[list[int]] = [[] for _ in g.sessions]
    for i in range(len(g)):
        s = g.session[i]
        for e in g.edges(i):
            if e.relation == SPAWN:
                p = g.session[e.source]
                if p not in spawners[s]:
                    spawners[s].append(p)
    parent = [-1] * len(g.sessions)
    bad = bytearray(len(g.sessions))
    for s, found in enumerate(spawners):
        if len(found) > 1 or s in found:
            bad[s] = 1
        elif found:
            parent[s] = found[0]
    for s in range(len(parent)):  # an ancestor without lineage (or a cycle) takes it from its descendants
        seen = {s}
        a = parent[s]
        while a >= 0 and not bad[s]:
            if a in seen or bad[a]:
                bad[s] = 1
            seen.add(a)
            a = parent[a]
    return [-1 if bad[s] else p for s, p in enumerate(parent)]


def snapshot_cut(seed: int, play: str, lane: int, ordinal: int, first_ns: int, last_ns: int) -> int:
    """The snapshot's cut of a play whose recorded starts span [first, last]: first + (0.25 + 0.5 u)(last - first)
    with u in [0, 1) drawn from blake3 of the seed, the play's name, the lane and the instance's ordinal."""
    h = blake3.blake3(SNAPSHOT_DOMAIN)
    for part in (str(seed), play, str(lane), str(ordinal)):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little") + data)
    u = int.from_bytes(h.digest(8), "little") / 2**64
    return first_ns + int((0.25 + 0.5 * u) * (last_ns - first_ns))


class _Instance:
    """One play instance on a lane: its nodes' states, times and its cache identity."""

    __slots__ = ("k", "play", "lane", "origin", "nodes", "pending", "floor", "due", "state", "left", "outstanding",
                 "hash_base", "started", "ended", "cut")

    def __init__(self, k: int, play: int, lane: int, nodes: list[int], indegree: list[int], floor: list[int],
                 hash_base: int) -> None:
        self.k = k
        self.play = play
        self.lane = lane
        self.origin = 0
        self.nodes = nodes
        self.pending = indegree
        self.floor = floor  # each node's earliest time after the instance's start
        self.due = [0] * len(nodes)
        self.state = bytearray(len(nodes))
        self.left = len(nodes)  # nodes not ended (nor history, nor dropped)
        self.outstanding = 0
        self.hash_base = hash_base
        self.started = False
        self.ended = False
        self.cut = False  # the deadline dropped some of its requests


class LaneFigures(msgspec.Struct, frozen=True, kw_only=True):
    """What a lane player did (``LanePlayer.report``, ``RunData.lanes``): its settings, the corpus it recycled, the
    plays and requests by fate, its idle guards, and when each phase started and ended (``phase_times_ms``)."""

    lanes: int
    duration_s: float | None
    grace_s: float
    snapshot_seed: int | None
    warmup: bool
    corpus_plays: int
    corpus_cursor: int
    failed_preparation: bool
    unsettled_server_requests: int | None
    requests_issued: int
    requests_cancelled: int
    requests_never_issued: int
    plays_started: int
    idle_shifts_tree: int
    idle_shifts_global: int
    plays_completed: int
    plays_cut: int
    phase_times_ms: dict[str, tuple[float, float]]
    """Each phase the player timed -> (start, end) ms since the clock's zero."""


class LanePlayer(Player):
    """Plays a trace graph on lanes (see the module doc); ``run`` returns when the lanes are done, or the deadline
    and its grace passed. ``phases`` maps each sent request id to its phase; ``report()`` is the run's figures."""

    def __init__(self, graph: TraceGraph, spec: LanesSpec, submit: Submit, clock: Clock, *,
                 cancel: Cancel | None = None, in_server: InServer | None = None,
                 stall_timeout_ns: int | None = None) -> None:
        super().__init__(submit, clock, concurrency=spec.lanes, stall_timeout_ns=stall_timeout_ns)
        self.graph = g = graph
        self.spec = spec
        self.cancel = cancel
        self.in_server = in_server
        """Asked at the warm-up's barrier until the server settled (None: the barrier does not wait for it)."""
        self.unsettled: int | None = None
        """Requests still in the server when the barrier opened (its settle timeout passed first when > 0);
        None: no warm-up, nobody to ask, or the server could not tell at the timeout."""
        self._settling: asyncio.Task[None] | None = None
        self._settle_error: BaseException | None = None
        plays = len(g.plays)
        if not plays:
            raise ValueError("the trace has no plays")
        recycle = spec.duration_s is not None
        if not recycle and spec.snapshot_seed is None and spec.lanes > plays:
            raise ValueError(f"workload.lanes.lanes: {spec.lanes} lanes for a corpus of {plays} plays run once: a "
                             "lane would never have a play; use at most that many lanes, or set duration_s to recycle")
        self._play = array("I", (g.session_play[s] for s in g.session))
        self._play_start, self._members = grouped(self._play, plays)
        self._local = array("I", bytes(4 * len(g)))
        for p in range(plays):
            for j, i in enumerate(self._members[self._play_start[p]:self._play_start[p + 1]]):
                self._local[i] = j
        self._indegree = indegrees(g.edge_end)
        self._out_start, self._out = successors(g.edge_end, g.edge_source)
        self._target = targets(g.edge_end)
        first = [MAX_TIME_NS] * plays
        for i in g.roots():
            first[self._play[i]] = min(first[self._play[i]], g.not_before_ns[i])
        self.order = sorted(range(plays), key=lambda p: (first[p], p))
        """The corpus order the cursor walks: plays by their first root's ready time, then by index."""
        self._ranks: list[dict[int, int] | None] = [None] * plays  # play → its hash ids' ranks (made when first used)
        self._parents = conversation_parents(g)
        self._recorded: array[int] | None = None  # each node's recorded start (made for a snapshot)
        self.phases: dict[str, str] = {}
        """Each sent request's phase (``primer``, ``warmup``, ``profile``)."""
        self.cursor = 0
        """Plays the corpus cursor handed out (the next is ``order[cursor % plays]``)."""
        self.instances: list[_Instance] = []
        self._hash_next = 1
        self._deadline = MAX_TIME_NS
        self._closing = False  # the deadline passed: nothing new is sent
        self._open_ids: dict[str, tuple[_Instance, int] | None] = {}  # in flight → (instance, node); None: warm-up
        self.failed_preparation = False
        """The warm-up stopped the run: one of its requests failed."""
        self.counts = {"requests_issued": 0, "requests_cancelled": 0, "requests_never_issued": 0,
                       "plays_started": 0, "idle_shifts_tree": 0, "idle_shifts_global": 0}
        self.times: dict[str, list[int]] = {}  # phase → [start, end] (ns)

    # ------------------------------------------------------------------ run

    def _units(self) -> int:
        return self.spec.lanes

    def _start_next(self) -> None:
        """A lane takes its next play itself (``_check_done``)."""

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            if self._settling is not None and not self._settling.done():
                self._settling.cancel()
        if self._settle_error is not None:
            raise self._settle_error
        self._close_open()

    def _begin(self) -> None:
        spec = self.spec
        now = self.clock.now_ns()
        for lane in range(spec.lanes):
            inst = self._new_instance(lane, first=True)
            if inst is not None and spec.snapshot_seed is not None:
                self._snapshot(inst)
        if spec.warmup:
            self.times[PRIMER] = [now, now]
            self._prepare()
            return
        self._measure()

    def _measure(self) -> None:
        """Measurement starts now: the lanes' first plays' timers start, the deadline is set."""
        now = self.clock.now_ns()
        self.times[PROFILE] = [now, now]
        if self.spec.duration_s is not None:
            self._deadline = now + round(self.spec.duration_s * NS_PER_S)
            self._at(self._deadline, self._close)
        for inst in list(self.instances):
            self._start(inst, now)
        self._global_guard()

    def _new_instance(self, lane: int, first: bool = False) -> _Instance | None:
        """The lane's next play from the cursor (a snapshot's first plays: lane modulo the corpus), or None when
        the corpus ran out (not recycling)."""
        plays = len(self.order)
        if first and self.spec.snapshot_seed is not None:
            p = self.order[lane % plays]
        else:
            if self.spec.duration_s is None and self.cursor >= plays:
                return None
            if self.spec.duration_s is None and self.spec.snapshot_seed is not None:
                return None  # a snapshot without a profile runs only the lanes' first plays
            p = self.order[self.cursor % plays]
            self.cursor += 1
        nodes = list(self._members[self._play_start[p]:self._play_start[p + 1]])
        ranks = self._ranks[p]
        if ranks is None:
            ids = sorted({h for i in nodes for h in self.graph.hash_ids(i)})
            ranks = self._ranks[p] = {h: r for r, h in enumerate(ids)}
        inst = _Instance(len(self.instances), p, lane, nodes, [self._indegree[i] for i in nodes],
                         [self.graph.not_before_ns[i] for i in nodes], self._hash_next)
        self._hash_next += len(ranks)
        self.instances.append(inst)
        return inst

    def _start(self, inst: _Instance, origin: int) -> None:
        """``inst`` begins at ``origin``: its nodes without pending edges are timed."""
        inst.origin = origin
        inst.started = True
        self.counts["plays_started"] += 1
        for j in range(len(inst.nodes)):
            if inst.state[j] == _WAITING:
                inst.due[j] = origin + inst.floor[j]
                if not inst.pending[j]:
                    self._time(inst, j)
        self._tree_guard(inst)  # (a snapshot's first request may wait long on its history)

    # ------------------------------------------------------------------ snapshot

    def _snapshot(self, inst: _Instance) -> None:
        """Cut ``inst`` at its seeded point: nodes that started before are history; a live node's edges from history
        become a floor (relative to the instance's start), its edges from live nodes stay pending."""
        g = self.graph
        if self._recorded is None:
            self._recorded = release_times(g, lambda i: g.api_time_ns.get(i, 0))
        rec = self._recorded
        starts = [rec[i] for i in inst.nodes]
        cut = snapshot_cut(self.spec.snapshot_seed or 0, g.plays[inst.play], inst.lane, 0, min(starts), max(starts))
        for j, i in enumerate(inst.nodes):
            if rec[i] < cut:
                inst.state[j] = _HISTORY
                inst.left -= 1
        for j, i in enumerate(inst.nodes):
            if inst.state[j] == _HISTORY:
                continue
            floor = max(0, g.not_before_ns[i] - cut)
            pending = 0
            for e in g.edges(i):
                src = self._local[e.source]
                if inst.state[src] != _HISTORY:
                    pending += 1
                    continue
                at = rec[e.source] + (g.api_time_ns.get(e.source, 0) if e.trigger == COMPLETION else 0)
                floor = max(floor, at + e.delay_ns - cut)
            inst.pending[j] = pending
            inst.floor[j] = floor

    # ------------------------------------------------------------------ warm-up

    def _prepare(self) -> None:
        """Each lane sends its primers, then its warm-up requests, one at a time; the barrier waits for all lanes."""
        g = self.graph
        waiting = [0]
        for inst in self.instances:
            last: dict[int, int] = {}  # session → its last historical node (local), by recorded start
            live: set[int] = set()
            earliest = -1
            rec = self._recorded
            assert rec is not None
            for j, i in enumerate(inst.nodes):
                s = g.session[i]
                if inst.state[j] == _HISTORY:
                    k = last.get(s)
                    if k is None or rec[inst.nodes[k]] <= rec[i]:
                        last[s] = j
                else:
                    live.add(s)
                    if earliest < 0 or rec[i] < rec[inst.nodes[earliest]]:
                        earliest = j
            primers = [j for s, j in sorted(last.items()) if s in live]
            repeat = primers or ([earliest] if earliest >= 0 else [])
            plan = [(PRIMER, j) for j in primers]
            plan += [(WARMUP, repeat[n % len(repeat)]) for n in range(self.spec.warmup_requests if repeat else 0)]
            if plan:
                waiting[0] += 1
                self._prep_step(inst, plan, 0, waiting)
        if not waiting[0]:
            self._barrier()

    def _prep_step(self, inst: _Instance, plan: list[tuple[str, int]], n: int, waiting: list[int]) -> None:
        if self._stopped or self.failed_preparation:
            return
        if n == len(plan):
            waiting[0] -= 1
            if not waiting[0]:
                self._barrier()
            return
        phase, j = plan[n]
        now = self.clock.now_ns()
        if phase == WARMUP and WARMUP not in self.times:
            self.times[WARMUP] = [now, now]
        rid = f"i{inst.k}:{phase}:{n}"

        def ended(outcome: Any) -> None:
            self._open_ids.pop(rid, None)
            self.times[phase][1] = max(self.times[phase][1], self.clock.now_ns())
            if getattr(outcome, "failure", None) is not None:
                self._fail_preparation()
                return
            self._loop.call_soon(self._prep_step, inst, plan, n + 1, waiting)  # type: ignore[union-attr]

        self._send(inst, j, rid, phase, 1, ended)

    def _fail_preparation(self) -> None:
        if self.failed_preparation:
            return
        self.failed_preparation = True
        self._stopped = True
        assert self._done is not None
        self._done.set()

    def _barrier(self) -> None:
        if PRIMER in self.times and WARMUP not in self.times:
            self.times[WARMUP] = list(self.times[PRIMER][1:] * 2)
        if self.in_server is None:
            self._measure()
            return
        assert self._loop is not None
        self._settling = self._loop.create_task(self._settle(self.in_server))

    async def _settle(self, in_server: InServer) -> None:
        """The barrier's second half: wait until the server settled (no request running, waiting, holding KV for
        a transfer or being offloaded), asking every ``SETTLE_POLL_NS``, at most ``settle_timeout_s``; then
        measure, recording what was still in the server."""
        try:
            limit = self.clock.now_ns() + round(self.spec.settle_timeout_s * NS_PER_S)
            while True:
                n = await in_server()
                now = self.clock.now_ns()
                if self._stopped:
                    return
                if n == 0 or now >= limit:
                    break
                woken = anyio.Event()
                self._at(min(now + SETTLE_POLL_NS, limit), woken.set)
                await woken.wait()
            self.unsettled = n
            self._measure()
        except Exception as exc:  # noqa: BLE001 - handed to run(), which raises it
            self._settle_error = exc
            self._stopped = True
            assert self._done is not None
            self._done.set()

    # ------------------------------------------------------------------ replay

    def _time(self, inst: _Instance, j: int) -> None:
        inst.state[j] = _TIMED
        self._at(inst.due[j], self._release, inst, j, inst.due[j])

    def _release(self, inst: _Instance, j: int, when: int) -> None:
        if self._stopped or inst.state[j] != _TIMED or inst.due[j] != when:
            return  # stopped, or the timer moved (an idle shift)
        if self._closing or self.clock.now_ns() >= self._deadline:
            return
        i = inst.nodes[j]
        rid = f"i{inst.k}:{self.graph.request_id(i)}"
        inst.state[j] = _SENT
        inst.outstanding += 1
        self.counts["requests_issued"] += 1

        def ended(_outcome: Any) -> None:
            self._loop.call_soon(self._ended, inst, j, rid)  # type: ignore[union-attr]

        self._send(inst, j, rid, PROFILE, max(1, self.graph.output_length[i]), ended)
        self._fire(inst, j, DISPATCH)

    def _send(self, inst: _Instance, j: int, rid: str, phase: str, max_tokens: int,
              ended: Callable[[Any], None]) -> None:
        g = self.graph
        i = inst.nodes[j]
        ranks = self._ranks[inst.play]
        assert ranks is not None
        ids = [inst.hash_base + ranks[h] for h in g.hash_ids(i)]
        s = g.session[i]
        parent = self._parents[s]
        req = ClientRequest(request_id=rid, tokens=HashIdTokens(ids, g.input_length[i], g.block_size),  # type: ignore[arg-type]
                            max_tokens=max_tokens, session_id=self._key(inst, s),
                            parent_session_id=self._key(inst, parent) if parent >= 0 else None)
        self.phases[rid] = phase
        self._open_ids[rid] = (inst, j) if phase == PROFILE else None
        self._submit(req, ended)

    def _key(self, inst: _Instance, s: int) -> str:
        """The instance's conversation id of session ``s`` (hashed when it would pass a router's key limit)."""
        key = f"i{inst.k}:{self.graph.session_keys[s]}"
        if len(key.encode()) > MAX_SESSION_BYTES:
            key = f"i{inst.k}:{blake3.blake3(self.graph.session_keys[s].encode()).hexdigest()}"
        return key

    def _ended(self, inst: _Instance, j: int, rid: str) -> None:
        self._open_ids.pop(rid, None)
        if inst.state[j] != _SENT:
            return  # cancelled at the end of the grace period
        inst.state[j] = _ENDED
        inst.outstanding -= 1
        inst.left -= 1
        now = self.clock.now_ns()
        self.times[PROFILE][1] = max(self.times[PROFILE][1], now)
        if self._stopped:
            return
        self._fire(inst, j, COMPLETION)
        self._check_done(inst)
        if not inst.ended:
            self._tree_guard(inst)
        self._global_guard()
        if self._closing and not self._in_flight:
            self._finish()

    def _fire(self, inst: _Instance, j: int, trigger: int) -> None:
        g = self.graph
        now = self.clock.now_ns()
        i = inst.nodes[j]
        for e in self._out[self._out_start[i]:self._out_start[i + 1]]:
            if g.edge_kind[e] & 1 != trigger:
                continue
            k = self._local[self._target[e]]
            inst.due[k] = max(inst.due[k], now + g.edge_delay_ns[e])
            inst.pending[k] -= 1
            if not inst.pending[k] and inst.state[k] == _WAITING:
                self._time(inst, k)

    def _check_done(self, inst: _Instance) -> None:
        """An instance whose nodes all ended (or that will send nothing more) frees its lane."""
        if inst.ended or inst.left:
            return
        inst.ended = True
        if self._closing or self.clock.now_ns() >= self._deadline:
            return  # (the deadline's own timer closes the run)
        nxt = self._new_instance(inst.lane)
        if nxt is None:
            self._unit_ended()
            return
        self._start(nxt, self.clock.now_ns())

    # ------------------------------------------------------------------ idle guards

    def _shift(self, inst: _Instance, by: int) -> None:
        inst.origin -= by
        for j in range(len(inst.nodes)):
            if inst.state[j] == _TIMED:
                inst.due[j] -= by
                self._at(inst.due[j], self._release, inst, j, inst.due[j])
            elif inst.state[j] == _WAITING:
                inst.due[j] -= by

    def _next_due(self, inst: _Instance) -> int:
        return min((inst.due[j] for j in range(len(inst.nodes)) if inst.state[j] == _TIMED), default=MAX_TIME_NS)

    def _tree_guard(self, inst: _Instance) -> None:
        cap = self.spec.tree_idle_cap_s
        if cap is None or self.spec.duration_s is None or inst.outstanding or self._closing:
            return
        limit = self.clock.now_ns() + round(cap * NS_PER_S)
        due = self._next_due(inst)
        if limit < due < MAX_TIME_NS:
            self._shift(inst, due - limit)
            self.counts["idle_shifts_tree"] += 1

    def _global_guard(self) -> None:
        cap = self.spec.global_idle_cap_s
        if cap is None or self.spec.duration_s is None or self._in_flight or self._closing:
            return
        live = [inst for inst in self.instances if inst.started and not inst.ended]
        due = min((self._next_due(inst) for inst in live), default=MAX_TIME_NS)
        limit = self.clock.now_ns() + round(cap * NS_PER_S)
        if limit < due < MAX_TIME_NS:
            for inst in live:
                self._shift(inst, due - limit)
            self.counts["idle_shifts_global"] += 1

    # ------------------------------------------------------------------ deadline

    def _close(self) -> None:
        """The deadline: nothing new goes; what is open has ``grace_s`` to end, then it is cancelled."""
        if self._stopped:
            return
        self._closing = True
        for inst in self.instances:
            if inst.started and not inst.ended:
                for j in range(len(inst.nodes)):
                    if inst.state[j] in (_WAITING, _TIMED):
                        inst.cut = True
                        inst.state[j] = _DROPPED
                        inst.left -= 1
                        self.counts["requests_never_issued"] += 1
        if not self._in_flight:
            self._finish()
            return
        self._at(self._deadline + round(self.spec.grace_s * NS_PER_S), self._finish)

    def _finish(self) -> None:
        if self._done is not None and not self._done.is_set():
            self._done.set()

    def _close_open(self) -> None:
        """Cancel what is still open (the grace period ended, or the run stopped), recording each."""
        for rid in sorted(self._open_ids):
            node = self._open_ids[rid]
            if node is not None:
                node[0].state[node[1]] = _DROPPED
            self.counts["requests_cancelled"] += 1
            if self.cancel is not None:
                self.cancel(rid, WARMUP_FAILED_REASON if self.failed_preparation else DEADLINE_REASON)
        self._open_ids.clear()

    def report(self) -> LaneFigures:
        """The lanes' figures for the summary (``kvemu.lanes``), without the per-phase request counts."""
        spec, counts = self.spec, self.counts
        return LaneFigures(
            lanes=spec.lanes, duration_s=spec.duration_s, grace_s=spec.grace_s, snapshot_seed=spec.snapshot_seed,
            warmup=spec.warmup, corpus_plays=len(self.order), corpus_cursor=self.cursor,
            failed_preparation=self.failed_preparation, unsettled_server_requests=self.unsettled,
            requests_issued=counts["requests_issued"], requests_cancelled=counts["requests_cancelled"],
            requests_never_issued=counts["requests_never_issued"], plays_started=counts["plays_started"],
            idle_shifts_tree=counts["idle_shifts_tree"], idle_shifts_global=counts["idle_shifts_global"],
            plays_completed=sum(1 for inst in self.instances if inst.ended and not inst.cut),
            plays_cut=sum(1 for inst in self.instances if inst.started and (inst.cut or not inst.ended)),
            phase_times_ms={phase: (span[0] / 1e6, span[1] / 1e6) for phase, span in sorted(self.times.items())})
