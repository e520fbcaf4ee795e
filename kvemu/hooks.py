"""Lifecycle hooks: how reports, traces and simulation hosts observe kvemu without reaching inside.

Actors emit one ``HookEvent`` per lifecycle step; observers are plain callables registered on a
``Hooks`` hub. Its ``kind`` is a ``HookKind`` (a string enum: ``request_arrived``, ``routed``,
``dispatch_accepted``, ``dispatch_rejected``, ``first_token``, ``tokens``, ``completed``, ``failed``, ``retried``,
``queued``, ``worker_added``/``_removed``/``_fenced``, ``affinity_bound``/``_rebound``/``_released``/``_expired``/
``_invalidated``, ``kv_gap``, ``kv_replay``, ``kv_lost``, ``kv_restart``).

A request-level event carries the request's ``RequestRecord`` itself (the one the router keeps, as it
stands at that step: an observer that keeps events sees it change), so an observer reads a request's facts
there; ``data`` holds what the record does not: one routing decision as it was made (attempt, reason,
overlaps, cost, candidates), a token batch, a refusal's reason, a queue's depth.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any, NamedTuple

from kvemu.records import RequestRecord

__all__ = ["HookEvent", "HookKind", "Hooks", "KINDS"]

class HookKind(StrEnum):
    """What a ``HookEvent`` tells. A member equals (and hashes as) its string, so ``subscribe(f, "completed")``
    and ``ev.kind == "completed"`` keep working; emitters pass members, so mypy refuses a kind that does not exist."""

    REQUEST_ARRIVED = "request_arrived"
    """A request reached the router (or the disaggregated coordinator)."""
    ROUTED = "routed"
    """A rank was chosen (``data``: attempt, reason, overlaps, cost, candidates)."""
    DISPATCH_ACCEPTED = "dispatch_accepted"
    """The chosen worker accepted the request."""
    DISPATCH_REJECTED = "dispatch_rejected"
    """The chosen worker refused it or did not answer in time (``data["reason"]``)."""
    FIRST_TOKEN = "first_token"
    """Its first token arrived."""
    TOKENS = "tokens"
    """A batch of later tokens arrived."""
    COMPLETED = "completed"
    """It ended with its output."""
    FAILED = "failed"
    """It ended without (the record's ``failure`` says why)."""
    RETRIED = "retried"
    """A disaggregated request lost its decode leg's KV and starts again from its prefill (``data``: reason,
    restart)."""
    QUEUED = "queued"
    """It waits in the policy queue (``data["depth"]``)."""
    WORKER_ADDED = "worker_added"
    """A worker registered (``data``: dp_size, dp_start)."""
    WORKER_REMOVED = "worker_removed"
    """A worker was forgotten (``data["reason"]``)."""
    WORKER_FENCED = "worker_fenced"
    """A worker or one of its ranks takes no new requests (draining, rank down, or on its way out)."""
    AFFINITY_BOUND = "affinity_bound"
    """A session was bound to a rank."""
    AFFINITY_REBOUND = "affinity_rebound"
    """A session moved to another rank."""
    AFFINITY_RELEASED = "affinity_released"
    """A session's binding was released."""
    AFFINITY_EXPIRED = "affinity_expired"
    """A session's binding outlived its time to live."""
    AFFINITY_INVALIDATED = "affinity_invalidated"
    """A session's rank went away."""
    KV_GAP = "kv_gap"
    """A rank's KV-event stream skipped sequence numbers."""
    KV_REPLAY = "kv_replay"
    """A rank's missed KV events were asked for again."""
    KV_LOST = "kv_lost"
    """KV events that could not be replayed (the index forgot the rank's blocks)."""
    KV_RESTART = "kv_restart"
    """A rank's KV-event stream started over (its engine restarted)."""


KINDS: frozenset[HookKind] = frozenset(HookKind)
"""Every hook kind (``HookKind``'s members; kept for one release: iterate ``HookKind`` instead)."""


class HookEvent(NamedTuple):
    """One lifecycle step: what happened, when (ns on the emitting actor's clock), and its details."""

    kind: HookKind
    time_ns: int
    request_id: str | None = None
    worker_id: int | None = None
    dp_rank: int | None = None
    data: dict[str, Any] | None = None
    record: RequestRecord | None = None
    """The request's record (request-level events; a disaggregated pool's leg events carry the leg's)."""


Observer = Callable[[HookEvent], None]


class Hooks:
    """Observers by kind; ``emit`` calls them in registration order. Cheap when nobody listens."""

    def __init__(self) -> None:
        self._by_kind: dict[HookKind, list[Observer]] = {}
        self._all: list[Observer] = []

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

    def wants(self, kind: HookKind) -> bool:
        """Whether anyone listens to ``kind`` (lets emitters skip building details)."""
        return bool(self._all) or kind in self._by_kind

    def note(self, kind: HookKind, time_ns: int, request_id: str | None = None, worker_id: int | None = None,
             dp_rank: int | None = None, data: dict[str, Any] | None = None,
             record: RequestRecord | None = None) -> None:
        """Emit a ``HookEvent`` of ``kind`` if anyone listens (the event is built only then)."""
        if self._all or kind in self._by_kind:
            self.emit(HookEvent(kind, time_ns, request_id, worker_id, dp_rank, data, record))

    def emit(self, event: HookEvent) -> None:
        """Deliver ``event`` to its observers."""
        for observer in self._by_kind.get(event.kind, ()):
            observer(event)
        for observer in self._all:
            observer(event)
