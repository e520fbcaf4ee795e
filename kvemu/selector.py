"""Worker selection: Dynamo's cost ("logit") per candidate rank and the default picker.

``evaluate`` computes the cost of every candidate in one pass (the only place the formula lives);
``DefaultWorkerSelector`` picks the argmin (uniform among exact ties) or samples the normalised
softmax when the temperature is above zero. Nothing here books load: that is the caller's step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

from kvemu.config import RouterConfig
from kvemu.eligibility import Candidates
from kvemu.errors import NoEndpoints
from kvemu.index import WorkerKey
from kvemu.load import LoadTracker

__all__ = [
    "TierHits",
    "Evaluation",
    "Selection",
    "evaluate",
    "taint_factors",
    "pick_argmin",
    "pick_softmax",
    "selection_at",
    "DefaultWorkerSelector",
]


class TierHits(NamedTuple):
    """Lower-tier extension hits per rank, in blocks beyond the device prefix (all optional)."""

    host: Mapping[WorkerKey, int] | None = None
    disk: Mapping[WorkerKey, int] | None = None
    shared: Mapping[WorkerKey, int] | None = None


class Evaluation(NamedTuple):
    """Per-candidate costs aligned with ``ranks``; the other columns only when evaluated with ``detail``."""

    ranks: tuple[WorkerKey, ...]
    costs: list[float]
    isl: int
    required_blocks: int
    overlap_blocks: list[int] | None = None
    effective_overlap_blocks: list[float] | None = None
    cached_tokens: list[int] | None = None
    active_prefill_tokens: list[int] | None = None
    potential_decode_blocks: list[float] | None = None
    active_requests: list[int] | None = None
    inputs: dict[str, Any] | None = None
    """The keyword arguments it was computed from (to evaluate single rows in detail)."""

    def with_detail(self) -> Evaluation:
        """This evaluation with every column filled (recomputed now, from the same inputs)."""
        if self.overlap_blocks is not None or self.inputs is None:
            return self
        return evaluate(self.ranks, **self.inputs, detail=True)

    def row(self, i: int) -> Evaluation:
        """A one-rank evaluation of row ``i`` with every column (recomputed now, same inputs)."""
        if self.overlap_blocks is not None or self.inputs is None:
            return self if len(self.ranks) == 1 else _slice(self, i)
        return evaluate((self.ranks[i],), **self.inputs, detail=True)


_T = TypeVar("_T")


def _at(column: list[_T] | None, i: int) -> list[_T]:
    # row() slices only evaluations with their detail columns; a missing one raises TypeError, as indexing None did
    return [column[i]]  # type: ignore[index]


def _slice(ev: Evaluation, i: int) -> Evaluation:
    return Evaluation((ev.ranks[i],), [ev.costs[i]], ev.isl, ev.required_blocks, _at(ev.overlap_blocks, i),
                      _at(ev.effective_overlap_blocks, i), _at(ev.cached_tokens, i), _at(ev.active_prefill_tokens, i),
                      _at(ev.potential_decode_blocks, i), _at(ev.active_requests, i))


class Selection(NamedTuple):
    """The chosen rank and what the host needs to book it and to explain the decision."""

    worker_id: int
    dp_rank: int
    cost: float
    overlap_blocks: int
    effective_overlap_blocks: float
    cached_tokens: int
    required_blocks: int
    prefill_tokens: int
    """Effective prefill tokens to book: ``isl - min(cached_tokens, isl)``."""
    potential_decode_blocks: float
    reason: str
    """``pinned``, ``affinity``, ``cost`` (argmin), ``softmax`` or ``policy``."""
    evaluation: Evaluation

    @property
    def key(self) -> WorkerKey:
        """``(worker_id, dp_rank)``."""
        return (self.worker_id, self.dp_rank)


def evaluate(
    ranks: Sequence[WorkerKey],
    *,
    isl: int,
    block_size: int,
    overlaps: Mapping[WorkerKey, int],
    seq_hashes: Sequence[int],
    load: LoadTracker,
    config: RouterConfig,
    tiers: TierHits | None = None,
    taint_factor: Mapping[WorkerKey, float] | None = None,
    decode_pool: bool = False,
    p_min: int | None = None,
    active: Mapping[WorkerKey, int] | None = None,
    detail: bool = True,
) -> Evaluation:
    """Cost of every candidate rank (lower is better), by the formula of Dynamo's default selector.

    This is the only place the formula lives. ``detail=False`` (the router's hot path) fills only the
    costs; ``Evaluation.row`` recomputes one rank's full detail from the same inputs.
    """
    ranks = tuple(ranks)
    bs = block_size
    required = -(-isl // bs)
    track_prefill = config.router_track_prefill_tokens
    credit = config.overlap_score_credit
    decay = config.overlap_score_credit_decay
    scale = config.prefill_load_scale
    req_weight = config.decode_active_request_weight
    hw, dw, sm = config.host_cache_hit_weight, config.disk_cache_hit_weight, config.shared_cache_multiplier
    track_blocks = config.router_track_active_blocks
    n_blocks = len(seq_hashes) if track_blocks else 0
    loads = load.ranks()
    if active is None:
        active = load.active_prefixes(seq_hashes) if n_blocks and config.router_assume_kv_reuse else {}
    host = disk = shared = None
    if tiers is not None:
        host, disk, shared = tiers.host or None, tiers.disk or None, tiers.shared or None
    use_tiers = host is not None or disk is not None or shared is not None
    use_decay = track_prefill and decay > 0
    if use_decay and p_min is None:
        p_min = min((loads[k].active_prefill_tokens if k in loads else 0) for k in ranks)
    decode_special = decode_pool and not track_prefill and credit > 0

    costs: list[float] = []
    append = costs.append
    if detail:
        ovl: list[int] = []
        eff: list[float] = []
        cached_l: list[int] = []
        pre: list[int] = []
        dec: list[float] = []
        reqs: list[int] = []
    for key in ranks:
        d = overlaps.get(key, 0)
        rl = loads.get(key)
        if rl is None:
            p = nreq = 0
            decode_blocks: float | int = float(n_blocks)  # an int below (mypyc: a boxed value)
        else:
            p = rl.active_prefill_tokens
            nreq = rl.active_requests
            decode_blocks = n_blocks - active.get(key, 0)
            if track_blocks:
                decode_blocks += rl.distinct_blocks + rl.output_blocks
        ocredit = credit * d
        if use_decay and p > p_min:  # type: ignore[operator]
            ocredit /= 1.0 + decay * ((p - p_min) / bs) / max(1, required)  # type: ignore[operator]
        e: float | int = d
        if use_tiers:
            h = host.get(key, 0) if host is not None else 0
            k = disk.get(key, 0) if disk is not None else 0
            e = d + hw * h + dw * k
            ocredit += hw * h + dw * k + (sm * shared.get(key, 0) if shared is not None else 0)
        cached = max(0, round(e * bs)) if use_tiers else d * bs
        if not track_prefill:
            raw = 0
        elif rl is None:
            raw = isl
        else:
            raw = p + (isl - cached if cached < isl else 0) + cached
        if decode_special:
            cost = decode_blocks - ocredit
            if cost < 0:
                cost = 0.0
        else:
            adjusted = raw / bs - ocredit
            cost = scale * adjusted + decode_blocks if adjusted > 0 else decode_blocks
        if nreq and req_weight:
            cost += req_weight * nreq
        if taint_factor is not None:
            cost *= taint_factor.get(key, 1.0)
        append(cost)
        if detail:
            ovl.append(d)
            eff.append(float(e))
            cached_l.append(cached)
            pre.append(p)
            dec.append(decode_blocks)
            reqs.append(nreq)
    inputs = dict(isl=isl, block_size=bs, overlaps=overlaps, seq_hashes=seq_hashes, load=load, config=config,
                  tiers=tiers, taint_factor=taint_factor, decode_pool=decode_pool, p_min=p_min, active=active)
    if not detail:
        return Evaluation(ranks, costs, isl, required, inputs=inputs)
    return Evaluation(ranks, costs, isl, required, ovl, eff, cached_l, pre, dec, reqs, inputs)


def taint_factors(
    ranks: Sequence[WorkerKey], preferred: Mapping[str, float], taints_of: Mapping[int, frozenset[str]]
) -> dict[WorkerKey, float]:
    """Cost multipliers ``exp(-tanh(sum of the worker's preferred-taint weights))`` per rank."""
    out: dict[WorkerKey, float] = {}
    for key in ranks:
        taints = taints_of.get(key[0], frozenset())
        total = sum(w for t, w in preferred.items() if t in taints)
        out[key] = math.exp(-math.tanh(total))
    return out


def pick_argmin(costs: Sequence[float], rng: random.Random) -> int:
    """Index of the lowest cost; exact ties are broken uniformly at random (one draw, only on a tie)."""
    best = min(costs)
    first = costs.index(best)
    ties = [i for i in range(first, len(costs)) if costs[i] == best]
    if len(ties) == 1:
        return first
    return ties[rng.randrange(len(ties))]


def pick_softmax(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Sample an index with weight ``exp(-(c - c_min) / ((c_max - c_min) * T))``; uniform if all equal."""
    lo, hi = min(costs), max(costs)
    if lo == hi:
        return rng.randrange(len(costs))
    span = hi - lo
    values = list(costs)
    if not math.isfinite(span):
        norm = max(abs(lo), abs(hi))
        values = [c / norm for c in values]
        lo, span = lo / norm, hi / norm - lo / norm
    weights = [math.exp(-(c - lo) / (span * temperature)) for c in values]
    total = sum(weights)
    u = rng.random()
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w / total
        if acc >= u:
            return i
    return len(weights) - 1


class DefaultWorkerSelector:
    """Dynamo's default selector: pin or eligible affinity target first, else argmin / softmax of cost."""

    name = "kv"

    def select(
        self,
        candidates: Candidates,
        evaluation: Evaluation,
        config: RouterConfig,
        rng: random.Random,
    ) -> Selection:
        """Pick one rank of ``evaluation`` (which must cover ``candidates.for_default_selector()``)."""
        ranks = evaluation.ranks
        if not ranks:
            raise NoEndpoints("no candidate ranks to select from", reason="no_candidates")
        costs = evaluation.costs
        hot = config.router_temperature > 0
        if len(ranks) == 1:
            i = 0
        else:
            i = pick_softmax(costs, config.router_temperature, rng) if hot else pick_argmin(costs, rng)
        if candidates.pinned is not None:
            reason = "pinned"
        elif candidates.affinity_ranks:
            reason = "affinity"
        else:
            reason = "softmax" if hot else "cost"
        return selection_at(evaluation, i, reason)


def selection_at(ev: Evaluation, i: int, reason: str) -> Selection:
    """The ``Selection`` for row ``i`` of an evaluation (its detail is computed now)."""
    row = ev.row(i)
    wid, rank = row.ranks[0]
    cached = row.cached_tokens[0]  # type: ignore[index]
    isl = ev.isl
    return Selection(
        wid,
        rank,
        ev.costs[i],
        row.overlap_blocks[0],  # type: ignore[index]
        row.effective_overlap_blocks[0],  # type: ignore[index]
        cached,
        ev.required_blocks,
        isl - min(cached, isl),
        row.potential_decode_blocks[0],  # type: ignore[index]
        reason,
        ev,
    )
