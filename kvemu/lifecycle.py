"""The router's request lifecycle as one explicit, sans-IO state machine.

A request moves through these stages::

    submit ─► (waiting for workers) ─► attempt ─► (waiting for affinity) ─► (queued) ─► DISPATCHED ─► RUNNING ─► end
                                         ▲                                                 │  refused,   │  worker lost
                                         └──── retry (refused rank excluded) ◄─────────────┘  timed out  │  before a token

A request of a session acquires its affinity first, as Dynamo's router does: while another request
initializes the session it waits outside the queue; an initializer keeps its initialization, and a
bound request its lease, while it waits in the queue (a bound one in its rank's lane, its cost measured
by the cache on that rank). The queue releases one request at a time, each booked before the next is
judged.

``DISPATCHED``: selected, load booked, ``Dispatch`` sent, affinity hold open. The worker's acceptance
commits the hold into a lease; a refusal, a timeout or a lost worker frees the load, drops the hold and
re-selects elsewhere, up to ``retry_limit``. ``RUNNING`` ends with ``Finished`` or ``RequestFailed``,
which free the load and release the lease. Every request ends exactly once, completed or failed with a
reason, and ``on_end`` receives its record.

The machine does no I/O and reads no clock of its own: it is told messages (``on_ack``, ``on_tokens``,
``on_finished``, ``on_failed``, with the worker they came from), worker changes (``worker_added``,
``worker_lost``) and time (``poll``; ``next_deadline_ns`` says when it next needs to be polled). It sends
through the ``send`` callable it is given. The router actor is one host; a simulation host can drive it
directly. A transition that frees capacity or settles an affinity binding wakes other requests; those
continue after the current call's own transition, in the order they were woken (as tasks would).
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import msgspec

from kvemu.affinity import AffinityMode, Hold, SessionAffinity, Wait, sibling_group_key
from kvemu.clock import NS_PER_S, Clock
from kvemu.eligibility import Candidates
from kvemu.errors import InvalidArgument, KvemuError, ResourceExhausted, SchedulerError
from kvemu.queue import DoNotQueue, PolicyQueue, QueueEntry, QueueRejected
from kvemu.records import EngineFacts, RequestRecord, router_record
from kvemu.routing_core import PreparedRequest, RoutingCore
from kvemu.hooks import DUPLICATE, HookKind, Hooks, QueueDepth, Reason, Routed, TokenTimes
from kvemu.messages import Abort, ClientRequest, Dispatch, DispatchAck, Finished, RequestFailed, TokenBatch

__all__ = ["Lifecycle", "LifecycleSettings", "TruthProbe", "Flight", "WAITING", "QUEUED", "AFFINITY", "DISPATCHED",
           "RUNNING", "ENDED", "TRANSITIONS"]

WAITING, QUEUED, AFFINITY, DISPATCHED, RUNNING, ENDED = "waiting", "queued", "affinity", "dispatched", "running", "ended"
"""Stages: waiting for a first worker, in the policy queue, waiting for a session's binding to settle,
dispatched (awaiting the worker's acknowledgement), running on a worker, ended."""

_ATTEMPT = frozenset({AFFINITY, QUEUED, DISPATCHED, ENDED})
"""Where an attempt leads: wait for the session's binding, queue, dispatch, or end (no rank, retries used up)."""

TRANSITIONS: dict[str, frozenset[str]] = {
    WAITING: _ATTEMPT,  # a first worker registered (or the grace ended): the first attempt
    AFFINITY: _ATTEMPT,  # the binding settled: the attempt goes on, and may wait again
    QUEUED: _ATTEMPT,  # released to a rank, or stranded (its every rank gone) and admitted over again
    DISPATCHED: _ATTEMPT | {RUNNING},  # accepted; or refused, timed out, lost: the next attempt
    RUNNING: _ATTEMPT,  # finished or failed; or lost before its first token: the next attempt
    ENDED: frozenset(),
}
"""The stages a request may move to from each: every stage change goes through ``Lifecycle._enter``, which
holds it to this table."""

log = logging.getLogger("kvemu.lifecycle")

FIRST_TOKEN_TIMEOUT = "first_token_timeout"
"""Why an accepted attempt ended when its worker produced no first token in time (``first_token_timeout_ns``)."""

Send = Callable[[int, Dispatch | Abort], None]
"""Delivers a message to a worker (by worker id): a ``Dispatch``, or an ``Abort`` for a cancelled request."""
TruthProbe = Callable[[list[int], "tuple[tuple[int, int], ...]", tuple[int, int], "str | None"],
                      "tuple[int, int, str | None]"]
"""``truth(prompt sequence hashes, eligible ranks, chosen rank, session id)`` -> (chosen rank's cached blocks, the
most any eligible rank has, where the lost blocks were: ``peer`` | ``cache_owner`` | ``shared`` | None)."""


class LifecycleSettings:
    """The lifecycle's knobs (``RouterSettings`` carries them for the router actor)."""

    __slots__ = ("retry_limit", "dispatch_timeout_ns", "startup_grace_ns", "request_deadline_ns", "max_unacked",
                 "probation_ack_timeout_ns", "first_token_timeout_ns")

    def __init__(self, retry_limit: int = 3, dispatch_timeout_s: float = 10.0, startup_grace_s: float = 5.0,
                 request_deadline_s: float | None = 3600.0, max_unacked: int = 3,
                 probation_ack_timeout_s: float | None = None, first_token_timeout_s: float | None = None) -> None:
        self.retry_limit = retry_limit
        self.dispatch_timeout_ns = round(dispatch_timeout_s * NS_PER_S)
        self.startup_grace_ns = round(startup_grace_s * NS_PER_S)
        self.request_deadline_ns = None if request_deadline_s is None else round(request_deadline_s * NS_PER_S)
        """A request still open this long after it arrived fails with ``deadline_exceeded`` (None: never)."""
        self.max_unacked = max_unacked
        """Dispatches in a row a worker may leave unacknowledged before the host is told it is unresponsive."""
        self.probation_ack_timeout_ns = _ns(probation_ack_timeout_s)
        """A worker that has acknowledged no dispatch yet (``proven``) has this long to acknowledge one; a miss
        reports it unresponsive at once and does not count against the request's retries (None: off, the
        ordinary ``dispatch_timeout`` applies to every worker)."""
        self.first_token_timeout_ns = _ns(first_token_timeout_s)
        """An accepted request with no first token this long after its acceptance ends its attempt with
        ``first_token_timeout`` (None: never)."""


class Flight:
    """One request on its way: the client's request, its record, and where the current attempt stands."""

    __slots__ = ("request_id", "req", "record", "prepared", "on_end", "stage", "attempt", "token", "refused",
                 "builder", "key", "hold", "lease", "failure", "can_retry", "on_finished", "refusal", "spared")

    def __init__(self, req: ClientRequest, record: RequestRecord, prepared: PreparedRequest,
                 on_end: Callable[[RequestRecord], None], can_retry: Callable[[], bool] | None = None,
                 on_finished: Callable[[Finished], None] | None = None) -> None:
        self.request_id = req.request_id
        self.req = req
        self.record = record
        self.prepared = prepared
        self.on_end = on_end
        self.stage = WAITING
        self.attempt = 0
        self.token = 0
        """Changes at every step that invalidates pending timers and wake-ups."""
        self.refused: list[tuple[int, int]] = []
        """Ranks that turned this request away (or were lost under it): excluded from later attempts."""
        self.builder: Any = None
        self.key: tuple[int, int] | None = None
        self.hold: Hold | None = None
        self.lease: Any = None
        self.failure: str | None = None
        """Why the current attempt ended without completing (it may still be retried)."""
        self.can_retry = can_retry
        """Whether a running attempt lost before its first token may run elsewhere (None: always)."""
        self.on_finished = on_finished
        """Told the worker's ``Finished`` before the request ends (a prefill leg's carries its KV's whereabouts)."""
        self.refusal: str | None = None
        """The last rank that turned this request away, and why: a request left with no rank says it."""
        self.spared = 0
        """Attempts that missed a worker on probation: they do not count against ``retry_limit``."""

    def __repr__(self) -> str:
        return f"Flight({self.request_id!r}, {self.stage}, attempt={self.attempt}, key={self.key})"


class Lifecycle:
    """Every request of one pool from arrival to its end; see the module doc."""

    def __init__(
        self,
        core: RoutingCore,
        *,
        send: Send,
        clock: Clock,
        hooks: Hooks | None = None,
        settings: LifecycleSettings | None = None,
        affinity: SessionAffinity | None = None,
        queue: PolicyQueue | None = None,
        unavailable: set[tuple[int, int]] | None = None,
        on_deadline: Callable[[int], None] | None = None,
        on_unresponsive: Callable[[int, int], None] | None = None,
        on_stalled: Callable[[int, int], None] | None = None,
    ) -> None:
        self.core = core
        self.clock = clock
        self.hooks = hooks or Hooks()
        self.settings = settings or LifecycleSettings()
        self.affinity = affinity
        self.queue = queue
        self.unavailable = unavailable if unavailable is not None else set()
        """Ranks no attempt may choose (ranks that went down); the host shares and updates the set."""
        self.on_deadline = on_deadline
        """Told each deadline that is now the first of its kind (dispatch timeout, request deadline, startup
        grace): a host arms its timer for the earliest it was told, and re-arms at ``next_deadline_ns`` after ``poll``."""
        self.on_unresponsive = on_unresponsive
        """Told ``(worker_id, unacknowledged dispatches in a row)`` once a worker reaches ``max_unacked``
        (and at every further timeout): the host should stop routing to it (the router removes it)."""
        self.unacked: dict[int, int] = {}
        """Per worker, dispatches in a row that timed out unacknowledged (kept across re-registrations until
        the worker acknowledges one, so a worker that never does is dropped again at its first timeout)."""
        self.on_stalled = on_stalled
        """Told ``(worker_id, first-token timeouts in a row)`` when a worker should be stopped routing to: at
        its first such timeout if it never produced a first token since it registered, else at ``max_unacked``
        in a row."""
        self.stalls: dict[int, int] = {}
        """Per registered worker, accepted requests in a row that produced no first token in time."""
        self.proven: set[int] = set()
        """Workers that acknowledged a dispatch since they registered (the others are on probation)."""
        self.productive: set[int] = set()
        """Workers that produced a first token since they registered."""
        self.before_select: Callable[[], None] | None = None
        """Called before every selection: a host whose workers publish KV events lazily brings them up to
        the present here, so the router decides on what the engines did up to now."""
        self.truth: TruthProbe | None = None
        """Asked at every selection what the eligible ranks' engines really hold of the prompt (a host whose
        engines it can read: the routing truth's regret); fills the record's ``truth_*`` and ``regret_source``."""
        self._send = send
        self.flights: dict[str, Flight] = {}
        self._by_worker: dict[int, dict[str, None]] = {}
        self._timeouts: deque[tuple[int, Flight, int]] = deque()  # (deadline, flight, token), in deadline order
        self._first_tokens: deque[tuple[int, Flight, int]] = deque()  # the same, for first tokens
        # (arrival + request deadline, request id, record), in order; the record tells a reused id apart
        self._expiries: deque[tuple[int, str, RequestRecord]] = deque()
        self._waiting: list[Flight] = []  # for a first worker
        self._grace_end_ns = clock.now_ns() + self.settings.startup_grace_ns
        self._ready: deque[Callable[[], None]] = deque()
        self.transitions: list[tuple[str, str]] | None = None
        """Set to a list to have every stage change appended to it as ``(from, to)`` (tests, tracing)."""
        self._running = False
        self.stopped: str | None = None
        """Why this lifecycle stopped taking requests (``stop``), or None."""

    # ------------------------------------------------------------------ inputs

    def submit(self, req: ClientRequest, on_end: Callable[[RequestRecord], None],
               can_retry: Callable[[], bool] | None = None,
               on_finished: Callable[[Finished], None] | None = None) -> RequestRecord:
        """Start a request; ``on_end`` gets its record when it ends (maybe before this returns).

        ``can_retry`` says whether a running attempt lost before its first token may run elsewhere (a
        disaggregated decode leg whose KV source was already freed may not): otherwise it fails.
        ``on_finished`` is told the worker's ``Finished`` just before a completed request ends."""
        now = self.clock.now_ns()
        rid = req.request_id
        record = router_record(rid, session_id=req.session_id, parent_session_id=req.parent_session_id,
                               arrival_ns=now, isl=len(_prompt(req)), max_tokens=req.max_tokens)
        hooks = self.hooks
        if rid in self.flights or self.stopped:
            duplicate = rid in self.flights
            record.failure = "duplicate_request_id" if duplicate else self.stopped
            # a refused duplicate's hook says so: its id is the open request's, whose record it must not touch
            hooks.note(HookKind.FAILED, now, rid, details=DUPLICATE if duplicate else None, record=record)
            on_end(record)
            return record
        hooks.note(HookKind.REQUEST_ARRIVED, now, rid, record=record)
        try:
            reason = _validate(req)
            if reason is not None:
                raise InvalidArgument(reason)
            prepared = self.core.prepare(_prompt(req), request_id=rid, session_id=req.session_id,
                                         lora_name=req.lora_name, overrides=req.router_overrides)
        except KvemuError as exc:
            record.failure = f"invalid_request: {exc}"
            hooks.note(HookKind.FAILED, now, rid, record=record)
            on_end(record)
            return record
        flight = self.flights[rid] = Flight(req, record, prepared, on_end, can_retry, on_finished)
        limit = self.settings.request_deadline_ns
        if limit is not None:
            self._expire_at(now + limit, rid, record)
        if not len(self.core.registry) and now < self._grace_end_ns:
            self._waiting.append(flight)
            if len(self._waiting) == 1:
                self._announce(self._grace_end_ns)
        else:
            self._run(self._attempt, flight)
        return record

    def on_ack(self, worker_id: int, msg: DispatchAck) -> None:
        """The worker accepted or refused a dispatch (ignored unless it is the one dispatched to)."""
        f = self._dispatched_to(worker_id, msg.request_id)
        if f is not None and f.stage == DISPATCHED:
            self.unacked.pop(worker_id, None)
            self.proven.add(worker_id)
            if msg.accepted:
                self._run(self._accepted, f)
            else:
                f.failure = msg.reason or "rejected"
                self._run(self._refused, f)

    def on_tokens(self, worker_id: int, msg: TokenBatch) -> None:
        """Output tokens streamed back."""
        f = self._dispatched_to(worker_id, msg.request_id)
        if f is not None and msg.times_ns:
            self._run(self._tokens, f, msg.times_ns)

    def on_finished(self, worker_id: int, msg: Finished) -> None:
        """The engine completed the request."""
        f = self._dispatched_to(worker_id, msg.request_id)
        if f is not None:
            self._run(self._finished, f, msg)

    def on_failed(self, worker_id: int, msg: RequestFailed) -> None:
        """The worker gave up on the request (before or after accepting it)."""
        f = self._dispatched_to(worker_id, msg.request_id)
        if f is None:
            return
        f.failure = msg.reason
        self._run(self._refused if f.stage == DISPATCHED else self._done, f)

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """End an open request now (its client went away): whatever it holds is freed (load, queue place,
        affinity hold or lease), the worker it was dispatched to is sent ``Abort``, and it fails with
        ``reason``. Returns whether the request was open."""
        f = self.flights.get(request_id)
        if f is None or f.stage == ENDED:
            return False
        self._run(self._cancel, f, reason)
        return True

    def _cancel(self, f: Flight, reason: str) -> None:
        if f.stage == ENDED:
            return
        f.failure = reason
        if f.stage in (DISPATCHED, RUNNING):
            wid = f.key[0]  # type: ignore[index]
            if f.hold is not None and self.affinity is not None:
                self.affinity.drop(f.hold)
                f.hold = None
            if f.lease is not None and self.affinity is not None:
                self.affinity.release(f.lease)
                f.lease = None
            self._unbook(f)
            try:
                self._send(wid, Abort(request_id=f.request_id, reason=reason))
            except Exception as exc:  # noqa: BLE001 - a local failure; the request ends here all the same
                log.warning("request %r: its abort to worker %s was not sent: %s", f.request_id, wid, exc)
        elif f.stage == WAITING:
            self._waiting.remove(f)
        self._end(f, reason)  # a queued request leaves the queue; an affinity wait's wake-up is void

    def worker_added(self) -> None:
        """A worker registered: requests waiting for a first worker go on; the queue may move."""
        self._run(self._readmit_stranded)
        self._run(self._capacity_changed)
        if self._waiting:
            self._run(self._release_waiting)

    def worker_lost(self, worker_id: int) -> None:
        """A worker is gone: its dispatched requests re-select; running ones that streamed nothing too."""
        ids = self._by_worker.pop(worker_id, None)
        on_probation = self.settings.probation_ack_timeout_ns is not None and worker_id not in self.proven
        self.proven.discard(worker_id)
        self.productive.discard(worker_id)  # (so a worker registered again is removed at its first stall)
        self.stalls.pop(worker_id, None)
        if ids:
            for rid in ids:
                f = self.flights.get(rid)
                if f is not None and f.stage in (DISPATCHED, RUNNING) and f.failure != FIRST_TOKEN_TIMEOUT:
                    if on_probation and f.stage == DISPATCHED and f.failure is None:  # (a timeout spared it)
                        f.spared += 1  # no retry is spent on a worker on probation
                    f.failure = "worker_lost"
                    self._ready.append(self._wake(self._refused if f.stage == DISPATCHED else self._done, f))
        self._run(self._readmit_stranded)
        self._run(self._capacity_changed)

    def capacity_changed(self) -> None:
        """Something outside the lifecycle changed the candidates (a rank went down): the queue may move."""
        self._run(self._readmit_stranded)
        self._run(self._capacity_changed)

    def poll(self, now_ns: int) -> None:
        """Handle every deadline due by ``now_ns`` (dispatch timeouts, request deadlines, the end of the
        startup grace)."""
        timeouts = self._timeouts
        unresponsive: dict[int, int] = {}
        probation = self.settings.probation_ack_timeout_ns is not None
        while timeouts and timeouts[0][0] <= now_ns:
            _, f, token = timeouts.popleft()
            if f.token == token and f.stage == DISPATCHED:
                f.failure = "dispatch_timeout"
                self._ready.append(self._wake(self._refused, f))
                wid = f.key[0]  # type: ignore[index]
                n = self.unacked[wid] = self.unacked.get(wid, 0) + 1
                if probation and wid not in self.proven:  # on probation: out at once, and no retry spent on it
                    f.spared += 1
                    unresponsive[wid] = n
                elif n >= self.settings.max_unacked:
                    unresponsive[wid] = n
        stalled = self._stalled(now_ns)
        expiries = self._expiries
        while expiries and expiries[0][0] <= now_ns:
            _, rid, record = expiries.popleft()
            self._ready.append(functools.partial(self._expire, rid, record))
        if self._waiting and now_ns >= self._grace_end_ns:
            self._ready.append(self._release_waiting)
        if unresponsive and self.on_unresponsive is not None:
            for wid, n in unresponsive.items():
                self.on_unresponsive(wid, n)  # the host removes it: worker_lost re-selects its other requests
        if stalled and self.on_stalled is not None:
            for wid, n in stalled.items():
                self.on_stalled(wid, n)
        self._run(_nothing)

    def _stalled(self, now_ns: int) -> dict[int, int]:
        """End the attempts of accepted requests whose first token is overdue (the worker is told to abort
        each; it runs elsewhere if it may); returns the workers to stop routing to, with their count in a row."""
        due = self._first_tokens
        stalled: dict[int, int] = {}
        while due and due[0][0] <= now_ns:
            _, f, token = due.popleft()
            if f.token != token or f.stage != RUNNING or f.record.first_token_ns is not None:
                continue
            wid = f.key[0]  # type: ignore[index]
            f.failure = FIRST_TOKEN_TIMEOUT
            try:
                self._send(wid, Abort(request_id=f.request_id, reason=FIRST_TOKEN_TIMEOUT))
            except Exception as exc:  # noqa: BLE001 - a local failure; the attempt ends here all the same
                log.warning("request %r: its abort to worker %s was not sent: %s", f.request_id, wid, exc)
            self._ready.append(self._wake(self._done, f))
            n = self.stalls[wid] = self.stalls.get(wid, 0) + 1
            if wid not in self.productive or n >= self.settings.max_unacked:
                stalled[wid] = n
        return stalled

    def next_deadline_ns(self) -> int | None:
        """When ``poll`` next has something to do (None: no deadline pending)."""
        timeouts = self._timeouts
        while timeouts and (timeouts[0][1].token != timeouts[0][2] or timeouts[0][1].stage != DISPATCHED):
            timeouts.popleft()  # acknowledged meanwhile
        t = timeouts[0][0] if timeouts else None
        due = self._first_tokens
        while due and (due[0][1].token != due[0][2] or due[0][1].stage != RUNNING
                       or due[0][1].record.first_token_ns is not None):
            due.popleft()  # its first token came (or the attempt ended) meanwhile
        if due and (t is None or due[0][0] < t):
            t = due[0][0]
        expiries = self._expiries
        while expiries and self._open(expiries[0][1], expiries[0][2]) is None:
            expiries.popleft()
        if expiries and (t is None or expiries[0][0] < t):
            t = expiries[0][0]
        if self._waiting and (t is None or self._grace_end_ns < t):
            t = self._grace_end_ns
        return t

    def stop(self, reason: str) -> None:
        """Take no more requests; every request still open ends with ``reason``."""
        self.stopped = reason
        for f in list(self.flights.values()):
            if f.stage == ENDED:
                continue
            f.failure = reason
            if f.stage == DISPATCHED:
                self._ready.append(self._wake(self._refused, f))
            elif f.stage == RUNNING:
                self._ready.append(self._wake(self._done, f))
            else:
                if f.stage == QUEUED and self.queue is not None:
                    self.queue.remove(f.request_id)
                f.token += 1
                self._ready.append(self._wake(self._abandon, f))
        self._waiting.clear()
        self._run(_nothing)

    # ------------------------------------------------------------------ running transitions

    def _run(self, step: Callable[..., None], *args: Any) -> None:
        """Run one transition, then every transition it woke, in order (re-entrant calls only queue)."""
        if self._running:
            self._ready.append(lambda: step(*args))
            return
        self._running = True
        try:
            step(*args)
            ready = self._ready
            while ready:
                ready.popleft()()
        finally:
            self._running = False

    def _wake(self, step: Callable[[Flight], None], f: Flight) -> Callable[[], None]:
        """``step(f)`` later, unless ``f`` moved on meanwhile."""
        token = f.token

        def resume() -> None:
            if f.token == token and f.stage != ENDED:
                step(f)
        return resume

    def _expire_at(self, deadline: int, rid: str, record: RequestRecord) -> None:
        expiries = self._expiries
        if expiries and deadline < expiries[-1][0]:  # a clock that went back: keep the deque in order
            expiries = self._expiries = deque(sorted(expiries, key=lambda e: e[0]))
        expiries.append((deadline, rid, record))
        if expiries[0][2] is record:
            self._announce(deadline)

    def _announce(self, deadline: int) -> None:
        """Tell the host about a deadline now first of its kind; a later one than the host's armed instant is
        harmless, and after every ``poll`` the host re-arms at ``next_deadline_ns``."""
        if self.on_deadline is not None:
            self.on_deadline(deadline)

    def _open(self, rid: str, record: RequestRecord) -> Flight | None:
        f = self.flights.get(rid)
        return f if f is not None and f.record is record else None

    def _expire(self, rid: str, record: RequestRecord) -> None:
        """The request outlived its deadline: free whatever it holds and fail it (a worker's late replies are
        then ignored, as for any ended request)."""
        f = self._open(rid, record)
        if f is None:
            return
        f.failure = "deadline_exceeded"
        if f.stage == RUNNING:
            self._done(f)
            return
        if f.stage == DISPATCHED:
            if f.hold is not None and self.affinity is not None:
                self.affinity.drop(f.hold)
                f.hold = None
            self._unbook(f)
        elif f.stage == WAITING:
            self._waiting.remove(f)
        self._end(f, f.failure)  # a queued request leaves the queue; an affinity wait's wake-up is void

    def dispatched_to(self, worker_id: int, request_id: str) -> Flight | None:
        """The open request ``request_id`` if it is dispatched to ``worker_id`` (else None: late, stale, spoofed)."""
        return self._dispatched_to(worker_id, request_id)

    def _dispatched_to(self, worker_id: int, request_id: str) -> Flight | None:
        f = self.flights.get(request_id)
        if f is None or f.key is None or f.key[0] != worker_id or f.stage not in (DISPATCHED, RUNNING):
            return None  # not this peer's request (late, stale or spoofed)
        return f

    def _enter(self, f: Flight, stage: str) -> None:
        """Move ``f`` to ``stage``, a move ``TRANSITIONS`` allows (any other is a bug in this machine)."""
        if stage not in TRANSITIONS[f.stage]:
            raise AssertionError(f"request {f.request_id!r}: no lifecycle transition {f.stage} -> {stage}")
        if self.transitions is not None:
            self.transitions.append((f.stage, stage))
        f.stage = stage

    def _release_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for f in waiting:
            if f.stage == WAITING:
                self._attempt(f)

    def _attempt(self, f: Flight) -> None:
        """Start attempt ``f.attempt`` (or fail the request once the retries are used up)."""
        if self.stopped:
            self._end(f, f.failure or self.stopped)
            return
        if f.attempt - f.spared > self.settings.retry_limit:  # the last refusal says why (e.g. a prompt no rank can hold)
            self._end(f, f"retries_exhausted: {f.failure}" if f.failure else "retries_exhausted")
            return
        f.token += 1
        f.failure = None
        f.key = f.hold = f.lease = None
        record = f.record
        # a new attempt starts over on another rank (retries happen only before any token came back)
        record.first_token_ns = record.completion_ns = None
        record.engine = EngineFacts()
        record.output_tokens = 0
        req = f.req
        builder = f.builder = self.core.eligibility()
        for w, r in f.refused:
            builder.set_available(w, False, dp_rank=r)
        for w, r in self.unavailable:
            builder.set_available(w, False, dp_rank=r)
        if req.allowed_worker_ids is not None:
            builder.allow(req.allowed_worker_ids)
        if req.worker_id is not None or req.dp_rank is not None:
            builder.pin(req.worker_id, req.dp_rank)
        if self.affinity is not None and _affinity_key(req) is not None:
            self._admit(f)
            return
        if self.queue is not None:
            try:
                candidates = builder.build()
                if self._enqueue(f, candidates):
                    return
            except (SchedulerError, QueueRejected, DoNotQueue) as exc:
                self._end(f, _reason(exc))
                return
        self._select(f)

    def _admit(self, f: Flight) -> None:
        """Acquire the session's affinity first, then queue or select within what it allows.

        Dynamo's order: the hold is kept while the request waits in the queue, so a session's other
        requests wait for its initializer (not in the queue) and a bound request queues in its rank's lane,
        its cost measured by the cache on that rank, holding its lease."""
        affinity = self.affinity
        assert affinity is not None
        try:
            got = self.core.acquire_affinity(f.builder, affinity, _affinity_key(f.req))  # type: ignore[arg-type]
        except (SchedulerError, ResourceExhausted, InvalidArgument) as exc:
            self._end(f, _reason(exc))
            return
        if isinstance(got, Wait):
            self._enter(f, AFFINITY)
            affinity.on_settled(got, lambda: self._ready.append(self._wake(self._settled, f)))
            return
        f.hold, candidates = got
        if self.queue is not None:
            try:
                if self._enqueue(f, candidates):
                    return
            except (QueueRejected, DoNotQueue) as exc:
                self._end(f, _reason(exc))  # drops the hold: the session's waiters go on
                return
        self._select(f, candidates)

    def _enqueue(self, f: Flight, candidates: Candidates) -> bool:
        """Queue ``f`` if every rank it may run on is busy (or work it must not overtake waits); the queue's
        refusals raise. Its cost is its prompt less the best cache among those ranks."""
        queue = self.queue
        assert queue is not None
        core = self.core
        ranks = core.selectable(candidates)
        pin = ranks[0] if len(ranks) == 1 and (candidates.pinned is not None or candidates.affinity_ranks) else None
        if not queue.should_queue(ranks, pin=pin):
            return False
        if self.before_select is not None:
            self.before_select()  # the cache as the engines hold it now
        overlaps = core.overlaps(f.prepared)
        isl = f.prepared.isl
        cached = min(isl, max((overlaps.get(k, 0) for k in ranks), default=0) * core.block_size)
        now = self.clock.now_ns()
        req = f.req
        queue.push(QueueEntry(f.request_id, ranks=ranks, arrival_ns=now, isl=isl, cached_tokens=cached,
                              tier=req.priority, pin=pin, payload=f),
                   num_workers=len(core.registry), do_not_queue=req.do_not_queue, now_ns=now)
        self._enter(f, QUEUED)
        f.record.queued_ns = now
        self.hooks.note(HookKind.QUEUED, now, f.request_id, details=QueueDepth(len(queue)), record=f.record)
        self._release_queue()
        return True

    def _readmit_stranded(self) -> None:
        """Queued requests whose every rank is gone (its worker removed or fenced, the rank down: a session
        bound there, a pin) start their admission over, once some worker is registered: a session re-binds
        elsewhere, a pin fails. With no worker at all they wait, as in Dynamo."""
        queue = self.queue
        registry = self.core.registry
        if queue is None or not len(queue) or not len(registry):
            return
        unavailable = self.unavailable

        def gone(key: tuple[int, int]) -> bool:
            return key[0] not in registry or registry.is_fenced(key[0]) or key in unavailable

        for f in list(self.flights.values()):
            entry = queue.get(f.request_id) if f.stage == QUEUED else None
            if entry is None or not all(map(gone, entry.ranks)):
                continue
            queue.remove(f.request_id)
            hold, f.hold = f.hold, None
            if hold is not None and self.affinity is not None:
                self.affinity.drop(hold)
                if hold.kind == "bound":
                    self.affinity.invalidate(hold.session, hold.revision, hold.version)
            self._ready.append(self._wake(self._attempt, f))

    def _select(self, f: Flight, candidates: Candidates | None = None) -> None:
        """Select a rank among ``candidates`` (default: the request's eligibility), book it and dispatch."""
        if self.before_select is not None:
            self.before_select()
        core = self.core
        try:
            selection = core.select(f.prepared, f.builder.build() if candidates is None else candidates)
        except (SchedulerError, QueueRejected, DoNotQueue) as exc:
            self._end(f, _reason(exc))  # drops the hold
            return
        wid, rank = selection.worker_id, selection.dp_rank
        now = self.clock.now_ns()
        ev = selection.evaluation
        overlaps = ev.inputs["overlaps"] if ev.inputs is not None else core.overlaps(f.prepared)
        record = f.record
        record.worker_id, record.dp_rank, record.routed_ns, record.attempts = wid, rank, now, f.attempt + 1
        record.routing_reason, record.predicted_overlap_blocks = selection.reason, selection.overlap_blocks
        record.best_overlap_blocks = max(overlaps.values(), default=0)
        if self.truth is not None:
            record.truth_overlap_blocks, record.truth_best_overlap_blocks, record.regret_source = self.truth(
                f.prepared.seq_hashes, ev.ranks, (wid, rank), f.req.session_id)
        hooks = self.hooks
        if hooks.wants(HookKind.ROUTED):
            hooks.note(HookKind.ROUTED, now, f.request_id, wid, rank, Routed(
                f.attempt, selection.reason, selection.cost, selection.overlap_blocks, record.best_overlap_blocks,
                [(k[0], k[1], c, overlaps.get(k, 0)) for k, c in zip(ev.ranks, ev.costs)]), record=record)
        else:
            hooks.tally(HookKind.ROUTED)
        f.key = (wid, rank)
        self._enter(f, DISPATCHED)
        self._by_worker.setdefault(wid, {})[f.request_id] = None
        # book now, so that requests routed while this one awaits its acknowledgement see its load;
        # a refusal frees it again (the affinity binding, by contrast, waits for the acceptance)
        core.book(f.request_id, selection, f.prepared)
        probation = self.settings.probation_ack_timeout_ns
        deadline = now + (probation if probation is not None and wid not in self.proven
                          else self.settings.dispatch_timeout_ns)
        timeouts = self._timeouts
        if timeouts and deadline < timeouts[-1][0]:  # a clock that went back, or a worker on probation
            bisect.insort(timeouts, (deadline, f, f.token), key=lambda t: t[0])
        else:
            timeouts.append((deadline, f, f.token))
        if timeouts[0][1] is f:
            self._announce(deadline)
        req = f.req
        try:
            self._send(wid, Dispatch(request_id=f.request_id, dp_rank=rank, tokens=_prompt(req),
                                     max_tokens=req.max_tokens, output_token_ids=req.output_token_ids,
                                     engine_priority=req.engine_priority, kv_hold=req.kv_hold, kv_transfer=req.kv_transfer))
        except Exception as exc:  # noqa: BLE001 - a local failure (the message does not encode): never the worker's
            self._send_failed(f, exc)

    def _send_failed(self, f: Flight, exc: Exception) -> None:
        """The ``Dispatch`` of ``f`` could not leave this process: the request fails with the reason and frees
        what it booked. The worker never saw it, so it is not charged an unacknowledged dispatch (no timeout
        stays behind) and no other rank is tried (the same message would fail there too)."""
        kind = "encode_failed" if isinstance(exc, (OverflowError, TypeError, ValueError, msgspec.EncodeError)) \
            else "send_failed"
        reason = f"{kind}: {type(exc).__name__}: {exc}"
        wid = f.key[0]  # type: ignore[index]
        log.warning("request %r: its dispatch to worker %s was not sent: %s", f.request_id, wid, reason)
        if f.hold is not None and self.affinity is not None:
            self.affinity.drop(f.hold)
            f.hold = None
        self._unbook(f)  # voids its dispatch timeout
        self._end(f, reason)

    def _settled(self, f: Flight) -> None:
        if self.stopped:
            self._end(f, self.stopped)
        elif f.stage == AFFINITY:
            self._admit(f)

    def _release_queue(self) -> None:
        """Release the next dispatchable queued request; once it is routed (and booked), look again.

        One at a time, as Dynamo's queue admits: the next head is judged with the load the previous one
        booked, so a freed rank takes one request, not every request that saw it idle."""
        queue = self.queue
        assert queue is not None
        entry = queue.pop_ready()
        if entry is not None:
            dequeued = self._wake(self._dequeued, entry.payload)  # type: ignore[arg-type]

            def release_one() -> None:
                dequeued()
                self._release_queue()
            self._ready.append(release_one)

    def _dequeued(self, f: Flight) -> None:
        if f.stage != QUEUED:
            return
        hold, affinity = f.hold, self.affinity
        if hold is None or hold.kind != "bound" or affinity is None:
            self._select(f)
            return
        try:
            candidates = f.builder.affinity(hold.target).build()
        except SchedulerError as exc:
            self._end(f, _reason(exc))
            return
        if not candidates.affinity_ranks and affinity.mode is AffinityMode.HARD:
            # the binding's rank went away while the request waited: it re-binds
            f.hold = None
            affinity.drop(hold)
            affinity.invalidate(hold.session, hold.revision, hold.version)
            f.builder.affinity(None)
            self._admit(f)
            return
        self._select(f, candidates)

    def _capacity_changed(self) -> None:
        if self.queue is not None:
            self._release_queue()

    def _accepted(self, f: Flight) -> None:
        self._enter(f, RUNNING)
        f.token += 1
        hold = f.hold
        if hold is not None:
            f.hold = None
            try:
                f.lease = self.affinity.commit(hold, f.key)  # type: ignore[union-attr,arg-type]
            except InvalidArgument as exc:  # hard binding moved meanwhile: keep serving, unbound
                log.info("affinity commit for %s: %s", f.request_id, exc)
        now = self.clock.now_ns()
        f.record.dispatch_ns = now
        limit = self.settings.first_token_timeout_ns
        if limit is not None:
            due = self._first_tokens
            if due and now + limit < due[-1][0]:  # a clock that went back: keep the deque in order
                bisect.insort(due, (now + limit, f, f.token), key=lambda t: t[0])
            else:
                due.append((now + limit, f, f.token))
            if due[0][1] is f:
                self._announce(now + limit)
        self.hooks.note(HookKind.DISPATCH_ACCEPTED, now, f.request_id, *f.key, record=f.record)  # type: ignore[misc]

    def _refused(self, f: Flight) -> None:
        """The dispatch did not get the request admitted: free what it booked and try another rank."""
        reason = f.failure or "rejected"
        wid, rank = f.key  # type: ignore[misc]
        self._unbook(f)
        f.refused.append((wid, rank))
        hold, affinity = f.hold, self.affinity
        if hold is not None and affinity is not None:
            f.hold = None
            affinity.drop(hold)
            if hold.kind == "bound":  # the bound rank refused: let the session re-bind
                affinity.invalidate(hold.session, hold.revision, hold.version)
        self.hooks.note(HookKind.DISPATCH_REJECTED, self.clock.now_ns(), f.request_id, wid, rank, details=Reason(reason),
                        record=f.record)
        f.refusal = f"{wid}/{rank}: {reason}"
        self._retry(f)

    def _retry(self, f: Flight) -> None:
        if self.stopped:
            self._end(f, f.failure or self.stopped)
            return
        f.key = None
        f.attempt += 1
        self._attempt(f)

    def _tokens(self, f: Flight, times: list[int]) -> None:
        if f.stage == DISPATCHED:  # tokens before the acknowledgement: it was accepted
            self._accepted(f)
        record = f.record
        record.add_token_times(times)
        core = self.core
        if record.first_token_ns is None:
            record.first_token_ns = times[0]
            wid = f.key[0]  # type: ignore[index]
            self.productive.add(wid)
            self.stalls.pop(wid, None)
            core.prefill_complete(f.request_id)
            self.hooks.note(HookKind.FIRST_TOKEN, self.clock.now_ns(), f.request_id, *f.key,  # type: ignore[misc]
                            record=record)
            self._capacity_changed()
        before = record.output_tokens
        record.output_tokens = after = before + len(times)
        core.note_output(f.request_id, record.isl, before, after, f.req.expected_output_tokens)
        if self.hooks.wants(HookKind.TOKENS):
            self.hooks.note(HookKind.TOKENS, self.clock.now_ns(), f.request_id, *f.key,  # type: ignore[misc]
                            details=TokenTimes(times), record=record)
        else:
            self.hooks.tally(HookKind.TOKENS)

    def _finished(self, f: Flight, msg: Finished) -> None:
        if msg.times_ns:
            self._tokens(f, msg.times_ns)
        elif f.stage == DISPATCHED:
            self._accepted(f)
        record = f.record
        record.engine = msg.engine
        if f.on_finished is not None:
            f.on_finished(msg)
        last = record.last_token_ns()
        record.completion_ns = last if last is not None else self.clock.now_ns()
        self._done(f)

    def _done(self, f: Flight) -> None:
        """The running attempt ended: free its load and lease; retry a lost one that streamed nothing."""
        if f.lease is not None and self.affinity is not None:
            self.affinity.release(f.lease)
            f.lease = None
        self._unbook(f)
        if f.failure in ("worker_lost", FIRST_TOKEN_TIMEOUT) and f.record.first_token_ns is None \
                and (f.can_retry is None or f.can_retry()):
            f.refused.append(f.key)  # type: ignore[arg-type]
            self._retry(f)  # nothing was streamed yet: run it elsewhere
            return
        self._end(f, f.failure)

    def _unbook(self, f: Flight) -> None:
        """The attempt on ``f.key`` is over: void its timers and wake-ups, free its load, and let the queue move."""
        f.token += 1
        self.core.free(f.request_id)
        ids = self._by_worker.get(f.key[0])  # type: ignore[index]
        if ids is not None:
            ids.pop(f.request_id, None)
        self._capacity_changed()

    def _abandon(self, f: Flight) -> None:
        """End a request that holds nothing on a worker, with the failure already recorded on it."""
        self._end(f, f.failure)

    def _end(self, f: Flight, failure: str | None) -> None:
        if f.stage == ENDED:
            return
        if f.stage == QUEUED and self.queue is not None:
            self.queue.remove(f.request_id)
        if f.hold is not None and self.affinity is not None:  # an uncommitted hold: its waiters go on
            self.affinity.drop(f.hold)
            f.hold = None
        self._enter(f, ENDED)
        f.token += 1
        if failure is not None and f.refusal is not None and failure.startswith("no_endpoints"):
            failure = f"{failure} (the last refusal, by {f.refusal})"  # what the workers said, not only the ranks
        record = f.record
        record.failure = failure
        now = self.clock.now_ns()
        key: tuple[int | None, int | None] = f.key or (None, None)
        if failure is None:
            self.hooks.note(HookKind.COMPLETED, now, f.request_id, *key, record=record)
        else:
            record.completion_ns = None
            self.hooks.note(HookKind.FAILED, now, f.request_id, *key, record=record)
        del self.flights[f.request_id]
        f.on_end(record)


def _nothing() -> None:
    pass


def _ns(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * NS_PER_S)


def _affinity_key(req: ClientRequest) -> str | None:
    if req.parent_session_id is not None:
        return sibling_group_key(req.parent_session_id)
    return req.session_id


def _reason(exc: Exception) -> str:
    name = type(exc).__name__
    snake = "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
    return f"{snake}: {exc}"


def _prompt(req: ClientRequest) -> Any:
    """``req.tokens`` as it is in process: any ``Sequence[int]`` (a lazy trace prompt), not only the wire's
    ``list | bytes`` that the compiled build would check it against."""
    return cast(Any, req).tokens


def _validate(req: ClientRequest) -> str | None:
    if req.request_id.startswith("\x00"):  # (the load view keys peer replicas' bookings so)
        return "request_id must not start with a NUL character"
    if not _prompt(req):
        return "tokens: the prompt is empty"
    if req.max_tokens < 1:
        return f"max_tokens must be >= 1, got {req.max_tokens}"
    if req.dp_rank is not None and req.worker_id is None:
        return f"dp_rank {req.dp_rank} was pinned without a worker_id"
    for name in ("session_id", "parent_session_id"):
        value = getattr(req, name)
        if value is not None and len(value.encode()) > 256:
            return f"{name} is longer than 256 bytes"
    return None
