"""Lifecycle hooks: how reports, traces and simulation hosts observe kvemu without reaching inside.

Actors emit one ``HookEvent`` per lifecycle step; observers are plain callables registered on a
``Hooks`` hub. Kinds: ``request_arrived``, ``routed``, ``dispatch_accepted``, ``dispatch_rejected``,
``first_token``, ``tokens``, ``completed``, ``failed``, ``worker_added``, ``worker_removed``,
``worker_fenced``, ``affinity_bound``/``_rebound``/``_released``/``_expired``/``_invalidated``,
``queued``, ``kv_gap``, ``kv_replay``, ``kv_lost``, ``kv_restart``.

A request-level event carries the request's ``RequestRecord`` itself (the one the router keeps, as it
stands at that step: an observer that keeps events sees it change), so an observer reads a request's facts
there; ``data`` holds what the record does not: one routing decision as it was made (attempt, reason,
overlaps, cost, candidates), a token batch, a refusal's reason, a queue's depth.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from kvemu.records import RequestRecord

__all__ = ["HookEvent", "Hooks", "KINDS"]

KINDS = frozenset(
    {
        "request_arrived",
        "routed",
        "dispatch_accepted",
        "dispatch_rejected",
        "first_token",
        "tokens",
        "completed",
        "failed",
        "worker_added",
        "worker_removed",
        "worker_fenced",
        "affinity_bound",
        "affinity_rebound",
        "affinity_released",
        "affinity_expired",
        "affinity_invalidated",
        "queued",
        "kv_gap",
        "kv_replay",
        "kv_lost",
        "kv_restart",
    }
)
"""Every hook kind an actor emits (``Hooks.subscribe`` takes any of them)."""


class HookEvent(NamedTuple):
    """One lifecycle step: what happened, when (ns on the emitting actor's clock), and its details."""

    kind: str
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
        self._by_kind: dict[str, list[Observer]] = {}
        self._all: list[Observer] = []

    def subscribe(self, observer: Observer, *kinds: str) -> None:
        """Call ``observer`` for these kinds (all kinds when none are given)."""
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"unknown hook kinds {unknown}; known: {sorted(KINDS)}")
        if not kinds:
            self._all.append(observer)
        for k in kinds:
            self._by_kind.setdefault(k, []).append(observer)

    def wants(self, kind: str) -> bool:
        """Whether anyone listens to ``kind`` (lets emitters skip building details)."""
        return bool(self._all) or kind in self._by_kind

    def note(self, kind: str, time_ns: int, request_id: str | None = None, worker_id: int | None = None,
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
