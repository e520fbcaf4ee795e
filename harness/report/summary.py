"""summary.json's figures: the statistics of a run, from its ``RunData``.

Everything here is a pure function of a ``RunData`` (records from the hook ``Recorder``, periodic samples
of the router's view, counters); nothing reads an actor. The same ``RunData`` gives byte-identical
``summary.json``, ``requests.jsonl`` and ``report.md`` (and identical plots on the same matplotlib).

Metric definitions (only completed requests, i.e. with a completion time and no failure, enter the
latency statistics):

* ``ttft`` = first token − arrival; ``e2e_latency`` = completion − arrival;
* ``ttst`` = second token − first token (token timestamps), requests with ≥ 2 tokens;
* ``tpot`` = (completion − first token) / (output tokens − 1), requests with ≥ 2 tokens;
* ``itl``  = every gap between consecutive token timestamps, pooled over all requests;
* ``output_token_throughput_per_user`` = (output tokens − 1) / (completion − first token), tok/s,
  requests with ≥ 2 tokens and a positive decode time;
* percentiles are ``harness.report.stats.percentile``: the value at the rounded rank, as Dynamo's replay report
  computes them (no interpolation); ``median`` is p50, ``std`` is the population standard deviation; an
  empty set gives ``null``.

Output tokens are the recorded token timestamps of a request. Floats are rounded to 6 significant
digits; NaN and infinities never appear (they become ``null``).

"""

from __future__ import annotations

import json
from array import array
import math
import numbers
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
from msgspec import UNSET, UnsetType

from kvemu._build import build_name
from kvemu.records import RequestRecord
from workers.config import SpeculativeConfig

from harness.report.autoscale import autoscale_summary, provisioned_seconds
from harness.report.sla import Goodput, goodput
from harness.report.stats import percentile
from harness.report.run_data import EXITED, RunData, Sample
from harness.report.summary_types import (CacheTiers, DecodeTruth, Disaggregated, GroupBlocks, KvEvents,
                                          KvemuSection, LanePhase, LanePhases, Lanes, PredictionTruth, Queue, RankRow,
                                          RecoverableBlocks, Regret, RegretBucket, ReplicaRow, Replicas, Routing,
                                          RoutingPools, SlaSection, Speculative, Stats, Summary)
from harness.workload.lanes import LaneFigures

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000
SIGNIFICANT_DIGITS = 6

WALL_CLOCK_KEYS = ("wall_time_ms",)
"""summary.json's keys measured on the wall clock (top level; ``RunData.wall_time_ns`` is the run's one wall
figure): the only keys two virtual runs of one scenario and seed may differ in."""

LATENCY_METRICS = ("ttft", "ttst", "tpot", "itl", "e2e_latency", "output_token_throughput_per_user")
"""Per-request metrics; all in ms except the per-user throughput (tok/s)."""
STATS = ("mean", "min", "max", "median", "p75", "p90", "p95", "p99", "std")

KV_COUNTERS = ("batches", "events", "blocks_stored", "blocks_removed", "gaps", "replays", "replayed_batches",
               "lost_batches", "decode_errors", "block_size_mismatches", "apply_errors", "restarts")

# ---------------------------------------------------------------------------------- statistics


def _stats(values: npt.ArrayLike, scale: float = 1.0, *, in_place: bool = False) -> dict[str, float | None]:
    """mean/min/max/median/p75/p90/p95/p99/std of ``values`` divided by ``scale`` (None when empty).

    numpy (a matplotlib dependency) does the arithmetic: float64, pairwise sums, deterministic for a given
    input; the percentiles use ``harness.report.stats.percentile`` on the sorted array. ``in_place``: ``values``
    is a float64 array the caller gives up, sorted and then overwritten (the hour's 4.5 M inter-token gaps: no
    copy of them, and no temporary for the deviation).
    """
    import numpy as np

    s = np.asarray(values, dtype=np.float64)
    if s is values and not in_place:
        s = s.copy()
    s.sort()
    if s.size == 0:
        return dict.fromkeys(STATS)
    n = s.size
    total = np.add.reduce(s, keepdims=True)  # ndarray.mean's and .std's arithmetic, step by step
    out = {
        "mean": float(total[0] / n),
        "min": float(s[0]),
        "max": float(s[-1]),
        "median": percentile(s, 50),
        "p75": percentile(s, 75),
        "p90": percentile(s, 90),
        "p95": percentile(s, 95),
        "p99": percentile(s, 99),
    }
    deviation = np.subtract(s, total / n, out=s)  # (s is ours, and its order served the percentiles)
    np.multiply(deviation, deviation, out=deviation)
    out["std"] = float(np.sqrt(np.add.reduce(deviation) / n))
    return {k: v / scale for k, v in out.items()}


def _round(value: Any) -> Any:
    """Round floats to ``SIGNIFICANT_DIGITS`` (recursively, through a summary's sections too); NaN/inf become None;
    keys become strings."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str, UnsetType)):
        return value
    if isinstance(value, msgspec.Struct):
        return msgspec.structs.replace(value, **{f: _round(getattr(value, f)) for f in value.__struct_fields__})
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        r = float(f"{value:.{SIGNIFICANT_DIGITS}g}")
        return 0.0 if r == 0 else r  # no "-0.0"
    if isinstance(value, dict):
        return {str(k): _round(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_round(v) for v in value]
    if isinstance(value, numbers.Integral):  # numpy scalars and the like
        return int(value)
    if isinstance(value, numbers.Real):
        return _round(float(value))
    raise TypeError(f"cannot put {type(value).__name__} in a summary")


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _first_token(rec: RequestRecord) -> int | None:
    if rec.first_token_ns is not None:
        return rec.first_token_ns
    return rec.token_times_ns[0] if rec.token_times_ns else None


def sorted_records(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    """The records by arrival (ties by request id): the order of requests.jsonl and of the statistics."""
    return sorted(records, key=lambda r: (r.arrival_ns, r.request_id))


def _all_ranks(data: RunData) -> list[tuple[int, int]]:
    ranks = {(int(w), int(r)) for w, r in data.ranks}
    ranks.update((r.worker_id, r.dp_rank or 0) for r in data.records if r.worker_id is not None)
    ranks.update((s.worker_id, s.dp_rank) for s in data.samples)
    return sorted(ranks)


# ---------------------------------------------------------------------------------- summary


def _pooled_gaps(series: list[list[int]]) -> npt.NDArray[np.float64]:
    """Every gap between consecutive values of each list, pooled (a numpy float64 array, exact below 2**53).

    Each list's gaps are subtracted straight into their place in one array: the hour's 4.5 M token times were
    concatenated, differenced and then stripped of the gaps between lists, three passes over fresh memory."""
    import numpy as np

    series = [s for s in series if len(s) >= 2]
    out = np.empty(sum(len(s) for s in series) - len(series), dtype=np.float64)
    subtract, frombuffer, asarray, i64 = np.subtract, np.frombuffer, np.asarray, np.int64
    pos = 0
    for s in series:
        # an array('q') is read in place (its buffer), any other list of ints converted whole: never one int a token
        a = frombuffer(s, dtype=i64) if type(s) is array and s.typecode == "q" else asarray(s, dtype=i64)
        end = pos + len(a) - 1
        subtract(a[1:], a[:-1], out=out[pos:end], casting="unsafe")
        pos = end
    return out


def _latency_values(done: list[RequestRecord]) -> dict[str, npt.ArrayLike]:
    ttft: list[int] = []
    ttst: list[int] = []
    tpot: list[float] = []
    e2e: list[int] = []
    per_user: list[float] = []
    for rec in done:
        completion = rec.completion_ns
        assert completion is not None
        e2e.append(completion - rec.arrival_ns)
        first = _first_token(rec)
        if first is not None:
            ttft.append(first - rec.arrival_ns)
        times = rec.token_times_ns
        n = len(times)
        if n >= 2:
            ttst.append(times[1] - times[0])
            if first is not None:
                decode = completion - first
                tpot.append(decode / (n - 1))
                if decode > 0:
                    per_user.append((n - 1) * NS_PER_S / decode)
    itl = _pooled_gaps([rec.token_times_ns for rec in done])
    return {"ttft": ttft, "ttst": ttst, "tpot": tpot, "itl": itl, "e2e_latency": e2e,
            "output_token_throughput_per_user": per_user}


def _prediction_truth(data: RunData, records: list[RequestRecord], done: list[RequestRecord]) -> PredictionTruth:
    """The router's predicted cached prefix against the one the engine found, per completed request, and the
    chosen rank's overlap against the best rank's (a disaggregated cluster's: the prefill leg's)."""
    bs = data.block_size
    predicted_total = engine_total = 0
    diffs: list[int] = []
    over = under = 0
    for rec in done:
        if rec.predicted_overlap_blocks is None:
            continue
        predicted = min(rec.predicted_overlap_blocks * bs, rec.isl)
        engine = rec.engine.cached_tokens or 0
        predicted_total += predicted
        engine_total += engine
        diffs.append(abs(predicted - engine))
        over += predicted > engine
        under += predicted < engine
    selection = best = 0
    for rec in records:
        if rec.predicted_overlap_blocks is not None and rec.best_overlap_blocks is not None:
            selection += rec.predicted_overlap_blocks
            best += rec.best_overlap_blocks
    return PredictionTruth(
        requests_compared=len(diffs),
        predicted_cached_tokens=predicted_total,
        engine_cached_tokens=engine_total,
        engine_to_predicted_ratio=_ratio(engine_total, predicted_total),
        mean_abs_diff_tokens=_mean(diffs),
        overestimated_requests=over,
        underestimated_requests=under,
        selection_overlap_blocks=selection,
        best_overlap_blocks=best,
        selection_to_best_ratio=_ratio(selection, best),
    )


def _decode_truth(done: list[RequestRecord]) -> DecodeTruth:
    """A decode pool has no prefix to predict: each decode leg receives its prompt's KV from the prefill rank by
    transfer (its engine computes none of it) and the decode router places it by active blocks only."""
    moved = [r for r in done if r.kv_activated_ns is not None]
    return DecodeTruth(kv_source="transfer", requests_received_kv=len(moved),
                       transferred_prompt_tokens=sum(r.isl for r in moved))


REGRET_BUCKET_S = 60
"""Width of ``kvemu.routing.regret.over_time``'s buckets (by the routing decision's time)."""


def regret_blocks(rec: RequestRecord, block_size: int) -> tuple[int, int] | None:
    """A routed request's (lost, novel) prompt blocks against the engines' truth at its decision: lost = the best
    eligible rank's cached blocks - the chosen rank's, novel = prompt blocks cached nowhere; None without truth."""
    chosen, best = rec.truth_overlap_blocks, rec.truth_best_overlap_blocks
    if chosen is None or best is None or rec.routed_ns is None:
        return None
    return best - chosen, max(rec.isl // block_size - best, 0)


def _regret(data: RunData, records: list[RequestRecord], t0: int | None = None) -> Regret | None:
    """Routing regret against the engines' truth at each decision (Dynamo's locality-metrics proposal): lost =
    best eligible rank's cached blocks - the chosen rank's, novel = prompt blocks - best; the ratio lost / (novel +
    lost) overall and per minute, and the lost blocks by where they were; ``truth``: ``kv_events`` when the truth is
    the load generator's view from the KV events (``run.event_truth``). None: no truth (separate processes)."""
    bs = data.block_size
    if t0 is None:  # (the report's time zero: the first arrival)
        t0 = min((r.arrival_ns for r in records), default=0)
    lost = novel = with_loss = compared = 0
    by_source: Counter[str] = Counter()
    buckets: dict[int, list[int]] = {}
    for rec in records:
        blocks = regret_blocks(rec, bs)
        if blocks is None or rec.routed_ns is None:
            continue
        compared += 1
        miss, new = blocks
        lost += miss
        novel += new
        if miss > 0:
            with_loss += 1
            by_source[rec.regret_source or "shared"] += miss
        bucket = buckets.setdefault((rec.routed_ns - t0) // (REGRET_BUCKET_S * NS_PER_S), [0, 0])
        bucket[0] += miss
        bucket[1] += new
    if not compared:
        return None
    return Regret(
        requests_compared=compared,
        requests_with_loss=with_loss,
        lost_blocks=lost,
        novel_blocks=novel,
        regret_ratio=_ratio(lost, novel + lost),
        recoverable_prefill_blocks=RecoverableBlocks(peer=by_source.get("peer", 0),
                                                     cache_owner=by_source.get("cache_owner", 0),
                                                     shared=by_source.get("shared", 0)),
        unrecoverable_prefill_blocks=novel,
        over_time=[RegretBucket(t_s=b * REGRET_BUCKET_S, regret_ratio=_ratio(m, m + n), lost_blocks=m)
                   for b, (m, n) in sorted(buckets.items())],
        # (absent: the engines were read at each decision)
        truth=data.truth_source if data.truth_source is not None else UNSET,
    )


def _replicas(data: RunData, records: list[RequestRecord]) -> Replicas:
    """Router replicas: per replica its requests, the reuse its engines found, its routing regret (as
    ``kvemu.routing.regret``, of its decisions alone) and its own counters."""
    rep = data.replicas
    assert rep is not None
    mine: list[list[RequestRecord]] = [[] for _ in range(rep.count)]
    t0 = min((r.arrival_ns for r in records), default=0)  # (every replica's over_time from the cluster's time zero)
    for rec in records:
        i = rep.replica_of.get(rec.request_id)
        if i is not None:
            mine[i].append(rec)
    per = []
    for own, recs in zip(rep.per_replica, mine):
        done = [r for r in recs if r.done]
        regret = _regret(data, recs, t0)
        per.append(ReplicaRow(
            replica=own.replica,
            requests=len(recs),
            completed_requests=len(done),
            failed_requests=sum(r.failure is not None for r in recs),
            prefix_cache_reused_ratio=_ratio(_reused(done), sum(r.isl for r in done)),
            regret_ratio=regret.regret_ratio if regret is not None else None,
            regret=regret,
            restarts=own.restarts,
            kv_events=own.kv_events,
            kv_feed_dropped_batches=own.kv_feed_dropped_batches,
            workers_registered=own.workers_registered,
            affinity=own.affinity if own.affinity is not None else UNSET,
            sync=own.sync if own.sync is not None else UNSET,
        ))
    return Replicas(count=rep.count, front=rep.front, sync=rep.sync, per_replica=per)


def _reused(done: list[RequestRecord]) -> int:
    """The prompt tokens the engines found cached over the requests' lives (their first admission's, without a
    later count)."""
    return sum((r.engine.cached_tokens or 0) if r.engine.reused_tokens is None else r.engine.reused_tokens
               for r in done)


def _routing(data: RunData, records: list[RequestRecord], done: list[RequestRecord]) -> Routing:
    truth = _prediction_truth(data, records, done)
    reasons = Counter(r.routing_reason for r in records if r.routing_reason is not None)
    routed = [r for r in records if r.attempts > 0]
    regret = _regret(data, records)
    if regret is not None and data.truth_feed is not None:  # (the oracle's feed: the cluster's figures only)
        regret.truth_feed = data.truth_feed
    return Routing(
        **msgspec.structs.asdict(truth),
        reasons=dict(sorted(reasons.items())),
        routed_requests=len(routed),
        mean_attempts=_mean([r.attempts for r in routed]),
        max_attempts=max((r.attempts for r in routed), default=0),
        retried_requests=sum(r.attempts > 1 for r in routed),
        dispatch_rejections=int(data.counters.get("dispatch_rejected", 0)),
        regret=regret,
        regret_ratio=regret.regret_ratio if regret is not None else None,
        # the figures above are the prefill pool's; each pool's own truth
        pools=RoutingPools(prefill=truth, decode=_decode_truth(done)) if "prefill" in data.pools else UNSET,
    )


def _series(values: list[int]) -> GroupBlocks:
    """A hybrid KV cache group's blocks over the samples: mean and max."""
    return GroupBlocks(mean=_mean(values), max=max(values))


class SampleSeries(NamedTuple):
    """One rank's samples of one count: their mean (``_mean``'s) and max; None for none."""

    mean: float | None
    max: int | None


NO_SAMPLES = SampleSeries(None, None)

_EXACT_SUM = 1 << 31
"""Below this, int64 sums of up to 2**22 samples are exact, so numpy's total equals ``math.fsum``'s."""


RankSeries = dict[tuple[str, int, int], tuple["npt.NDArray[np.float64]", "npt.NDArray[np.int64]",
                                              "npt.NDArray[np.int64]"]]
"""Per (pool, worker, rank), in that order: its samples' times (s), active requests and KV blocks, by time."""


def rank_series(samples: Sequence[Sample]) -> RankSeries:
    """The samples as ``RankSeries`` (the per-rank figures and the plots both read them): read column by column in
    C and grouped by numpy; a Python loop over the hour's 56,672 samples took ~0.07 s here and 0.23 s (under
    cProfile) in the plots, once per panel."""
    import numpy as np

    n = len(samples)
    if n == 0:
        return {}

    def column(name: str) -> npt.NDArray[np.int64]:
        return np.fromiter(map(attrgetter(name), samples), dtype=np.int64, count=n)

    pools = sorted(set(map(attrgetter("pool"), samples)))
    code = {pool: i for i, pool in enumerate(pools)}
    pool = np.fromiter(map(code.__getitem__, map(attrgetter("pool"), samples)), dtype=np.int64, count=n)
    worker, rank, time_ns = column("worker_id"), column("dp_rank"), column("time_ns")
    order = np.lexsort((time_ns, rank, worker, pool))  # stable: equal times keep the samples' order
    pool, worker, rank = pool[order], worker[order], rank[order]
    times_s = time_ns[order] / NS_PER_S
    active, blocks = column("active_requests")[order], column("kv_blocks")[order]
    new_rank = (pool[1:] != pool[:-1]) | (worker[1:] != worker[:-1]) | (rank[1:] != rank[:-1])
    starts = np.flatnonzero(np.concatenate(([True], new_rank))).tolist()
    return {(pools[int(pool[i])], int(worker[i]), int(rank[i])): (times_s[i:j], active[i:j], blocks[i:j])
            for i, j in zip(starts, [*starts[1:], n])}


def _sample_series(samples: Sequence[Sample]) -> tuple[dict[tuple[int, int], SampleSeries],
                                                       dict[tuple[int, int], SampleSeries]]:
    """Per (worker, rank): its samples' active requests and KV blocks (``SampleSeries``), from ``rank_series``
    (a rank's samples under more than one pool count together)."""
    series = rank_series(samples)
    if len(samples) > 1 << 22 or any(int(col.max()) >= _EXACT_SUM  # (never in practice)
                                     for _, active, blocks in series.values() for col in (active, blocks)):
        return _sample_series_exact(samples)
    totals: dict[tuple[int, int], list[int]] = {}  # count, then per column its sum and max
    for (_, w, r), (_, active, blocks) in series.items():
        t = totals.setdefault((w, r), [0, 0, 0, 0, 0])
        t[0] += len(active)
        for k, col in ((1, active), (3, blocks)):
            t[k] += int(col.sum())
            t[k + 1] = max(t[k + 1], int(col.max()))
    return ({key: SampleSeries(t[1] / t[0], t[2]) for key, t in totals.items()},
            {key: SampleSeries(t[3] / t[0], t[4]) for key, t in totals.items()})


def _sample_series_exact(samples: Sequence[Sample]) -> tuple[dict[tuple[int, int], SampleSeries],
                                                             dict[tuple[int, int], SampleSeries]]:
    """``_sample_series`` in Python ints, for counts too large for numpy's sums to be exact."""
    active: dict[tuple[int, int], list[int]] = defaultdict(list)
    blocks: dict[tuple[int, int], list[int]] = defaultdict(list)
    for s in samples:
        active[(s.worker_id, s.dp_rank)].append(s.active_requests)
        blocks[(s.worker_id, s.dp_rank)].append(s.kv_blocks)
    return ({k: SampleSeries(_mean(v), max(v)) for k, v in active.items()},
            {k: SampleSeries(_mean(v), max(v)) for k, v in blocks.items()})


def _per_rank(data: RunData, records: list[RequestRecord]) -> list[RankRow]:
    ranks = _all_ranks(data)
    mine: dict[tuple[int, int], list[RequestRecord]] = {key: [] for key in ranks}
    for rec in records:
        if rec.worker_id is not None:
            mine[(rec.worker_id, rec.dp_rank or 0)].append(rec)
    active, blocks = _sample_series(data.samples)
    groups: dict[tuple[int, int], dict[int, list[int]]] = {}
    held: dict[tuple[int, int], dict[int, list[int]]] = {}
    for s in data.samples:
        if s.group_blocks is not None:  # hybrid KV cache groups: per group too
            per = groups.setdefault((s.worker_id, s.dp_rank), {})
            for g, n in s.group_blocks.items():
                per.setdefault(g, []).append(n)
        if s.group_held is not None:
            per = held.setdefault((s.worker_id, s.dp_rank), {})
            for g, n in s.group_held.items():
                per.setdefault(g, []).append(n)
    out = []
    for key in ranks:
        recs = mine[key]
        done = [r for r in recs if r.done]
        a, b = active.get(key, NO_SAMPLES), blocks.get(key, NO_SAMPLES)
        out.append(RankRow(
            worker_id=key[0],
            dp_rank=key[1],
            requests=len(recs),
            completed_requests=len(done),
            failed_requests=sum(1 for r in recs if not r.done and r.failure is not None),
            input_tokens=sum(r.isl for r in recs),
            output_tokens=sum(len(r.token_times_ns) for r in recs),
            prefix_cache_reused_ratio=_ratio(sum(r.engine.cached_tokens or 0 for r in done), sum(r.isl for r in done)),
            mean_active_requests=a.mean,
            max_active_requests=a.max,
            mean_kv_blocks=b.mean,
            max_kv_blocks=b.max,
            # hybrid KV cache groups: the router's indexed blocks, and the engine's held ones
            kv_blocks_per_group=({str(g): _series(v) for g, v in groups[key].items()} if key in groups else UNSET),
            held_blocks_per_group=({str(g): _series(v) for g, v in held[key].items()} if key in held else UNSET),
        ))
    return out


def _queue(data: RunData, records: list[RequestRecord]) -> Queue:
    queued = [r for r in records if r.queued_ns is not None]
    waits = sorted(r.dispatch_ns - r.queued_ns for r in queued
                   if r.dispatch_ns is not None and r.queued_ns is not None and r.dispatch_ns >= r.queued_ns)
    return Queue(
        queued_requests=len(queued),
        queued_events=int(data.counters.get("queued", 0)),
        dispatched_after_queue=len(waits),
        mean_queue_wait_ms=mean / NS_PER_MS if (mean := _mean(waits)) is not None else None,
        p99_queue_wait_ms=percentile(waits, 99) / NS_PER_MS if waits else None,
        max_queue_wait_ms=waits[-1] / NS_PER_MS if waits else None,
    )


def _kv_events(data: RunData) -> KvEvents:
    per_worker = []
    totals: Counter[str] = Counter(dict.fromkeys(KV_COUNTERS, 0))
    for worker_id in sorted(data.kv_stats):
        counters = {k: int(v) for k, v in sorted(data.kv_stats[worker_id].items())}
        totals.update(counters)
        per_worker.append({"worker_id": int(worker_id), **counters})
    return KvEvents(per_worker=per_worker, totals=dict(sorted(totals.items())))


def summarize(data: RunData) -> Summary:
    """summary.json's figures: the reference's replay keys at top level, kvemu's own under ``kvemu``. With lanes,
    every figure but ``kvemu.lanes`` is the profile phase's (its requests only). Floats are rounded (``_round``)."""
    records = sorted_records(data.records)
    every = records
    if data.phases is not None:
        phases = data.phases
        records = [r for r in records if phases.get(r.request_id, "profile") == "profile"]
    done = [r for r in records if r.done]
    total_in = sum(r.isl for r in done)
    total_out = sum(len(r.token_times_ns) for r in done)
    cached = sum(r.engine.cached_tokens or 0 for r in done)
    # a done record has a completion_ns (RequestRecord.done), which mypy cannot narrow through the property
    duration_ns = (max(r.completion_ns for r in done) - min(r.arrival_ns for r in records)  # type: ignore[type-var,operator]
                   if done else None)
    duration_s = duration_ns / NS_PER_S if duration_ns else None

    def rate(x: int) -> float | None:
        return x / duration_s if duration_s else None

    held = None
    if data.autoscale is not None and duration_ns:  # the workers changed: count the GPU time each pool held
        start = min(r.arrival_ns for r in records)
        held = {pool: provisioned_seconds(data.autoscale.series, pool, start, start + duration_ns)
                for pool in data.pools}
    cost = _worker_seconds(data.pools, duration_s, held)
    met = goodput(data.sla, done, duration_s) if data.sla is not None else None
    latency: dict[str, float | None] = {}
    for name, values in _latency_values(done).items():
        per_user = name == "output_token_throughput_per_user"
        stats = _stats(values, 1.0 if per_user else NS_PER_MS, in_place=True)
        for stat, value in stats.items():
            latency[f"{stat}_{name}" if per_user else f"{stat}_{name}_ms"] = value
    summary = Summary(
        num_requests=len(records),
        completed_requests=len(done),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        duration_ms=duration_ns / NS_PER_MS if duration_ns is not None else None,
        wall_time_ms=data.wall_time_ns / NS_PER_MS,
        request_throughput_rps=rate(len(done)),
        input_throughput_tok_s=rate(total_in),
        output_throughput_tok_s=rate(total_out),
        total_throughput_tok_s=rate(total_in + total_out),
        prefix_cache_reused_ratio=_ratio(_reused(done), total_in),
        first_admission_prefix_cache_reused_ratio=_ratio(cached, total_in),
        partial=bool(data.partial),
        prefill_worker_seconds=cost.prefill_worker_seconds,
        decode_worker_seconds=cost.decode_worker_seconds,
        prefill_gpus_per_worker=cost.prefill_gpus_per_worker,
        decode_gpus_per_worker=cost.decode_gpus_per_worker,
        gpu_hours=cost.gpu_hours,
        goodput_completed_requests=met.completed_requests if met is not None else UNSET,
        goodput_request_throughput_rps=met.request_throughput_rps if met is not None else UNSET,
        goodput_output_throughput_tok_s=met.output_throughput_tok_s if met is not None else UNSET,
        **latency,
        kvemu=_kvemu(data, records, done, every, met),
    )
    return _round(summary)


def _kvemu(data: RunData, records: list[RequestRecord], done: list[RequestRecord], every: list[RequestRecord],
           met: Goodput | None) -> KvemuSection:
    """summary.json's ``kvemu``: kvemu's own figures (``every``: the lanes' requests of every phase)."""
    failed = [r for r in records if r.failure is not None]
    by_reason = Counter({str(k): int(v) for k, v in data.failures.items()})
    if not by_reason:  # a hand-built RunData without the recorder's counters: derive them
        by_reason = Counter(r.failure.split(":")[0] for r in failed if r.failure)
    exits = {str(e.worker_id): e.reason[len(EXITED) + 2:-1] for e in data.worker_events
             if e.kind == "worker_removed" and e.reason is not None and e.reason.startswith(EXITED)}
    return KvemuSection(
        scenario=data.scenario_name,
        build=build_name(),  # "compiled" or "pure": the only key besides wall time the two builds differ in
        mode=data.mode,
        seed=data.seed,
        partial=bool(data.partial),
        stop_reason=data.stop_reason,
        block_size=data.block_size,
        failed_requests=len(failed),
        unfinished_requests=len(records) - len(done) - len(failed),
        failed_requests_by_reason=dict(sorted(by_reason.items())),
        concurrency=data.concurrency,
        per_rank=_per_rank(data, records),
        routing=_routing(data, records, done),
        affinity=dict(sorted(data.affinity.items())) if data.affinity is not None else None,
        queue=_queue(data, records),
        kv_events=_kv_events(data),
        hook_counts=dict(sorted((str(k), int(v)) for k, v in data.counters.items())),
        worker_events=dict(sorted(Counter(e.kind for e in data.worker_events).items())),
        sla=(SlaSection(ttft_ms=data.sla.ttft_ms, itl_ms=data.sla.itl_ms, e2e_ms=data.sla.e2e_ms,
                        met_ratio=_ratio(met.completed_requests, len(records)))
             if data.sla is not None and met is not None else UNSET),
        disaggregated=_disaggregated(data, done) if "prefill" in data.pools else UNSET,
        cache_tiers=_cache_tiers(done),
        autoscaler=autoscale_summary(data.autoscale) if data.autoscale is not None else UNSET,
        speculative=_speculative(data.speculative, done) if data.speculative is not None else UNSET,
        replicas=_replicas(data, records) if data.replicas is not None else UNSET,
        lanes=_lanes(data.lanes, data.phases or {}, every) if data.lanes is not None else UNSET,
        # worker processes their supervisor saw exit (kvemu up, serve), and how
        worker_exits=dict(sorted(exits.items(), key=lambda kv: int(kv[0]))) if exits else UNSET,
    )


def _lanes(lanes: LaneFigures, phases: dict[str, str], records: list[RequestRecord]) -> Lanes:
    """The lane player's figures, and per phase its requests (sent, completed, failed) and span (first arrival to
    last end, ms; what the player timed when it sent nothing)."""

    def phase_of(phase: str) -> LanePhase:
        mine = [r for r in records if phases.get(r.request_id, "profile") == phase]
        ends = [r.completion_ns for r in mine if r.completion_ns is not None]
        timed = lanes.phase_times_ms.get(phase)
        start = min(r.arrival_ns for r in mine) / NS_PER_MS if mine else (timed[0] if timed else None)
        end = max(ends) / NS_PER_MS if ends else (timed[1] if timed else None)
        return LanePhase(requests=len(mine), completed_requests=sum(1 for r in mine if r.done),
                         failed_requests=sum(1 for r in mine if r.failure is not None), start_ms=start, end_ms=end,
                         duration_ms=end - start if start is not None and end is not None else None)

    return Lanes(
        corpus_cursor=lanes.corpus_cursor, corpus_plays=lanes.corpus_plays, duration_s=lanes.duration_s,
        failed_preparation=lanes.failed_preparation, grace_s=lanes.grace_s,
        idle_shifts_global=lanes.idle_shifts_global, idle_shifts_tree=lanes.idle_shifts_tree, lanes=lanes.lanes,
        plays_completed=lanes.plays_completed, plays_cut=lanes.plays_cut, plays_started=lanes.plays_started,
        requests_cancelled=lanes.requests_cancelled, requests_issued=lanes.requests_issued,
        requests_never_issued=lanes.requests_never_issued, snapshot_seed=lanes.snapshot_seed,
        unsettled_server_requests=lanes.unsettled_server_requests, warmup=lanes.warmup,
        phases=LanePhases(primer=phase_of("primer"), warmup=phase_of("warmup"), profile=phase_of("profile")),
    )


def _speculative(settings: SpeculativeConfig, done: list[RequestRecord]) -> Speculative:
    """What speculative decoding did, from the token times: a decode pass's tokens share its end, so a request's
    passes after its first token are its distinct later timestamps; ``itl_per_pass_ms`` pools the gaps between
    them (what a streaming client sees between chunks; ``itl`` counts a burst's zero gaps, as Dynamo's replay)."""
    import numpy as np

    tokens = passes = 0
    gaps = []
    for rec in done:
        times = rec.token_times_ns
        if len(times) < 2:
            continue
        d = np.diff(np.asarray(times, dtype=np.int64))
        chunk = d[d > 0]
        tokens += len(times) - 1
        passes += len(chunk)
        gaps.append(chunk)
    pooled = np.concatenate(gaps) if gaps else np.zeros(0, dtype=np.int64)
    return Speculative(
        method=settings.method,
        num_speculative_tokens=settings.num_speculative_tokens,
        conditional_acceptance_rates=list(settings.conditional_rates),
        draft_cost=settings.draft_cost,
        expected_tokens_per_decode_pass=settings.mean_tokens_per_pass,
        decode_tokens=tokens,
        decode_passes=passes,
        tokens_per_decode_pass=_ratio(tokens, passes),
        itl_per_pass_ms=Stats(**_stats(pooled, NS_PER_MS)),
    )


def _cache_tiers(done: list[RequestRecord]) -> CacheTiers | UnsetType:
    """Host offload: first-admission cached tokens per tier (GPU = g1, host); absent without a host tier."""
    with_host = [r for r in done if r.engine.host_cached_tokens is not None]
    if not with_host:
        return UNSET
    host = sum(r.engine.host_cached_tokens or 0 for r in with_host)
    cached = sum(r.engine.cached_tokens or 0 for r in with_host)
    total_in = sum(r.isl for r in with_host)
    return CacheTiers(requests=len(with_host), g1_cached_tokens=cached - host, host_cached_tokens=host,
                      requests_with_host_hits=sum(1 for r in with_host if r.engine.host_cached_tokens),
                      g1_cached_ratio=_ratio(cached - host, total_in), host_cached_ratio=_ratio(host, total_in))


class _WorkerSeconds(NamedTuple):
    """The reference's cost keys (summary.json's top level)."""

    prefill_worker_seconds: float
    decode_worker_seconds: float
    prefill_gpus_per_worker: int
    decode_gpus_per_worker: int
    gpu_hours: float


def _worker_seconds(pools: dict[str, dict[str, int]], duration_s: float | None,
                    held: dict[str, float] | None = None) -> _WorkerSeconds:
    """The reference's cost keys: each pool's workers x the run's duration (or the worker-seconds ``held`` says
    it held, with an autoscaler: starting and draining workers count), its GPUs per worker (DP ranks; one GPU a
    rank), and GPU hours. An aggregated cluster counts as a decode pool with no prefill pool."""
    prefill = pools.get("prefill", {"workers": 0, "dp_size": 0})
    decode_pool = "decode" if "decode" in pools else "aggregated"
    decode = pools.get(decode_pool) or {"workers": 0, "dp_size": 0}
    d = duration_s or 0.0
    prefill_s, decode_s = prefill["workers"] * d, decode["workers"] * d
    if held is not None:
        prefill_s, decode_s = held.get("prefill", 0.0), held.get(decode_pool, 0.0)
    return _WorkerSeconds(prefill_s, decode_s, prefill["dp_size"], decode["dp_size"],
                          (prefill_s * prefill["dp_size"] + decode_s * decode["dp_size"]) / 3600)


def _disaggregated(data: RunData, done: list[RequestRecord]) -> Disaggregated:
    """Per pool: its size and the requests each of its ranks served; per request: the KV transfer (reserved to
    activated on the decode rank) and the wait between the prefill's end and the decode rank's reservation."""
    transfer = [r.kv_activated_ns - r.kv_reserved_ns for r in done
                if r.kv_activated_ns is not None and r.kv_reserved_ns is not None]
    wait = [r.kv_reserved_ns - r.prefill_done_ns for r in done
            if r.kv_reserved_ns is not None and r.prefill_done_ns is not None]
    prefill_ranks = Counter(f"{r.prefill_worker_id}/{r.prefill_dp_rank}" for r in done)
    decode_ranks = Counter(f"{r.worker_id}/{r.dp_rank}" for r in done)
    return Disaggregated(
        pools={pool: dict(spec) for pool, spec in sorted(data.pools.items())},
        requests_per_prefill_rank=dict(sorted(prefill_ranks.items())),
        requests_per_decode_rank=dict(sorted(decode_ranks.items())),
        kv_transfer_ms=Stats(**_stats(transfer, NS_PER_MS)),
        decode_reservation_wait_ms=Stats(**_stats(wait, NS_PER_MS)),
    )


def dumps_summary(summary: Summary) -> str:
    """summary.json text: sorted keys, 2-space indent, strict JSON (no NaN), trailing newline."""
    return json.dumps(summary.to_builtins(), sort_keys=True, indent=2, allow_nan=False) + "\n"
