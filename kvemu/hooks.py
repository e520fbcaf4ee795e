"""Lifecycle hooks: how reports, traces and simulation hosts observe kvemu without reaching inside.

Actors emit one ``HookEvent`` per lifecycle step; observers are plain callables registered on a
``Hooks`` hub. Its ``kind`` is a ``HookKind`` (a string enum: ``request_arrived``, ``routed``,
``dispatch_accepted``, ``dispatch_rejected``, ``first_token``, ``tokens``, ``completed``, ``failed``, ``retried``,
``queued``, ``worker_added``/``_removed``/``_fenced``, ``affinity_bound``/``_rebound``/``_released``/``_expired``/
``_invalidated``, ``kv_gap``, ``kv_replay``, ``kv_lost``, ``kv_restart``).

A request-level event carries the request's ``RequestRecord`` itself (the one the router keeps, as it
stands at that step: an observer that keeps events sees it change), so an observer reads a request's facts
there; ``details`` holds what the record does not, as one small typed payload per kind (``DETAILS``): one
routing decision as it was made (``Routed``), a token batch (``TokenTimes``), a refusal's ``Reason``, a
queue's depth (``QueueDepth``). ``HookEvent.data``, the same as a dict, is deprecated (one release).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from types import NoneType, UnionType
from typing import NamedTuple

import msgspec

from kvemu.records import RequestRecord

__all__ = ["DETAILS", "DUPLICATE", "Duplicate", "HookDetails", "HookEvent", "HookKind", "Hooks", "KINDS",
           "KvDetails", "KvRange", "KvReplay", "KvRestart", "QueueDepth", "Ranks", "Reason", "Restart", "Routed",
           "SessionBinding", "TokenTimes"]


# ---------------------------------------------------------------------------- payloads (one per shape)

class _Details(msgspec.Struct, frozen=True):
    """A hook event's details; ``msgspec.to_builtins`` gives them as a report row's fields."""


class Routed(_Details, frozen=True):
    """One routing decision as it was made (``ROUTED``)."""

    attempt: int
    """0 for the first try, then one more per retry."""
    reason: str
    cost: float
    overlap_blocks: int
    best_overlap_blocks: int
    candidates: list[tuple[int, int, float, int]]
    """Every rank weighed, in the selector's order: (worker_id, dp_rank, cost, overlap_blocks)."""


class Reason(_Details, frozen=True):
    """Why (``DISPATCH_REJECTED``, ``WORKER_FENCED``, ``WORKER_REMOVED``)."""

    reason: str


class Restart(_Details, frozen=True):
    """A disaggregated request starts again from its prefill (``RETRIED``): why, and how many times so far."""

    reason: str
    restart: int


class TokenTimes(_Details, frozen=True):
    """The token times (ns) of one batch (``TOKENS``)."""

    times_ns: list[int]


class Duplicate(_Details, frozen=True):
    """A copy refused under the id of an open request (``FAILED``; its record is the copy's, not the open one's)."""

    duplicate: bool = True


DUPLICATE = Duplicate()
"""The one ``Duplicate`` (it holds nothing else)."""


class QueueDepth(_Details, frozen=True):
    """How many requests the policy queue holds, this one included (``QUEUED``)."""

    depth: int


class Ranks(_Details, frozen=True):
    """A registered worker's ranks: ``dp_size`` of them from ``dp_start`` (``WORKER_ADDED``)."""

    dp_size: int
    dp_start: int


class SessionBinding(_Details, frozen=True):
    """The session whose binding changed, and the pool whose table holds it (the ``AFFINITY_*`` kinds)."""

    session: str
    pool: str


class KvRange(_Details, frozen=True):
    """KV-event batches ``start`` up to ``until`` (excluded) of a rank's stream (``KV_GAP``, ``KV_LOST``)."""

    start: int = msgspec.field(name="from")
    until: int = msgspec.field(name="to")


class KvReplay(_Details, frozen=True):
    """A replay of batches ``start`` up to ``until`` (excluded) ended, ``recovered`` of them brought (``KV_REPLAY``)."""

    start: int = msgspec.field(name="from")
    until: int = msgspec.field(name="to")
    recovered: int


class KvRestart(_Details, frozen=True):
    """A rank's stream went back to ``seq`` where ``expected`` was due (``KV_RESTART``)."""

    seq: int
    expected: int


KvDetails = KvRange | KvReplay | KvRestart
"""What a rank's KV-event stream tells its observer (``EventStream``), as ``kv_*`` events carry it."""

HookDetails = (Routed | Reason | Restart | TokenTimes | Duplicate | QueueDepth | Ranks | SessionBinding | KvRange
               | KvReplay | KvRestart)
"""Any kind's details (``DETAILS`` says which a kind carries)."""


class HookKind(StrEnum):
    """What a ``HookEvent`` tells. A member equals (and hashes as) its string, so ``subscribe(f, "completed")``
    and ``ev.kind == "completed"`` keep working; emitters pass members, so mypy refuses a kind that does not exist.
    Each member says what its ``details`` are (``DETAILS`` holds the same, for code)."""

    REQUEST_ARRIVED = "request_arrived"
    """A request reached the router (or the disaggregated coordinator). No details."""
    ROUTED = "routed"
    """A rank was chosen (``Routed``: attempt, reason, cost, overlaps, candidates)."""
    DISPATCH_ACCEPTED = "dispatch_accepted"
    """The chosen worker accepted the request. No details."""
    DISPATCH_REJECTED = "dispatch_rejected"
    """The chosen worker refused it or did not answer in time (``Reason``)."""
    FIRST_TOKEN = "first_token"
    """Its first token arrived. No details."""
    TOKENS = "tokens"
    """A batch of later tokens arrived (``TokenTimes``)."""
    COMPLETED = "completed"
    """It ended with its output. No details."""
    FAILED = "failed"
    """It ended without (the record's ``failure`` says why); ``Duplicate`` on a refused copy of an open
    request's id, otherwise no details."""
    RETRIED = "retried"
    """A disaggregated request lost its decode leg's KV and starts again from its prefill (``Restart``)."""
    QUEUED = "queued"
    """It waits in the policy queue (``QueueDepth``)."""
    WORKER_ADDED = "worker_added"
    """A worker registered (``Ranks``)."""
    WORKER_REMOVED = "worker_removed"
    """A worker was forgotten (``Reason``)."""
    WORKER_FENCED = "worker_fenced"
    """A worker or one of its ranks takes no new requests (``Reason``: ``draining``, ``rank_down``, or why it is
    on its way out)."""
    AFFINITY_BOUND = "affinity_bound"
    """A session was bound to a rank (``SessionBinding``)."""
    AFFINITY_REBOUND = "affinity_rebound"
    """A session moved to another rank (``SessionBinding``)."""
    AFFINITY_RELEASED = "affinity_released"
    """A session's binding was released (``SessionBinding``)."""
    AFFINITY_EXPIRED = "affinity_expired"
    """A session's binding outlived its time to live (``SessionBinding``)."""
    AFFINITY_INVALIDATED = "affinity_invalidated"
    """A session's rank went away (``SessionBinding``)."""
    KV_GAP = "kv_gap"
    """A rank's KV-event stream skipped sequence numbers (``KvRange``: the missing ones)."""
    KV_REPLAY = "kv_replay"
    """A rank's missed KV events were asked for again (``KvReplay``)."""
    KV_LOST = "kv_lost"
    """KV events that could not be replayed: the index forgot the rank's blocks (``KvRange``)."""
    KV_RESTART = "kv_restart"
    """A rank's KV-event stream started over: its engine restarted (``KvRestart``)."""


KINDS: frozenset[HookKind] = frozenset(HookKind)
"""Every hook kind (``HookKind``'s members; kept for one release: iterate ``HookKind`` instead)."""

DETAILS: Mapping[HookKind, type | UnionType] = {
    HookKind.REQUEST_ARRIVED: NoneType, HookKind.ROUTED: Routed, HookKind.DISPATCH_ACCEPTED: NoneType,
    HookKind.DISPATCH_REJECTED: Reason, HookKind.FIRST_TOKEN: NoneType, HookKind.TOKENS: TokenTimes,
    HookKind.COMPLETED: NoneType, HookKind.FAILED: Duplicate | None, HookKind.RETRIED: Restart,
    HookKind.QUEUED: QueueDepth, HookKind.WORKER_ADDED: Ranks, HookKind.WORKER_REMOVED: Reason,
    HookKind.WORKER_FENCED: Reason, HookKind.AFFINITY_BOUND: SessionBinding, HookKind.AFFINITY_REBOUND: SessionBinding,
    HookKind.AFFINITY_RELEASED: SessionBinding, HookKind.AFFINITY_EXPIRED: SessionBinding,
    HookKind.AFFINITY_INVALIDATED: SessionBinding, HookKind.KV_GAP: KvRange, HookKind.KV_REPLAY: KvReplay,
    HookKind.KV_LOST: KvRange, HookKind.KV_RESTART: KvRestart,
}
"""Each kind's ``details`` type, for ``isinstance`` (``NoneType``: the kind carries none)."""


class HookEvent(NamedTuple):
    """One lifecycle step: what happened, when (ns on the emitting actor's clock), and its details."""

    kind: HookKind
    time_ns: int
    request_id: str | None = None
    worker_id: int | None = None
    dp_rank: int | None = None
    details: HookDetails | None = None
    """What the record does not hold, typed by kind (``DETAILS``)."""
    record: RequestRecord | None = None
    """The request's record (request-level events; a disaggregated pool's leg events carry the leg's)."""
    pool: str | None = None
    """The disaggregated pool whose router emitted it (``prefill``/``decode``), when the coordinator forwards it."""

    @property
    def data(self) -> dict[str, object] | None:
        """Deprecated (one release): ``details`` as a dict (KV ranges keyed ``from``/``to``), ``pool`` added."""
        warnings.warn("HookEvent.data is deprecated: read the typed HookEvent.details (and HookEvent.pool)",
                      DeprecationWarning, stacklevel=2)
        details, pool = self.details, self.pool
        if details is None and pool is None:
            return None
        view: dict[str, object] = {} if details is None else dict(
            zip(details.__struct_encode_fields__, msgspec.structs.astuple(details)))
        if pool is not None:
            view["pool"] = pool
        return view


Observer = Callable[[HookEvent], None]


class Hooks:
    """Observers by kind; ``emit`` calls them in registration order. Cheap when nobody listens."""

    def __init__(self) -> None:
        self._by_kind: dict[HookKind, list[Observer]] = {}
        self._all: list[Observer] = []
        self.counts: Counter[str] = Counter()
        """How many events of each kind were noted here, observed or not (a report's ``hook_counts``): counting
        needs no event built."""
        self._relay: Counter[str] | None = None
        self._relay_kinds: frozenset[str] = frozenset()

    def subscribe(self, observer: Observer, *kinds: HookKind | str) -> None:
        """Call ``observer`` for these kinds (all kinds when none are given); a kind may be given by its string
        (``"completed"``). An unknown kind raises ``ValueError``."""
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"unknown hook kinds {unknown}; known: {sorted(k.value for k in HookKind)}")
        if not kinds:
            self._all.append(observer)
        for k in kinds:
            self._by_kind.setdefault(HookKind(k), []).append(observer)

    def count_into(self, counts: Counter[str], kinds: Iterable[HookKind]) -> None:
        """Also count the events of ``kinds`` noted here in ``counts`` (another hub's ``counts``, to which this
        hub relays those kinds' events: a second router replica's)."""
        self._relay = counts
        self._relay_kinds = frozenset(kinds)

    def wants(self, kind: HookKind) -> bool:
        """Whether anyone listens to ``kind`` (lets emitters skip building details; they ``tally`` it instead)."""
        return bool(self._all) or kind in self._by_kind

    def tally(self, kind: HookKind) -> None:
        """Count an event of ``kind`` that nobody listens to, without building it."""
        self.counts[kind] += 1
        if self._relay is not None and kind in self._relay_kinds:
            self._relay[kind] += 1

    def note(self, kind: HookKind, time_ns: int, request_id: str | None = None, worker_id: int | None = None,
             dp_rank: int | None = None, details: HookDetails | None = None,
             record: RequestRecord | None = None, pool: str | None = None) -> None:
        """Count an event of ``kind`` and emit it as a ``HookEvent`` if anyone listens (built only then)."""
        self.counts[kind] += 1
        if self._relay is not None and kind in self._relay_kinds:
            self._relay[kind] += 1
        if self._all or kind in self._by_kind:
            self.emit(HookEvent(kind, time_ns, request_id, worker_id, dp_rank, details, record, pool))

    def emit(self, event: HookEvent) -> None:
        """Deliver ``event`` to its observers (not counted: ``note`` counts, where the event is made)."""
        for observer in self._by_kind.get(event.kind, ()):
            observer(event)
        for observer in self._all:
            observer(event)
