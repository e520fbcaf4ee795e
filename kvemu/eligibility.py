"""Eligibility: which ``(worker, dp_rank)`` a request may be routed to, and why the others may not.

One builder serves the router's own scheduling path and any external host. Constraints are collected
first and resolved in ``build()``, so the order of the builder calls never changes the answer: an
affinity target narrows the candidates only if it is eligible under the *final* availability.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import NamedTuple

from kvemu.errors import (
    AllEligibleWorkersOverloaded,
    InvalidArgument,
    NoEndpoints,
    PinnedWorkerNotAllowed,
    PinnedWorkerOverloaded,
)
from kvemu.index import WorkerKey
from kvemu.registry import WorkerRegistry

__all__ = ["Ineligible", "AffinityTarget", "Candidates", "EligibilityBuilder"]


class Ineligible(enum.Enum):
    """Why a rank is not a candidate; checked in this order, the first failure wins."""

    WORKER_NOT_ALLOWED = "worker_not_allowed"
    WORKER_FENCED = "worker_fenced"
    WORKER_UNAVAILABLE = "worker_unavailable"
    DP_RANK_UNAVAILABLE = "dp_rank_unavailable"
    CONSTRAINTS_UNSATISFIED = "routing_constraints_unsatisfied"
    WORKER_OVERLOADED = "worker_overloaded"


class AffinityTarget(NamedTuple):
    """A worker and optionally one of its ranks (``None`` = any rank of that worker)."""

    worker_id: int
    dp_rank: int | None = None

    def matches(self, key: WorkerKey) -> bool:
        """Whether ``key`` is (one of) the target's rank(s)."""
        return key[0] == self.worker_id and (self.dp_rank is None or key[1] == self.dp_rank)

    def agrees_with(self, other: AffinityTarget) -> bool:
        """Same worker, and the same rank where both name one."""
        return self.worker_id == other.worker_id and (
            self.dp_rank is None or other.dp_rank is None or self.dp_rank == other.dp_rank
        )


class Candidates(NamedTuple):
    """The resolved candidate set of one request (never empty: ``build`` raises instead)."""

    ranks: tuple[WorkerKey, ...]
    """Every eligible rank, sorted (for the pin: only the pinned rank(s))."""
    pinned: AffinityTarget | None
    """The explicit pin, if any; selection stays within it."""
    affinity_target: AffinityTarget | None
    """The requested affinity target (advisory for custom policies)."""
    affinity_ranks: tuple[WorkerKey, ...]
    """The target's eligible ranks; empty when the target is ineligible (then it is ignored)."""

    def for_default_selector(self) -> tuple[WorkerKey, ...]:
        """Ranks the default selector compares: an eligible affinity target is exclusive."""
        return self.affinity_ranks or self.ranks


OverloadCheck = Callable[[WorkerKey], bool]


class EligibilityBuilder:
    """Collects a request's constraints; ``build()`` resolves them against the registry and load."""

    __slots__ = ("_registry", "_overloaded", "_allowed", "_only", "_marks", "_taints", "_pin", "_target")

    def __init__(self, registry: WorkerRegistry, overloaded: OverloadCheck | None = None) -> None:
        self._registry = registry
        self._overloaded = overloaded
        self._allowed: frozenset[int] | None = None
        self._only: frozenset[int | WorkerKey] | None = None
        self._marks: dict[int | WorkerKey, bool] = {}
        self._taints: frozenset[str] = frozenset()
        self._pin: AffinityTarget | None = None
        self._target: AffinityTarget | None = None

    def allow(self, worker_ids: Iterable[int] | None) -> EligibilityBuilder:
        """Restrict to these worker ids (``None`` lifts the restriction)."""
        self._allowed = None if worker_ids is None else frozenset(worker_ids)
        return self

    def available(self, only: Iterable[int | WorkerKey] | None) -> EligibilityBuilder:
        """The host's availability: only these workers or ranks are up (``None`` = all)."""
        self._only = None if only is None else frozenset(only)
        return self

    def set_available(self, worker_id: int, available: bool, dp_rank: int | None = None) -> EligibilityBuilder:
        """Mark one worker (or one rank) down or back up; the last call for it wins.

        A mark on a rank beats a mark on its worker, which beats ``available()``.
        """
        self._marks[worker_id if dp_rank is None else (worker_id, dp_rank)] = bool(available)
        return self

    def require_taints(self, taints: Iterable[str]) -> EligibilityBuilder:
        """Only workers carrying every one of these taints."""
        self._taints = frozenset(taints)
        return self

    def pin(self, worker_id: int | None, dp_rank: int | None = None) -> EligibilityBuilder:
        """An explicit pin from the request (``None`` clears it); validated, never rewritten."""
        if worker_id is None:
            if dp_rank is not None:
                raise InvalidArgument(f"dp_rank {dp_rank} was pinned without a worker_id", field="dp_rank",
                                      dp_rank=dp_rank)
            self._pin = None
        else:
            self._pin = AffinityTarget(worker_id, dp_rank)
        return self

    @property
    def pinned(self) -> AffinityTarget | None:
        """The explicit pin set on this builder, if any."""
        return self._pin

    def affinity(self, target: AffinityTarget | tuple[int, int | None] | None) -> EligibilityBuilder:
        """A session/sibling affinity target; it narrows candidates only if eligible at ``build()``."""
        self._target = None if target is None else AffinityTarget(*target)
        return self

    # ------------------------------------------------------------------ resolution

    def check(self, key: WorkerKey) -> Ineligible | None:
        """The first reason ``key`` is not eligible, or ``None``."""
        wid, rank = key
        if self._allowed is not None and wid not in self._allowed:
            return Ineligible.WORKER_NOT_ALLOWED
        reg = self._registry
        if reg.is_fenced(wid):
            return Ineligible.WORKER_FENCED
        spec = reg.get(wid)
        if spec is None or not self._is_up(key):
            return Ineligible.WORKER_UNAVAILABLE
        if not spec.dp_start <= rank < spec.dp_start + spec.dp_size:
            return Ineligible.DP_RANK_UNAVAILABLE
        if self._taints and not self._taints <= spec.taints:
            return Ineligible.CONSTRAINTS_UNSATISFIED
        if self._overloaded is not None and self._overloaded(key):
            return Ineligible.WORKER_OVERLOADED
        return None

    def _is_up(self, key: WorkerKey) -> bool:
        marks = self._marks
        if marks:
            mark = marks.get(key)
            if mark is None:
                mark = marks.get(key[0])
            if mark is not None:
                return mark
        only = self._only
        return only is None or key[0] in only or key in only

    def build(self) -> Candidates:
        """Resolve the constraints into candidates; raises the typed error when none remain.

        A pin that disagrees with an *eligible* affinity target is ``PinnedWorkerNotAllowed`` (as in Dynamo,
        where the eligible target joins the worker constraints the pin is validated against); an ineligible
        target is ignored, so the pin alone decides.
        """
        pin, target = self._pin, self._target
        if pin is not None:
            if (target is not None and not pin.agrees_with(target)
                    and (self._allowed is None or pin.worker_id in self._allowed) and self._is_eligible(target)):
                raise PinnedWorkerNotAllowed(
                    f"explicit pin worker {pin.worker_id} rank {pin.dp_rank} disagrees with the affinity target "
                    f"worker {target.worker_id} rank {target.dp_rank}",
                    worker_id=pin.worker_id, dp_rank=pin.dp_rank, affinity_target=target,
                )
            return self._build_pinned(pin, target)
        all_keys = self._registry.rank_keys()
        if (
            self._allowed is None
            and self._only is None
            and not self._marks
            and not self._taints
            and self._overloaded is None
            and not self._registry.has_fenced
        ):
            ranks = all_keys
        else:
            check = self.check
            ranks = tuple(k for k in all_keys if check(k) is None)
        if not ranks:
            self._raise_empty(all_keys)
        affinity_ranks: tuple[WorkerKey, ...] = ()
        if target is not None:
            affinity_ranks = tuple(k for k in ranks if target.matches(k))
        return Candidates(ranks, None, target, affinity_ranks)

    def _is_eligible(self, target: AffinityTarget) -> bool:
        """Whether some rank of ``target`` passes every check."""
        spec = self._registry.get(target.worker_id)
        if spec is None:
            return False
        keys = spec.keys() if target.dp_rank is None else [(target.worker_id, target.dp_rank)]
        return any(self.check(k) is None for k in keys)

    def _build_pinned(self, pin: AffinityTarget, target: AffinityTarget | None) -> Candidates:
        spec = self._registry.get(pin.worker_id)
        if spec is None:
            keys = [(pin.worker_id, pin.dp_rank if pin.dp_rank is not None else 0)]
        elif pin.dp_rank is None:
            keys = spec.keys()
        else:
            keys = [(pin.worker_id, pin.dp_rank)]
        reasons = [(k, self.check(k)) for k in keys]
        ranks = tuple(k for k, r in reasons if r is None)
        if not ranks:
            first = reasons[0][1]
            where = f"pinned worker {pin.worker_id}" + ("" if pin.dp_rank is None else f" rank {pin.dp_rank}")
            named = {"worker_id": pin.worker_id, "dp_rank": pin.dp_rank}
            if first is Ineligible.WORKER_NOT_ALLOWED:
                raise PinnedWorkerNotAllowed(
                    f"{where} is not in the request's allow-list {sorted(self._allowed or ())}", **named)
            if all(r is Ineligible.WORKER_OVERLOADED for _, r in reasons):
                raise PinnedWorkerOverloaded(f"{where} is over a busy threshold", **named)
            detail = first.value if first is not None else "unknown"
            dp_range: dict[str, int] = {}
            if first is Ineligible.DP_RANK_UNAVAILABLE and spec is not None:
                detail += f" (valid ranks {spec.dp_start}..{spec.dp_start + spec.dp_size - 1})"
                dp_range = {"dp_start": spec.dp_start, "dp_end": spec.dp_start + spec.dp_size}
            raise NoEndpoints(f"{where} is not eligible: {detail}", reason=first.value if first else None, **named,
                              **dp_range)
        affinity_ranks = tuple(k for k in ranks if target.matches(k)) if target is not None else ()
        return Candidates(ranks, pin, target, affinity_ranks)

    def _raise_empty(self, all_keys: tuple[WorkerKey, ...]) -> None:
        if not all_keys:
            raise NoEndpoints("no workers are registered", reason="no_workers")
        reasons = [(k, self.check(k)) for k in all_keys]
        shown = ", ".join(f"{w}/{r}: {why.value}" for (w, r), why in reasons[:8] if why is not None)
        more = f" (+{len(reasons) - 8} more)" if len(reasons) > 8 else ""
        if any(why is Ineligible.WORKER_OVERLOADED for _, why in reasons):
            overloaded = tuple(k for k, why in reasons if why is Ineligible.WORKER_OVERLOADED)
            raise AllEligibleWorkersOverloaded(f"every eligible rank is over a busy threshold: {shown}{more}",
                                               ranks=overloaded)
        raise NoEndpoints(f"no eligible worker rank: {shown}{more}", reason="no_eligible_rank")
