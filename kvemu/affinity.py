"""Session affinity: keep a session's requests on one ``(worker, dp_rank)`` while it is active or recent.

Entry states: absent → initializing (one request chooses; others get ``Wait``) → bound (target, active
leases, idle deadline). A binding is committed only after the worker accepted the dispatch; the idle
timer restarts at every lease release, and a binding with active leases never expires. Time comes from
the injected clock, and expiry is evaluated lazily on either clock: an idle binding goes when its session
next acquires or when the table is full. Nothing reaps in the background; a host on a ``WallClock`` that
wants idle bindings gone on time calls ``expire()`` every ``reaper_interval_ns``.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable
from typing import NamedTuple

import blake3

from kvemu.clock import MAX_TIME_NS, NS_PER_S, Clock, ManualClock, check_deadline, seconds_to_ns
from kvemu.eligibility import AffinityTarget
from kvemu.errors import InvalidArgument, PinnedWorkerNotAllowed, ResourceExhausted

__all__ = [
    "AffinityMode",
    "AffinityEvent",
    "AffinityStats",
    "Hold",
    "Wait",
    "Lease",
    "SessionAffinity",
    "sibling_group_key",
    "MIN_TTL_NS",
    "MAX_TTL_NS",
]

MIN_TTL_NS = 1 * NS_PER_S
"""Shortest idle TTL a binding may have (one second); a shorter ``ttl`` is ``InvalidArgument``."""
MAX_TTL_NS = 31_536_000 * NS_PER_S
"""Longest idle TTL a binding may have (one year); a longer ``ttl`` is ``InvalidArgument``."""
SIBLING_PREFIX = "\x01sg:"


def sibling_group_key(parent_session_id: str) -> str:
    """Affinity key shared by all children of one parent session (the parent keeps its own key)."""
    return SIBLING_PREFIX + blake3.blake3(parent_session_id.encode()).hexdigest()


class AffinityMode(enum.Enum):
    """``hard``: a dispatch elsewhere invalidates the binding and errors; ``soft``: the binding follows."""

    HARD = "hard"
    SOFT = "soft"


class AffinityEvent(NamedTuple):
    """What an observer is told: ``bound``, ``rebound``, ``released``, ``expired`` or ``invalidated``."""

    kind: str
    session: str
    target: AffinityTarget | None
    pool: str
    now_ns: int


class AffinityStats:
    """Counters for reports."""

    __slots__ = ("binds", "hits", "waits", "rebinds", "releases", "expirations", "invalidations", "mismatches")

    def __init__(self) -> None:
        self.binds = self.hits = self.waits = self.rebinds = 0
        self.releases = self.expirations = self.invalidations = self.mismatches = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by name."""
        return {name: getattr(self, name) for name in self.__slots__}


class Wait(NamedTuple):
    """Another request is choosing this session's worker; retry after it commits or drops."""

    session: str
    revision: int


class Hold:
    """The result of a successful ``try_acquire``: commit it after dispatch, or drop it."""

    __slots__ = ("session", "revision", "version", "kind", "target", "requested", "open")

    def __init__(self, session: str, revision: int, kind: str, target: AffinityTarget | None,
                 requested: AffinityTarget | None, version: int = 0) -> None:
        self.session = session
        self.revision = revision
        self.version = version
        """The binding's version when acquired (bumped whenever a soft binding moves)."""
        self.kind = kind
        """``initialize`` (this request picks the worker) or ``bound`` (route to ``target``)."""
        self.target = target
        """The bound target for a ``bound`` hold; ``None`` for an ``initialize`` hold."""
        self.requested = requested
        self.open = True

    def __repr__(self) -> str:
        return f"Hold({self.session!r}, {self.kind}, target={self.target}, revision={self.revision})"


class Lease:
    """One active use of a binding; release it when the response stream ends (any way it ends)."""

    __slots__ = ("session", "revision", "target", "released")

    def __init__(self, session: str, revision: int, target: AffinityTarget | None) -> None:
        self.session = session
        self.revision = revision
        self.target = target
        self.released = target is None

    @property
    def bound(self) -> bool:
        """False for a detached lease (the binding vanished before the commit)."""
        return self.target is not None

    def __repr__(self) -> str:
        return f"Lease({self.session!r}, target={self.target}, released={self.released})"


_INIT = 0
_BOUND = 1


class _Entry:
    __slots__ = ("state", "revision", "version", "target", "leases", "deadline", "waiters")

    def __init__(self, revision: int) -> None:
        self.state = _INIT
        self.revision = revision
        self.version = 0
        self.target: AffinityTarget | None = None
        self.leases = 0
        self.deadline = 0
        self.waiters: list[Callable[[], None]] = []


class SessionAffinity:
    """The affinity table of one worker pool (aggregated, prefill or decode); synchronous, clock-driven."""

    def __init__(
        self,
        clock: Clock,
        *,
        ttl_secs: float = 300.0,
        mode: AffinityMode | str = AffinityMode.HARD,
        max_entries: int = 65_536,
        max_session_id_bytes: int = 256,
        pool: str = "aggregated",
        is_member: Callable[[int], bool] | None = None,
        observer: Callable[[AffinityEvent], None] | None = None,
        reaper: bool = True,
    ) -> None:
        """``reaper`` (default True): a shell on wall time calls ``expire()`` every ``reaper_interval_ns``; a
        table on a clock its host advances (``with_manual_clock``) has none: expiry is evaluated when it is read."""
        ttl_ns = seconds_to_ns(ttl_secs)
        if not MIN_TTL_NS <= ttl_ns <= MAX_TTL_NS:
            raise InvalidArgument(f"ttl_secs must be between 1 and 31536000 s, got {ttl_secs!r}", field="ttl_secs")
        check_deadline(clock.now_ns(), ttl_ns, "SessionAffinity ttl at construction")
        if max_entries < 1:
            raise InvalidArgument(f"max_entries must be >= 1, got {max_entries!r}", field="max_entries")
        if max_session_id_bytes < 1:
            raise InvalidArgument(f"max_session_id_bytes must be >= 1, got {max_session_id_bytes!r}",
                                  field="max_session_id_bytes")
        self.clock = clock
        self.ttl_ns = ttl_ns
        self.mode = AffinityMode(mode)
        self.max_entries = max_entries
        self.max_session_id_bytes = max_session_id_bytes
        self.pool = pool
        self.is_member = is_member
        self.observer = observer
        self.reaper = reaper
        self.stats = AffinityStats()
        self._table: dict[str, _Entry] = {}
        self._by_worker: dict[int, dict[str, None]] = {}
        self._idle: list[tuple[int, int, str]] = []  # (deadline, n, session), lazily cleaned
        self._n = 0
        self._revision = 0

    @classmethod
    def with_manual_clock(cls, clock: ManualClock, **kw: object) -> SessionAffinity:
        """A table whose time only moves when the host advances ``clock`` (no reaper)."""
        if not isinstance(clock, ManualClock):
            raise InvalidArgument(f"with_manual_clock needs a ManualClock, got {clock!r}")
        kw.setdefault("reaper", False)
        return cls(clock, **kw)  # type: ignore[arg-type]

    @property
    def reaper_interval_ns(self) -> int | None:
        """How often a wall-clock shell should call ``expire()``; ``None`` for a table without a reaper."""
        return min(self.ttl_ns, 30 * NS_PER_S) if self.reaper else None

    def __len__(self) -> int:
        return len(self._table)

    # ------------------------------------------------------------------ acquire / commit

    def try_acquire(self, session: str, requested_target: AffinityTarget | tuple[int, int | None] | None = None) -> Hold | Wait:
        """Start routing a request of ``session``; ``requested_target`` is its explicit pin, if any."""
        self._check_session(session)
        requested = None if requested_target is None else AffinityTarget(*requested_target)
        now = self.clock.now_ns()
        e = self._table.get(session)
        if e is not None and e.state == _BOUND and not e.leases and e.deadline <= now:
            self._remove(session, e, "expired", now)
            self.stats.expirations += 1
            e = None
        if e is None:
            if len(self._table) >= self.max_entries:
                self.expire(now)
                if len(self._table) >= self.max_entries:
                    raise ResourceExhausted(
                        f"session affinity table of the {self.pool} pool is full ({self.max_entries} entries)",
                        resource="session_affinity", limit=self.max_entries, session_id=session,
                    )
            self._revision += 1
            self._table[session] = _Entry(self._revision)
            return Hold(session, self._revision, "initialize", None, requested)
        if e.state == _INIT:
            self.stats.waits += 1
            return Wait(session, e.revision)
        bound = e.target
        assert bound is not None
        if requested is not None and (requested.worker_id != bound.worker_id
                                      or requested.dp_rank not in (None, bound.dp_rank)):
            # a worker-only binding cannot be narrowed to a rank (Dynamo: "cannot add DP rank")
            raise PinnedWorkerNotAllowed(
                f"session {session!r}: explicit pin worker {requested.worker_id} rank {requested.dp_rank} "
                f"disagrees with its binding worker {bound.worker_id} rank {bound.dp_rank}",
                worker_id=requested.worker_id, dp_rank=requested.dp_rank, affinity_target=bound, session_id=session,
            )
        e.leases += 1
        self.stats.hits += 1
        return Hold(session, e.revision, "bound", e.target, requested, e.version)

    def commit(self, hold: Hold, dispatched_target: AffinityTarget | tuple[int, int | None]) -> Lease:
        """Record where the request was dispatched; call only after the worker accepted it."""
        if not hold.open:
            raise InvalidArgument(f"session {hold.session!r}: hold was already committed or dropped",
                                  session_id=hold.session)
        target = AffinityTarget(*dispatched_target)
        if self.is_member is not None and not self.is_member(target.worker_id):
            raise InvalidArgument(
                f"session {hold.session!r}: worker {target.worker_id} is not in the {self.pool} pool",
                session_id=hold.session, worker_id=target.worker_id, dp_rank=target.dp_rank,
            )
        if hold.requested is not None and not hold.requested.agrees_with(target):
            raise InvalidArgument(
                f"session {hold.session!r}: dispatched to worker {target.worker_id} rank {target.dp_rank} "
                f"but the request pinned worker {hold.requested.worker_id} rank {hold.requested.dp_rank}",
                session_id=hold.session, worker_id=target.worker_id, dp_rank=target.dp_rank,
            )
        now = self.clock.now_ns()
        e = self._table.get(hold.session)
        if e is None or e.revision != hold.revision:
            hold.open = False
            return Lease(hold.session, hold.revision, None)  # the binding vanished meanwhile
        if e.state == _INIT:
            deadline = check_deadline(now, self.ttl_ns, f"session {hold.session!r} idle deadline")
            hold.open = False
            e.state = _BOUND
            e.target = target
            e.leases = 1
            e.deadline = deadline
            e.version += 1
            self._by_worker.setdefault(target.worker_id, {})[hold.session] = None
            self.stats.binds += 1
            self._wake(e)
            self._emit("bound", hold.session, target, now)
            return Lease(hold.session, e.revision, target)
        bound = e.target
        assert bound is not None
        if self.mode is AffinityMode.HARD:
            if bound.worker_id != target.worker_id or (bound.dp_rank is not None and bound.dp_rank != target.dp_rank):
                hold.open = False
                self.stats.mismatches += 1
                self._remove(hold.session, e, "invalidated", now)
                self.stats.invalidations += 1
                raise InvalidArgument(
                    f"session {hold.session!r} is hard-bound to worker {bound.worker_id} rank {bound.dp_rank} "
                    f"but was dispatched to worker {target.worker_id} rank {target.dp_rank}; binding invalidated",
                    session_id=hold.session, worker_id=target.worker_id, dp_rank=target.dp_rank,
                )
        elif bound.worker_id != target.worker_id or (bound.dp_rank is not None and bound.dp_rank != target.dp_rank):
            new = AffinityTarget(target.worker_id, target.dp_rank if bound.dp_rank is not None else None)
            self._by_worker[bound.worker_id].pop(hold.session, None)
            if not self._by_worker[bound.worker_id]:
                del self._by_worker[bound.worker_id]
            self._by_worker.setdefault(new.worker_id, {})[hold.session] = None
            e.target = new
            e.version += 1
            self.stats.rebinds += 1
            self._emit("rebound", hold.session, new, now)
        hold.open = False
        return Lease(hold.session, e.revision, e.target)

    def drop(self, hold: Hold) -> None:
        """Abandon an uncommitted hold (selection or dispatch failed): free the slot, wake waiters."""
        if not hold.open:
            return
        hold.open = False
        e = self._table.get(hold.session)
        if e is None or e.revision != hold.revision:
            return
        if e.state == _INIT:
            del self._table[hold.session]
            self._wake(e)
        else:
            self._release_one(hold.session, e, self.clock.now_ns())

    def join_initializing(self, session: str, target: AffinityTarget | tuple[int, int | None]) -> Lease:
        """Finish another request's pending initialization with this request's own dispatch (2 leases)."""
        self._check_session(session)
        t = AffinityTarget(*target)
        if self.is_member is not None and not self.is_member(t.worker_id):
            raise InvalidArgument(f"session {session!r}: worker {t.worker_id} is not in the {self.pool} pool",
                                  session_id=session, worker_id=t.worker_id, dp_rank=t.dp_rank)
        e = self._table.get(session)
        if e is None or e.state != _INIT:
            raise InvalidArgument(f"session {session!r} has no pending initialization to join", session_id=session)
        now = self.clock.now_ns()
        e.deadline = check_deadline(now, self.ttl_ns, f"session {session!r} idle deadline")
        e.state = _BOUND
        e.target = t
        e.leases = 2
        e.version += 1
        self._by_worker.setdefault(t.worker_id, {})[session] = None
        self.stats.binds += 1
        self._wake(e)
        self._emit("bound", session, t, now)
        return Lease(session, e.revision, t)

    def on_settled(self, wait: Wait, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the initialization ``wait`` refers to commits or is dropped."""
        e = self._table.get(wait.session)
        if e is None or e.state != _INIT or e.revision != wait.revision:
            callback()
        else:
            e.waiters.append(callback)

    # ------------------------------------------------------------------ release / invalidate / expire

    def release(self, lease: Lease) -> bool:
        """End one use of the binding; the idle timer restarts now. False if already released or stale."""
        if lease.released:
            return False
        lease.released = True
        e = self._table.get(lease.session)
        if e is None or e.revision != lease.revision or e.state != _BOUND:
            return False
        self._release_one(lease.session, e, self.clock.now_ns())
        return True

    def invalidate(self, session: str, revision: int | None = None, version: int | None = None) -> bool:
        """Remove the session's entry if it still has ``revision`` and ``version`` (``None`` = any)."""
        e = self._table.get(session)
        if e is None or (revision is not None and e.revision != revision):
            return False
        if version is not None and e.version != version:
            return False
        self._remove(session, e, "invalidated", self.clock.now_ns())
        self.stats.invalidations += 1
        return True

    def invalidate_worker(self, worker_id: int, dp_rank: int | None = None) -> list[str]:
        """Drop every binding to ``worker_id`` (or only those naming ``dp_rank``); returns the sessions."""
        sessions = list(self._by_worker.get(worker_id, ()))
        if dp_rank is not None:
            sessions = [s for s in sessions if self._table[s].target.dp_rank == dp_rank]  # type: ignore[union-attr]
        now = self.clock.now_ns()
        for s in sessions:
            self._remove(s, self._table[s], "invalidated", now)
        self.stats.invalidations += len(sessions)
        return sessions

    def invalidate_all(self) -> list[str]:
        """Drop every entry, bound or initializing (its router is going away); returns the sessions dropped.

        Each counts as an invalidation, as ``invalidate(session)`` would: a bound session's observer hears
        ``invalidated`` and the requests waiting for an initializer are woken (their ``on_settled`` callbacks
        run), so none waits for a choice that will never come.
        """
        return [session for session in list(self._table) if self.invalidate(session)]

    def query_target(self, session: str) -> AffinityTarget | None:
        """The bound target, or ``None`` (absent, initializing, or idle past its deadline); read-only."""
        e = self._table.get(session)
        if e is None or e.state != _BOUND:
            return None
        if not e.leases and e.deadline <= self.clock.now_ns():
            return None
        return e.target

    def active_leases(self, session: str) -> int:
        """Active leases of a bound session (0 if none)."""
        e = self._table.get(session)
        return 0 if e is None or e.state != _BOUND else e.leases

    def expire(self, now_ns: int | None = None) -> int:
        """Remove bound entries without leases whose idle deadline passed; returns how many."""
        now = self.clock.now_ns() if now_ns is None else now_ns
        heap = self._idle
        count = 0
        while heap and heap[0][0] <= now:
            _, _, session = heapq.heappop(heap)
            e = self._table.get(session)
            if e is not None and e.state == _BOUND and not e.leases and e.deadline <= now:
                self._remove(session, e, "expired", now)
                count += 1
        self.stats.expirations += count
        return count

    def advance_clock(self, t_ns: int) -> int:
        """Advance the manual clock to ``t_ns`` and expire idle bindings; returns how many expired.

        Rejected with nothing changed if time would go backwards or a TTL deadline from ``t_ns``
        would overflow the clock's range.
        """
        clock = self.clock
        if not isinstance(clock, ManualClock):
            raise InvalidArgument("advance_clock needs a ManualClock; a WallClock table expires idle bindings "
                                  "when they are next looked at, or when its host calls expire()")
        if not isinstance(t_ns, int) or t_ns < clock.now_ns():
            raise InvalidArgument(f"advance_clock: {t_ns!r} is before the current time {clock.now_ns()} ns",
                                  field="t_ns")
        if t_ns > MAX_TIME_NS - self.ttl_ns:
            raise InvalidArgument(
                f"advance_clock: {t_ns} ns + ttl {self.ttl_ns} ns would exceed the clock maximum {MAX_TIME_NS} ns",
                field="t_ns",
            )
        clock.advance_to(t_ns)
        return self.expire(t_ns)

    # ------------------------------------------------------------------ internals

    def _check_session(self, session: str) -> None:
        if not isinstance(session, str):
            raise InvalidArgument(f"session id must be a string, got {type(session).__name__}", field="session_id")
        if len(session) > self.max_session_id_bytes // 4 and len(session.encode()) > self.max_session_id_bytes:
            raise InvalidArgument(
                f"session id of {len(session.encode())} bytes exceeds max_session_id_bytes={self.max_session_id_bytes}",
                field="session_id",
            )
        if not session:
            raise InvalidArgument("session id is empty", field="session_id", session_id=session)

    def _release_one(self, session: str, e: _Entry, now: int) -> None:
        if e.leases:
            e.leases -= 1
        e.deadline = check_deadline(now, self.ttl_ns, f"session {session!r} idle deadline")
        self.stats.releases += 1
        if not e.leases:
            self._n += 1
            heapq.heappush(self._idle, (e.deadline, self._n, session))
            self._emit("released", session, e.target, now)

    def _remove(self, session: str, e: _Entry, kind: str, now: int) -> None:
        del self._table[session]
        if e.state == _INIT:
            self._wake(e)
            return
        target = e.target
        assert target is not None
        sessions = self._by_worker.get(target.worker_id)
        if sessions is not None:
            sessions.pop(session, None)
            if not sessions:
                del self._by_worker[target.worker_id]
        self._emit(kind, session, target, now)

    def _wake(self, e: _Entry) -> None:
        waiters, e.waiters = e.waiters, []
        for callback in waiters:
            callback()

    def _emit(self, kind: str, session: str, target: AffinityTarget | None, now: int) -> None:
        if self.observer is not None:
            self.observer(AffinityEvent(kind, session, target, self.pool, now))
