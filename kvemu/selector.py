"""Worker selection: Dynamo's cost ("logit") per candidate rank and the default picker.

``evaluate`` computes the cost of every candidate in one pass (the only place the formula lives);
``DefaultWorkerSelector`` picks the argmin (uniform among exact ties) or samples the normalised
softmax when the temperature is above zero. Nothing here books load: that is the caller's step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kvemu.config import RouterConfig
from kvemu.eligibility import Candidates
from kvemu.errors import NoEndpoints
from kvemu.index import WorkerKey
from kvemu.load import LoadTracker, active_prefix_len

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
    """Per-candidate inputs and costs, aligned with ``ranks``."""

    ranks: tuple[WorkerKey, ...]
    costs: list[float]
    overlap_blocks: list[int]
    effective_overlap_blocks: list[float]
    cached_tokens: list[int]
    active_prefill_tokens: list[int]
    potential_decode_blocks: list[float]
    active_requests: list[int]
    isl: int
    required_blocks: int


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
) -> Evaluation:
    """Cost of every candidate rank (lower is better), by the formula of Dynamo's default selector."""
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
    reuse = config.router_assume_kv_reuse
    n_blocks = len(seq_hashes) if track_blocks else 0
    loads = load.ranks()
    host = disk = shared = None
    if tiers is not None:
        host, disk, shared = tiers.host or None, tiers.disk or None, tiers.shared or None
    p_min = 0
    use_decay = track_prefill and decay > 0
    if use_decay:
        p_min = min((loads[k].active_prefill_tokens if k in loads else 0) for k in ranks)
    decode_special = decode_pool and not track_prefill and credit > 0

    costs: list[float] = []
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
            p = 0
            active_dec = 0.0
            additional = n_blocks
            nreq = 0
        else:
            p = rl.active_prefill_tokens
            active_dec = rl.active_decode_blocks if track_blocks else 0.0
            additional = n_blocks - (active_prefix_len(rl.block_refs, seq_hashes) if reuse and n_blocks else 0)
            nreq = rl.active_requests
        e = float(d)
        ocredit = credit * d
        if use_decay and p > p_min:
            ocredit /= 1.0 + decay * ((p - p_min) / bs) / max(1, required)
        if host is not None or disk is not None or shared is not None:
            h = host.get(key, 0) if host is not None else 0
            k = disk.get(key, 0) if disk is not None else 0
            s = shared.get(key, 0) if shared is not None else 0
            e += hw * h + dw * k
            ocredit += hw * h + dw * k + sm * s
        cached = max(0, round(e * bs))
        if not track_prefill:
            raw = 0
        elif rl is None:
            raw = isl
        else:
            raw = p + (isl - min(cached, isl)) + cached
        decode_blocks = active_dec + additional
        if decode_special:
            cost = max(0.0, decode_blocks - ocredit)
        else:
            adjusted = raw / bs - ocredit
            cost = (scale * adjusted if adjusted > 0 else 0.0) + decode_blocks
        if nreq and req_weight:
            cost += req_weight * nreq
        if taint_factor is not None:
            cost *= taint_factor.get(key, 1.0)
        costs.append(cost)
        ovl.append(d)
        eff.append(e)
        cached_l.append(cached)
        pre.append(p)
        dec.append(decode_blocks)
        reqs.append(nreq)
    return Evaluation(ranks, costs, ovl, eff, cached_l, pre, dec, reqs, isl, required)


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
    """Index of the lowest cost; exact ties are broken uniformly at random (reservoir sampling)."""
    best = math.inf
    choice = 0
    ties = 0
    for i, c in enumerate(costs):
        if c < best:
            best, choice, ties = c, i, 1
        elif c == best:
            ties += 1
            if rng.randrange(ties) == 0:
                choice = i
    return choice


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
            raise NoEndpoints("no candidate ranks to select from")
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
    """The ``Selection`` for row ``i`` of an evaluation."""
    wid, rank = ev.ranks[i]
    cached = ev.cached_tokens[i]
    isl = ev.isl
    return Selection(
        wid,
        rank,
        ev.costs[i],
        ev.overlap_blocks[i],
        ev.effective_overlap_blocks[i],
        cached,
        ev.required_blocks,
        isl - min(cached, isl),
        ev.potential_decode_blocks[i],
        reason,
        ev,
    )
