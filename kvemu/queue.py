"""The router's policy queue: requests wait only while every eligible rank is busy.

A rank is busy when its active prefill tokens exceed the class's absolute threshold or a fraction of
its ``max_num_batched_tokens`` (OR). Inside a class, entries are ordered by strict priority tier, then
deadline, then the class policy (fcfs, lcfs or wspt, bumped by ``priority_jump``), with a shared lane
and one lane per exact pin (head-of-line blocking is per lane). Classes share dispatch by weighted
deficit round robin. Queueing is off unless a threshold is configured, as in the reference.
A rank of a worker that is no longer registered (``rank_known``) is never dispatchable: its lane waits.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated

import msgspec
from msgspec import Meta

from kvemu.clock import NS_PER_S
from kvemu.config import NonNeg, QueuePolicyName
from kvemu.errors import InvalidArgument, KvemuError
from kvemu.index import WorkerKey
from kvemu.validation import check_struct

__all__ = [
    "QueuePolicy",
    "QueueClass",
    "QueueLimits",
    "QueueEntry",
    "PolicyQueue",
    "QueueRejected",
    "DoNotQueue",
]

QueuePolicy = QueuePolicyName
"""Ordering inside a queue class (``kvemu.config.QueuePolicyName``: fcfs, lcfs or wspt)."""

OrderKey = tuple[int, tuple[int, int], float]
"""A queued entry's place in its class: (-tier, (0, deadline) or (1, 0), the policy's key); smaller first."""


class QueueRejected(KvemuError):
    """A queue limit is reached; the request was not queued (HTTP 529 in the reference).

    As Dynamo's ``QueueRejection{policy_class, current, limit}``: ``resource`` says which limit (requests,
    raw ISL tokens, cached tokens), ``current`` what was queued and ``limit`` the limit × workers."""

    attributes = ("request_id", "policy_class", "resource", "current", "limit")


class DoNotQueue(KvemuError):
    """The request asked not to wait and every eligible rank is busy."""

    attributes = ("request_id", "policy_class")


class QueueClass(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One policy class: its busy thresholds, ordering and DRR quantum (in uncached tokens)."""

    name: str = "default"
    busy_threshold: NonNeg | None = None
    """Busy when active prefill tokens > this (absolute)."""
    busy_threshold_frac: NonNeg | None = None
    """Busy when active prefill tokens > this × the rank's ``max_num_batched_tokens``."""
    policy: QueuePolicy = "fcfs"
    quantum: Annotated[int, Meta(ge=1)] = 8192

    def __post_init__(self) -> None:
        try:
            check_struct(self)
        except InvalidArgument as exc:
            raise InvalidArgument(f"queue class {self.name!r}: {exc}", field=exc.field) from None

    @property
    def enabled(self) -> bool:
        """Whether requests of this class ever wait."""
        return self.busy_threshold is not None or self.busy_threshold_frac is not None


class QueueLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-worker limits, multiplied by the number of workers; ``None`` = unlimited."""

    requests_per_worker: int | None = None
    raw_isl_tokens_per_worker: int | None = None
    cached_tokens_per_worker: int | None = None


class QueueEntry:
    """A waiting request; ``payload`` is the host's (the queue never looks inside it)."""

    __slots__ = ("request_id", "cls", "tier", "priority_jump_ns", "arrival_ns", "isl", "cached_tokens",
                 "pin", "ranks", "deadline_ns", "payload", "seq", "cost", "queued_ns")

    def __init__(
        self,
        request_id: str,
        *,
        ranks: Sequence[WorkerKey],
        arrival_ns: int,
        isl: int = 0,
        cached_tokens: int = 0,
        cls: str = "default",
        tier: int = 0,
        priority_jump_s: float = 0.0,
        pin: WorkerKey | None = None,
        deadline_ns: int | None = None,
        payload: object = None,
    ) -> None:
        self.request_id = request_id
        self.cls = cls
        self.tier = tier
        self.priority_jump_ns = round(priority_jump_s * NS_PER_S)
        self.arrival_ns = arrival_ns
        self.isl = isl
        self.cached_tokens = cached_tokens
        self.pin = pin
        self.ranks = tuple(ranks) if pin is None else (pin,)
        self.deadline_ns = deadline_ns
        self.payload = payload
        self.seq = 0
        self.cost = max(1, isl - cached_tokens)
        self.queued_ns = 0

    def __repr__(self) -> str:
        return f"QueueEntry({self.request_id!r}, cls={self.cls!r}, tier={self.tier}, pin={self.pin})"


class _Lane:
    __slots__ = ("heap",)

    def __init__(self) -> None:
        self.heap: list[tuple[OrderKey, int, QueueEntry]] = []


class _ClassState:
    __slots__ = ("spec", "shared", "pinned", "deficit", "count")

    def __init__(self, spec: QueueClass) -> None:
        self.spec = spec
        self.shared = _Lane()
        self.pinned: dict[WorkerKey, _Lane] = {}
        self.deficit = 0
        self.count = 0


class PolicyQueue:
    """Waiting requests of every class; told the load through two callables (sans-IO)."""

    def __init__(
        self,
        *,
        classes: Iterable[QueueClass] = (QueueClass(),),
        limits: QueueLimits | None = None,
        prefill_tokens: Callable[[WorkerKey], int],
        batched_capacity: Callable[[WorkerKey], int] = lambda key: 10_000_000,
        rank_known: Callable[[WorkerKey], bool] | None = None,
    ) -> None:
        self._classes: dict[str, _ClassState] = {}
        for spec in classes:
            if spec.name in self._classes:
                raise InvalidArgument(f"queue class {spec.name!r} is defined twice", field="name")
            self._classes[spec.name] = _ClassState(spec)
        if not self._classes:
            raise InvalidArgument("the queue needs at least one class", field="classes")
        self._ring = list(self._classes)
        self._cursor = 0
        self.limits = limits or QueueLimits()
        self._prefill_tokens = prefill_tokens
        self._capacity = batched_capacity
        self._known = rank_known
        self._entries: dict[str, QueueEntry] = {}
        self._seq = 0
        self._isl_total = 0
        self._cached_total = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> QueueEntry | None:
        """The queued entry of ``request_id``, or ``None``."""
        return self._entries.get(request_id)

    def class_spec(self, cls: str) -> QueueClass:
        """The spec of a class, or ``InvalidArgument`` naming the known ones."""
        state = self._classes.get(cls)
        if state is None:
            raise InvalidArgument(f"unknown queue class {cls!r}; known: {', '.join(self._classes)}", field="cls")
        return state.spec

    def depth(self, cls: str | None = None) -> int:
        """Queued requests (of one class, or all)."""
        return len(self._entries) if cls is None else self._classes[cls].count

    # ------------------------------------------------------------------ decisions

    def is_busy(self, key: WorkerKey, cls: str = "default") -> bool:
        """Whether ``key`` is busy for ``cls`` (never, for a class without thresholds)."""
        spec = self._classes[cls].spec
        p = self._prefill_tokens(key)
        if spec.busy_threshold is not None and p > spec.busy_threshold:
            return True
        return spec.busy_threshold_frac is not None and p > spec.busy_threshold_frac * self._capacity(key)

    def should_queue(self, ranks: Sequence[WorkerKey], cls: str = "default", *, pin: WorkerKey | None = None) -> bool:
        """Wait iff the class queues at all and (it has a backlog or every eligible rank is busy).

        A request placed on one exact rank (``pin``: an explicit pin or a session's binding) waits only
        behind the shared lane and its own rank's lane: another rank's backlog does not hold it back (as in
        Dynamo's replay, where a bound session's arrival on an idle rank bypasses another rank's backlog).
        """
        state = self._classes.get(cls)
        if state is None:
            self.class_spec(cls)
        assert state is not None
        if not state.spec.enabled or not ranks:
            return False
        if pin is not None:
            return bool(state.shared.heap) or pin in state.pinned or not self._dispatchable(pin, cls)
        if state.count:
            return True
        return not any(self._dispatchable(k, cls) for k in ranks)

    def _dispatchable(self, key: WorkerKey, cls: str) -> bool:
        """Whether a request may be released to ``key`` now: its worker is known and the rank not busy."""
        return (self._known is None or self._known(key)) and not self.is_busy(key, cls)

    def push(self, entry: QueueEntry, *, num_workers: int = 1, do_not_queue: bool = False, now_ns: int = 0) -> None:
        """Queue ``entry``; ``DoNotQueue`` or ``QueueRejected`` leave the queue unchanged."""
        state = self._classes.get(entry.cls)
        if state is None:
            self.class_spec(entry.cls)
        assert state is not None
        if entry.request_id in self._entries:
            raise InvalidArgument(f"request {entry.request_id!r} is already queued", field="request_id")
        if do_not_queue:
            raise DoNotQueue(f"request {entry.request_id!r}: every eligible rank is busy and do_not_queue is set",
                             request_id=entry.request_id, policy_class=entry.cls)
        lim = self.limits
        n = max(1, num_workers)
        for limit, current, what in (
            (lim.requests_per_worker, len(self._entries), "requests"),
            (lim.raw_isl_tokens_per_worker, self._isl_total, "raw ISL tokens"),
            (lim.cached_tokens_per_worker, self._cached_total, "cached tokens"),
        ):
            if limit is not None and current >= limit * n:
                raise QueueRejected(
                    f"request {entry.request_id!r} rejected: {current} queued {what} reached the limit "
                    f"{limit} per worker × {n} workers",
                    request_id=entry.request_id, policy_class=entry.cls, resource=what, current=current, limit=limit * n,
                )
        self._seq += 1
        entry.seq = self._seq
        entry.queued_ns = now_ns
        lane = state.shared if entry.pin is None else state.pinned.setdefault(entry.pin, _Lane())
        heapq.heappush(lane.heap, (self._order_key(state.spec, entry), entry.seq, entry))
        state.count += 1
        self._entries[entry.request_id] = entry
        self._isl_total += entry.isl
        self._cached_total += entry.cached_tokens

    def remove(self, request_id: str) -> QueueEntry | None:
        """Take a queued request out (cancelled or timed out); ``None`` if it is not queued."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        state = self._classes[entry.cls]
        lane = state.shared if entry.pin is None else state.pinned[entry.pin]
        lane.heap = [item for item in lane.heap if item[2] is not entry]
        heapq.heapify(lane.heap)
        if entry.pin is not None and not lane.heap:
            del state.pinned[entry.pin]
        self._forget(state, entry)
        return entry

    def pop_ready(self) -> QueueEntry | None:
        """The next entry that may be dispatched now (deficit round robin across classes), or ``None``.

        Call it repeatedly whenever capacity changes (prefill completed, request freed, worker added).
        """
        if not self._entries:
            return None
        ring = self._ring
        n = len(ring)
        heads: list[QueueEntry | None] = [None] * n
        for step in range(n):
            i = (self._cursor + step) % n
            state = self._classes[ring[i]]
            if not state.count:
                state.deficit = 0
                continue
            head = self._ready_head(state)
            heads[i] = head
            if head is None:
                continue  # blocked: keeps its deficit, earns nothing
            if state.deficit < head.cost:
                state.deficit += state.spec.quantum
            if state.deficit >= head.cost:
                return self._dispatch(i, state, head)
        ready = [i for i in range(n) if heads[i] is not None]
        if not ready:
            return None
        rounds = min(
            -(-(heads[i].cost - self._classes[ring[i]].deficit) // self._classes[ring[i]].spec.quantum)  # type: ignore[union-attr]
            for i in ready
        )
        for i in ready:
            self._classes[ring[i]].deficit += rounds * self._classes[ring[i]].spec.quantum
        for step in range(n):
            i = (self._cursor + step) % n
            head = heads[i]
            state = self._classes[ring[i]]
            if head is not None and state.deficit >= head.cost:
                return self._dispatch(i, state, head)
        return None  # pragma: no cover - the minimal rounds always make one head affordable

    def drain_ready(self) -> list[QueueEntry]:
        """Every entry dispatchable now, in dispatch order (each pop sees the same load view)."""
        out = []
        while (entry := self.pop_ready()) is not None:
            out.append(entry)
        return out

    # ------------------------------------------------------------------ internals

    def _order_key(self, spec: QueueClass, e: QueueEntry) -> OrderKey:
        deadline = (0, e.deadline_ns) if e.deadline_ns is not None else (1, 0)
        if spec.policy == "fcfs":
            policy_key: float = e.arrival_ns - e.priority_jump_ns
        elif spec.policy == "lcfs":
            policy_key = -(e.arrival_ns + e.priority_jump_ns)
        else:
            policy_key = -(1 + e.priority_jump_ns / NS_PER_S) / e.cost
        return (-e.tier, deadline, policy_key)

    def _ready_head(self, state: _ClassState) -> QueueEntry | None:
        best: tuple[OrderKey, int] | None = None
        head: QueueEntry | None = None
        cls = state.spec.name
        shared = state.shared.heap
        if shared:
            top = shared[0]
            if any(self._dispatchable(k, cls) for k in top[2].ranks):
                best, head = top[:2], top[2]
        for key, lane in state.pinned.items():
            top = lane.heap[0]
            if (best is None or top[:2] < best) and self._dispatchable(key, cls):
                best, head = top[:2], top[2]
        return head

    def _dispatch(self, i: int, state: _ClassState, entry: QueueEntry) -> QueueEntry:
        lane = state.shared if entry.pin is None else state.pinned[entry.pin]
        popped = heapq.heappop(lane.heap)[2]
        assert popped is entry
        if entry.pin is not None and not lane.heap:
            del state.pinned[entry.pin]
        state.deficit -= entry.cost
        self._forget(state, entry)
        nxt = self._ready_head(state) if state.count else None
        if nxt is None or state.deficit < nxt.cost:
            self._cursor = (i + 1) % len(self._ring)
        else:
            self._cursor = i
        return entry

    def _forget(self, state: _ClassState, entry: QueueEntry) -> None:
        state.count -= 1
        del self._entries[entry.request_id]
        self._isl_total -= entry.isl
        self._cached_total -= entry.cached_tokens
        if not state.count:
            state.deficit = 0
