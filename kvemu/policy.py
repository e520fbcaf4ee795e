"""Custom selection policies: filters → scorers → picker, run after kvemu's own eligibility.

A policy sees one ``WorkerRow`` per eligible rank (cache, load and the default cost) and the request's
``PolicyContext``, whose affinity target is advisory: a custom policy may follow it or ignore it.
Only the default selector treats an eligible affinity target as exclusive. Booking stays with the host.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, overload

from kvemu.eligibility import AffinityTarget, Candidates
from kvemu.errors import InvalidArgument, NoEndpoints
from kvemu.index import WorkerKey
from kvemu.selector import Evaluation, Selection, pick_argmin, selection_at

__all__ = [
    "WorkerRow",
    "PolicyContext",
    "WorkerFilter",
    "WorkerScorer",
    "WorkerPicker",
    "SelectionPolicy",
    "CustomPolicy",
    "default_cost",
    "overlap_scorer",
    "argmin_picker",
    "RoundRobinPicker",
    "RandomPicker",
    "round_robin_policy",
    "random_policy",
]


class WorkerRow(NamedTuple):
    """What a policy knows about one eligible rank."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    effective_overlap_blocks: float
    cached_tokens: int
    active_prefill_tokens: int
    potential_decode_blocks: float
    active_requests: int
    default_cost: float

    @property
    def key(self) -> WorkerKey:
        """``(worker_id, dp_rank)``."""
        return (self.worker_id, self.dp_rank)


class PolicyContext(NamedTuple):
    """Request context handed to every filter, scorer and picker."""

    isl: int
    block_size: int
    request_id: str | None = None
    session_id: str | None = None
    affinity_target: AffinityTarget | None = None
    """Advisory: the session's bound target if it is eligible; the policy may ignore it."""
    pinned: AffinityTarget | None = None


class WorkerFilter(Protocol):
    """Keep (True) or reject (False) a rank."""

    def __call__(self, ctx: PolicyContext, row: WorkerRow) -> bool: ...


class WorkerScorer(Protocol):
    """A finite cost for a rank; the costs of all scorers are summed. Lower is better."""

    def __call__(self, ctx: PolicyContext, row: WorkerRow) -> float: ...


class WorkerPicker(Protocol):
    """Return the index of the chosen row."""

    def __call__(self, ctx: PolicyContext, rows: Sequence[WorkerRow], costs: Sequence[float], rng: random.Random) -> int: ...


class SelectionPolicy(Protocol):
    """Anything the router can select with (the default selector or a ``CustomPolicy``)."""

    name: str


def default_cost(ctx: PolicyContext, row: WorkerRow) -> float:
    """Scorer: Dynamo's default cost (cache credit against prefill and decode load)."""
    return row.default_cost


def overlap_scorer(ctx: PolicyContext, row: WorkerRow) -> float:
    """Scorer: prefer the deepest cached prefix, ignoring load."""
    return -float(row.overlap_blocks)


def argmin_picker(ctx: PolicyContext, rows: Sequence[WorkerRow], costs: Sequence[float], rng: random.Random) -> int:
    """Picker: lowest total cost, uniform among exact ties."""
    return pick_argmin(costs, rng)


class RoundRobinPicker:
    """Picker: cycle through the ranks in order, ignoring costs (a cursor the picker owns)."""

    def __init__(self) -> None:
        self._next = 0

    def __call__(self, ctx: PolicyContext, rows: Sequence[WorkerRow], costs: Sequence[float], rng: random.Random) -> int:
        i = self._next % len(rows)
        self._next = i + 1
        return i


class RandomPicker:
    """Picker: uniformly random rank from the router's seeded generator."""

    def __call__(self, ctx: PolicyContext, rows: Sequence[WorkerRow], costs: Sequence[float], rng: random.Random) -> int:
        return rng.randrange(len(rows))


class CustomPolicy:
    """A selection pipeline: every filter in order, then the summed scorers, then the picker."""

    def __init__(
        self,
        name: str,
        *,
        filters: Sequence[WorkerFilter] = (),
        scorers: Sequence[WorkerScorer] = (default_cost,),
        picker: WorkerPicker | Callable[..., int] = argmin_picker,
    ) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker

    def select(self, ctx: PolicyContext, candidates: Candidates, evaluation: Evaluation, rng: random.Random) -> Selection:
        """Run the pipeline over the evaluated candidates; raises ``NoEndpoints`` if filters reject all."""
        if not self.filters and not self.scorers:  # a picker alone (round robin, random): rows only if it reads them
            lazy = _LazyRows(evaluation)
            choice = self._checked(self.picker(ctx, lazy, [0] * len(lazy), rng), len(lazy))
            return selection_at(evaluation, choice, "policy")
        ev = evaluation.with_detail()
        rows = _rows(ev)
        index = list(range(len(rows)))
        for f in self.filters:
            index = [i for i in index if f(ctx, rows[i])]
        if not index:
            raise NoEndpoints(f"policy {self.name!r}: its filters rejected all {len(rows)} eligible ranks",
                              reason="filtered")
        kept = [rows[i] for i in index]
        costs = [sum(s(ctx, r) for s in self.scorers) for r in kept]
        choice = self._checked(self.picker(ctx, kept, costs, rng), len(kept))
        return selection_at(ev, index[choice], "policy")

    def _checked(self, choice: object, n: int) -> int:
        """The picker's answer, if it is a row index below ``n``."""
        if not isinstance(choice, int) or not 0 <= choice < n:
            raise InvalidArgument(f"policy {self.name!r}: picker returned {choice!r}, not a row index < {n}")
        return choice


def _rows(ev: Evaluation) -> list[WorkerRow]:
    """One ``WorkerRow`` per rank of an evaluation with its detail columns."""
    # evaluate() always records its inputs, so with_detail() fills every column: none is None here
    return [
        WorkerRow(
            k[0],
            k[1],
            ev.overlap_blocks[i],  # type: ignore[index]
            ev.effective_overlap_blocks[i],  # type: ignore[index]
            ev.cached_tokens[i],  # type: ignore[index]
            ev.active_prefill_tokens[i],  # type: ignore[index]
            ev.potential_decode_blocks[i],  # type: ignore[index]
            ev.active_requests[i],  # type: ignore[index]
            ev.costs[i],
        )
        for i, k in enumerate(ev.ranks)
    ]


class _LazyRows(Sequence[WorkerRow]):
    """The rows a lone picker is handed: its length is known at once, the rows are built on first access
    (a round-robin or random pick reads none, so it costs no detail evaluation)."""

    def __init__(self, evaluation: Evaluation) -> None:
        self._evaluation = evaluation
        self._rows: list[WorkerRow] | None = None

    def __len__(self) -> int:
        return len(self._evaluation.ranks)

    @overload
    def __getitem__(self, i: int) -> WorkerRow: ...
    @overload
    def __getitem__(self, i: slice) -> list[WorkerRow]: ...
    def __getitem__(self, i: int | slice) -> WorkerRow | list[WorkerRow]:
        if self._rows is None:
            self._rows = _rows(self._evaluation.with_detail())
        return self._rows[i]


def round_robin_policy() -> CustomPolicy:
    """Cycle through eligible ranks regardless of cache or load (the replay baseline)."""
    return CustomPolicy("round_robin", scorers=(), picker=RoundRobinPicker())


def random_policy() -> CustomPolicy:
    """Uniformly random eligible rank."""
    return CustomPolicy("random", scorers=(), picker=RandomPicker())
