"""The report of ``kvemu run``: summary.json, requests.jsonl, report.md and plots, from plain data.

The plots are drawn by ``harness.report.plots``; this module imports neither matplotlib nor numpy until a report
is written.

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
import math
import numbers
import os
import re
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import msgspec

from kvemu.autoscale.records import AutoscaleLog
from kvemu.errors import KvemuError
from kvemu.records import RequestRecord, sequences_as_lists

from harness.report.autoscale import autoscale_markdown, autoscale_summary, provisioned_seconds
from harness.report.plots import PLOTS, start_plots, write_plots
from harness.report.sla import Sla, goodput
from harness.report.stats import percentile

__all__ = [
    "Sample",
    "RunData",
    "LATENCY_METRICS",
    "WALL_CLOCK_KEYS",
    "STATS",
    "PLOTS",
    "summarize",
    "dumps_summary",
    "save_report",
    "write_report",
    "prepare_outdir",
    "OutputError",
    "write_requests",
    "render_markdown",
    "write_plots",
]

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


class Sample(msgspec.Struct, frozen=True):
    """One periodic sample of the router's view of one rank."""

    time_ns: int
    worker_id: int
    dp_rank: int
    active_requests: int
    kv_blocks: int
    """The router's indexed blocks of the rank (a decode rank's: its router's active blocks, see ``pools.samples``)."""
    pool: str = "aggregated"
    """The rank's pool: ``aggregated``, ``prefill`` or ``decode``."""


class RunData(msgspec.Struct, kw_only=True):
    """Everything a report is made of (plain data; built by the runner from the recorder and samplers)."""

    records: list[RequestRecord] = []
    """Per-request records, sorted by arrival (re-sorted by arrival then id where order matters)."""
    scenario_name: str = "scenario"
    mode: str = "virtual"
    seed: int = 0
    wall_time_ns: int = 0
    partial: bool = False
    """The run was interrupted (Ctrl-C, drain timeout...): the numbers cover only what finished."""
    stop_reason: str | None = None
    """Why a partial run stopped early (``SIGINT``, ``SIGTERM``, ``drain_timeout``, ``error: ...``)."""
    block_size: int = 16
    ranks: list[tuple[int, int]] = []
    """Every (worker_id, dp_rank) of the cluster, so ranks that served nothing still show."""
    samples: list[Sample] = []
    kv_stats: dict[int, dict[str, int]] = {}
    """Per worker KV-event counters (batches, events, blocks_stored, gaps, lost_batches...)."""
    affinity: dict[str, int] | None = None
    counters: dict[str, int] = {}
    """Hook counts by kind (``queued``, ``dispatch_rejected``...)."""
    failures: dict[str, int] = {}
    """Failed requests by reason."""
    worker_events: list[dict[str, Any]] = []
    pools: dict[str, dict[str, int]] = {}
    """The cluster's pools as started, ``pool -> {"workers", "dp_size", "kv_blocks"}`` (``kv_blocks``: a rank's
    KV capacity, optional): ``aggregated``, or ``prefill`` and ``decode``."""
    sla: Sla | None = None
    """The run's latency targets (``run.sla``): the summary adds goodput, requests.jsonl ``met_sla``."""
    concurrency: int | None = None
    """Closed-loop replay: the sessions in flight at most (``workload.concurrency``); None: open loop."""
    autoscale: AutoscaleLog | None = None
    """An autoscaled run's decisions and worker counts over time (None without an autoscaler)."""


# ---------------------------------------------------------------------------------- statistics


def _stats(values: Any, scale: float = 1.0) -> dict[str, float | None]:
    """mean/min/max/median/p75/p90/p95/p99/std of ``values`` divided by ``scale`` (None when empty).

    numpy (a matplotlib dependency) does the arithmetic: float64, pairwise sums, deterministic for a given
    input; the percentiles use ``harness.report.stats.percentile`` on the sorted array.
    """
    import numpy as np

    s = np.sort(np.asarray(values, dtype=np.float64))
    if s.size == 0:
        return dict.fromkeys(STATS)
    out = {
        "mean": float(s.mean()),
        "min": float(s[0]),
        "max": float(s[-1]),
        "median": percentile(s, 50),
        "p75": percentile(s, 75),
        "p90": percentile(s, 90),
        "p95": percentile(s, 95),
        "p99": percentile(s, 99),
        "std": float(s.std()),
    }
    return {k: v / scale for k, v in out.items()}


def _round(value: Any) -> Any:
    """Round floats to ``SIGNIFICANT_DIGITS`` (recursively); NaN/inf become None; keys become strings."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
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


def _sorted_records(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    return sorted(records, key=lambda r: (r.arrival_ns, r.request_id))


def _all_ranks(data: RunData) -> list[tuple[int, int]]:
    ranks = {(int(w), int(r)) for w, r in data.ranks}
    ranks.update((r.worker_id, r.dp_rank or 0) for r in data.records if r.worker_id is not None)
    ranks.update((s.worker_id, s.dp_rank) for s in data.samples)
    return sorted(ranks)


# ---------------------------------------------------------------------------------- summary


def _pooled_gaps(series: list[list[int]]) -> Any:
    """Every gap between consecutive values of each list, pooled (a numpy int64 array)."""
    import numpy as np

    series = [s for s in series if len(s) >= 2]
    if not series:
        return np.zeros(0, dtype=np.int64)
    total = sum(len(s) for s in series)
    flat = np.fromiter(chain.from_iterable(series), dtype=np.int64, count=total)
    gaps = np.diff(flat)
    ends = np.cumsum([len(s) for s in series])[:-1] - 1  # the gap from one list's end to the next's start
    return np.delete(gaps, ends)


def _latency_values(done: list[RequestRecord]) -> dict[str, Any]:
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


def _prediction_truth(data: RunData, records: list[RequestRecord], done: list[RequestRecord]) -> dict[str, Any]:
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
        engine = rec.engine_cached_tokens or 0
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
    return {
        "requests_compared": len(diffs),
        "predicted_cached_tokens": predicted_total,
        "engine_cached_tokens": engine_total,
        "engine_to_predicted_ratio": _ratio(engine_total, predicted_total),
        "mean_abs_diff_tokens": _mean(diffs),
        "overestimated_requests": over,
        "underestimated_requests": under,
        "selection_overlap_blocks": selection,
        "best_overlap_blocks": best,
        "selection_to_best_ratio": _ratio(selection, best),
    }


def _decode_truth(done: list[RequestRecord]) -> dict[str, Any]:
    """A decode pool has no prefix to predict: each decode leg receives its prompt's KV from the prefill rank by
    transfer (its engine computes none of it) and the decode router places it by active blocks only."""
    moved = [r for r in done if r.kv_activated_ns is not None]
    return {"kv_source": "transfer", "requests_received_kv": len(moved),
            "transferred_prompt_tokens": sum(r.isl for r in moved)}


def _routing(data: RunData, records: list[RequestRecord], done: list[RequestRecord]) -> dict[str, Any]:
    truth = _prediction_truth(data, records, done)
    reasons = Counter(r.routing_reason for r in records if r.routing_reason is not None)
    routed = [r for r in records if r.attempts > 0]
    out = {
        **truth,
        "reasons": dict(sorted(reasons.items())),
        "routed_requests": len(routed),
        "mean_attempts": _mean([r.attempts for r in routed]),
        "max_attempts": max((r.attempts for r in routed), default=0),
        "retried_requests": sum(r.attempts > 1 for r in routed),
        "dispatch_rejections": int(data.counters.get("dispatch_rejected", 0)),
    }
    if "prefill" in data.pools:  # the figures above are the prefill pool's; each pool's own truth
        out["pools"] = {"prefill": truth, "decode": _decode_truth(done)}
    return out


def _per_rank(data: RunData, records: list[RequestRecord]) -> list[dict[str, Any]]:
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for key in _all_ranks(data):
        rows[key] = {"worker_id": key[0], "dp_rank": key[1], "requests": 0, "completed_requests": 0,
                     "failed_requests": 0, "input_tokens": 0, "output_tokens": 0, "_cached": 0, "_isl_done": 0}
    for rec in records:
        if rec.worker_id is None:
            continue
        row = rows[(rec.worker_id, rec.dp_rank or 0)]
        row["requests"] += 1
        row["input_tokens"] += rec.isl
        row["output_tokens"] += len(rec.token_times_ns)
        if rec.done:
            row["completed_requests"] += 1
            row["_cached"] += rec.engine_cached_tokens or 0
            row["_isl_done"] += rec.isl
        elif rec.failure is not None:
            row["failed_requests"] += 1
    active: dict[tuple[int, int], list[int]] = defaultdict(list)
    blocks: dict[tuple[int, int], list[int]] = defaultdict(list)
    for s in data.samples:
        active[(s.worker_id, s.dp_rank)].append(s.active_requests)
        blocks[(s.worker_id, s.dp_rank)].append(s.kv_blocks)
    out = []
    for key, row in rows.items():
        row["prefix_cache_reused_ratio"] = _ratio(row.pop("_cached"), row.pop("_isl_done"))
        a, b = active.get(key, []), blocks.get(key, [])
        row["mean_active_requests"] = _mean(a)
        row["max_active_requests"] = max(a) if a else None
        row["mean_kv_blocks"] = _mean(b)
        row["max_kv_blocks"] = max(b) if b else None
        out.append(row)
    return out


def _queue(data: RunData, records: list[RequestRecord]) -> dict[str, Any]:
    queued = [r for r in records if r.queued_ns is not None]
    waits = sorted(r.dispatch_ns - r.queued_ns for r in queued
                   if r.dispatch_ns is not None and r.queued_ns is not None and r.dispatch_ns >= r.queued_ns)
    return {
        "queued_requests": len(queued),
        "queued_events": int(data.counters.get("queued", 0)),
        "dispatched_after_queue": len(waits),
        "mean_queue_wait_ms": mean / NS_PER_MS if (mean := _mean(waits)) is not None else None,
        "p99_queue_wait_ms": percentile(waits, 99) / NS_PER_MS if waits else None,
        "max_queue_wait_ms": waits[-1] / NS_PER_MS if waits else None,
    }


def _kv_events(data: RunData) -> dict[str, Any]:
    per_worker = []
    totals: Counter[str] = Counter(dict.fromkeys(KV_COUNTERS, 0))
    for worker_id in sorted(data.kv_stats):
        counters = {k: int(v) for k, v in sorted(data.kv_stats[worker_id].items())}
        totals.update(counters)
        per_worker.append({"worker_id": int(worker_id), **counters})
    return {"per_worker": per_worker, "totals": dict(sorted(totals.items()))}


def summarize(data: RunData) -> dict[str, Any]:
    """The content of summary.json: the reference's replay keys at top level, kvemu's own under ``kvemu``."""
    records = _sorted_records(data.records)
    done = [r for r in records if r.done]
    total_in = sum(r.isl for r in done)
    total_out = sum(len(r.token_times_ns) for r in done)
    cached = sum(r.engine_cached_tokens or 0 for r in done)
    reused = sum((r.engine_cached_tokens or 0) if r.engine_reused_tokens is None else r.engine_reused_tokens
                 for r in done)
    # a done record has a completion_ns (RequestRecord.done), which mypy cannot narrow through the property
    duration_ns = (max(r.completion_ns for r in done) - min(r.arrival_ns for r in records)  # type: ignore[type-var,operator]
                   if done else None)
    duration_s = duration_ns / NS_PER_S if duration_ns else None

    def rate(x: int) -> float | None:
        return x / duration_s if duration_s else None

    summary: dict[str, Any] = {
        "num_requests": len(records),
        "completed_requests": len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "duration_ms": duration_ns / NS_PER_MS if duration_ns is not None else None,
        "wall_time_ms": data.wall_time_ns / NS_PER_MS,
        "request_throughput_rps": rate(len(done)),
        "input_throughput_tok_s": rate(total_in),
        "output_throughput_tok_s": rate(total_out),
        "total_throughput_tok_s": rate(total_in + total_out),
        "prefix_cache_reused_ratio": _ratio(reused, total_in),
        "first_admission_prefix_cache_reused_ratio": _ratio(cached, total_in),
        "partial": bool(data.partial),
        **_worker_seconds(data.pools, duration_s),
    }
    if data.sla is not None:
        summary.update(goodput(data.sla, done, duration_s))
    if data.autoscale is not None and duration_ns:  # the workers changed: count the GPU time each pool held
        start = min(r.arrival_ns for r in records)
        summary.update(_worker_seconds(data.pools, duration_s, {
            pool: provisioned_seconds(data.autoscale.series, pool, start, start + duration_ns) for pool in data.pools}))
    for name, values in _latency_values(done).items():
        per_user = name == "output_token_throughput_per_user"
        stats = _stats(values, 1.0 if per_user else NS_PER_MS)
        for stat, value in stats.items():
            summary[f"{stat}_{name}" if per_user else f"{stat}_{name}_ms"] = value
    failed = [r for r in records if r.failure is not None]
    by_reason = Counter({str(k): int(v) for k, v in data.failures.items()})
    if not by_reason:  # a hand-built RunData without the recorder's counters: derive them
        by_reason = Counter(r.failure.split(":")[0] for r in failed if r.failure)
    summary["kvemu"] = {
        "scenario": data.scenario_name,
        "mode": data.mode,
        "seed": data.seed,
        "partial": bool(data.partial),
        "stop_reason": data.stop_reason,
        "block_size": data.block_size,
        "failed_requests": len(failed),
        "unfinished_requests": len(records) - len(done) - len(failed),
        "failed_requests_by_reason": dict(sorted(by_reason.items())),
        "concurrency": data.concurrency,
        "per_rank": _per_rank(data, records),
        "routing": _routing(data, records, done),
        "affinity": dict(sorted(data.affinity.items())) if data.affinity is not None else None,
        "queue": _queue(data, records),
        "kv_events": _kv_events(data),
        "hook_counts": dict(sorted((str(k), int(v)) for k, v in data.counters.items())),
        "worker_events": dict(sorted(Counter(str(e.get("kind")) for e in data.worker_events).items())),
    }
    if data.sla is not None:
        summary["kvemu"]["sla"] = {**msgspec.structs.asdict(data.sla),
                                   "met_ratio": _ratio(summary["goodput_completed_requests"], len(records))}
    if "prefill" in data.pools:
        summary["kvemu"]["disaggregated"] = _disaggregated(data, done)
    tiers = _cache_tiers(done)
    if tiers is not None:
        summary["kvemu"]["cache_tiers"] = tiers
    if data.autoscale is not None:
        summary["kvemu"]["autoscaler"] = autoscale_summary(data.autoscale)
    exits = {str(e["worker_id"]): str(e["reason"])[len(EXITED) + 2:-1] for e in data.worker_events
             if e.get("kind") == "worker_removed" and str(e.get("reason", "")).startswith(EXITED)}
    if exits:  # worker processes its supervisor saw exit (kvemu up, serve), and how
        summary["kvemu"]["worker_exits"] = dict(sorted(exits.items(), key=lambda kv: int(kv[0])))
    return _round(summary)


EXITED = "process_exited"
"""The reason of a worker the router fenced because its supervisor saw its process exit: ``process_exited (how)``."""


def _cache_tiers(done: list[RequestRecord]) -> dict[str, Any] | None:
    """Host offload: first-admission cached tokens per tier (GPU = g1, host), or None without a host tier."""
    with_host = [r for r in done if r.engine_host_cached_tokens is not None]
    if not with_host:
        return None
    host = sum(r.engine_host_cached_tokens or 0 for r in with_host)
    cached = sum(r.engine_cached_tokens or 0 for r in with_host)
    total_in = sum(r.isl for r in with_host)
    return {"requests": len(with_host), "g1_cached_tokens": cached - host, "host_cached_tokens": host,
            "requests_with_host_hits": sum(1 for r in with_host if r.engine_host_cached_tokens),
            "g1_cached_ratio": _ratio(cached - host, total_in), "host_cached_ratio": _ratio(host, total_in)}


def _worker_seconds(pools: dict[str, dict[str, int]], duration_s: float | None,
                    held: dict[str, float] | None = None) -> dict[str, Any]:
    """The reference's cost keys: each pool's workers x the run's duration (or the worker-seconds ``held`` says
    it held, with an autoscaler: starting and draining workers count), its GPUs per worker (DP ranks; one GPU a
    rank), and GPU hours. An aggregated cluster counts as a decode pool with no prefill pool."""
    prefill = pools.get("prefill", {"workers": 0, "dp_size": 0})
    decode_pool = "decode" if "decode" in pools else "aggregated"
    decode = pools.get(decode_pool) or {"workers": 0, "dp_size": 0}
    d = duration_s or 0.0
    out = {"prefill_worker_seconds": prefill["workers"] * d, "decode_worker_seconds": decode["workers"] * d,
           "prefill_gpus_per_worker": prefill["dp_size"], "decode_gpus_per_worker": decode["dp_size"]}
    if held is not None:
        out["prefill_worker_seconds"] = held.get("prefill", 0.0)
        out["decode_worker_seconds"] = held.get(decode_pool, 0.0)
    out["gpu_hours"] = (out["prefill_worker_seconds"] * prefill["dp_size"]
                        + out["decode_worker_seconds"] * decode["dp_size"]) / 3600
    return out


def _disaggregated(data: RunData, done: list[RequestRecord]) -> dict[str, Any]:
    """Per pool: its size and the requests each of its ranks served; per request: the KV transfer (reserved to
    activated on the decode rank) and the wait between the prefill's end and the decode rank's reservation."""
    transfer = [r.kv_activated_ns - r.kv_reserved_ns for r in done
                if r.kv_activated_ns is not None and r.kv_reserved_ns is not None]
    wait = [r.kv_reserved_ns - r.prefill_done_ns for r in done
            if r.kv_reserved_ns is not None and r.prefill_done_ns is not None]
    prefill_ranks = Counter(f"{r.prefill_worker_id}/{r.prefill_dp_rank}" for r in done)
    decode_ranks = Counter(f"{r.worker_id}/{r.dp_rank}" for r in done)
    return {
        "pools": {pool: dict(spec) for pool, spec in sorted(data.pools.items())},
        "requests_per_prefill_rank": dict(sorted(prefill_ranks.items())),
        "requests_per_decode_rank": dict(sorted(decode_ranks.items())),
        "kv_transfer_ms": _stats(transfer, NS_PER_MS),
        "decode_reservation_wait_ms": _stats(wait, NS_PER_MS),
    }


def dumps_summary(summary: dict[str, Any]) -> str:
    """summary.json text: sorted keys, 2-space indent, strict JSON (no NaN), trailing newline."""
    return json.dumps(summary, sort_keys=True, indent=2, allow_nan=False) + "\n"


# ---------------------------------------------------------------------------------- requests.jsonl


class _SlaRow(RequestRecord, kw_only=True, gc=False, repr_omit_defaults=True):
    """A requests.jsonl row of a run with an SLA: the record, then whether it met the SLA."""

    met_sla: bool = False


def write_requests(records: Iterable[RequestRecord], path: Path, sla: Sla | None = None) -> int:
    """Write one msgspec-encoded record per line (field order of ``RequestRecord``, then ``met_sla`` when the
    run has an SLA), by arrival then id."""
    ordered: list[RequestRecord] = _sorted_records(records)
    if sla is not None:
        ordered = [_SlaRow(**msgspec.structs.asdict(r), met_sla=sla.met(r)) for r in ordered]
    path.write_bytes(msgspec.json.Encoder(enc_hook=sequences_as_lists).encode_lines(ordered))
    return len(ordered)


# ---------------------------------------------------------------------------------- report.md


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}{unit}"
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.01:
            return f"{value:.3g}{unit}"
        return f"{value:,.2f}{unit}" if abs(value) < 1e6 else f"{value:,.0f}{unit}"
    return f"{value}{unit}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _cell(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _goodput_rows(s: dict[str, Any], sla: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Headline rows for goodput next to throughput (none without an SLA)."""
    if sla is None:
        return []
    targets = ", ".join(f"{name.removesuffix('_ms').upper()} ≤ {_fmt(sla[name], ' ms')}"
                        for name in ("ttft_ms", "itl_ms", "e2e_ms") if sla.get(name) is not None)
    return [("SLA", targets),
            ("requests meeting the SLA", f"{_fmt(s['goodput_completed_requests'])} ({_pct(sla['met_ratio'])})"),
            ("goodput", _fmt(s["goodput_request_throughput_rps"], " req/s")),
            ("goodput output throughput", _fmt(s["goodput_output_throughput_tok_s"], " tok/s"))]


def render_markdown(summary: dict[str, Any], data: RunData, plots: Sequence[str] = PLOTS) -> str:
    """report.md: what ran, the headline numbers, per-rank, routing truth, affinity, queue, KV events."""
    k = summary["kvemu"]
    s = summary
    out: list[str] = [f"# kvemu run: {k['scenario']}", ""]
    if k["partial"]:
        why = f" ({k['stop_reason']})" if k.get("stop_reason") else ""
        out += [f"> **PARTIAL RUN — this report covers only what finished before the run was interrupted{why}.**",
                "> Requests still in flight are counted as unfinished; throughputs and latencies are incomplete.",
                ""]
    ranks = k["per_rank"]
    workers = sorted({r["worker_id"] for r in ranks})
    out += ["## What ran", "",
            f"- scenario `{k['scenario']}`, mode `{k['mode']}`, seed {k['seed']}",
            f"- {len(workers)} workers, {len(ranks)} ranks, router block size {k['block_size']}",
            f"- scenario time {_fmt(s['duration_ms'], ' ms')} (first arrival → last completion), "
            f"wall time {_fmt(s['wall_time_ms'], ' ms')}",
            ""]
    out += ["## Headline", ""]
    out += _table(["metric", "value"], [
        ("requests", _fmt(s["num_requests"])),
        ("completed", _fmt(s["completed_requests"])),
        ("failed", _fmt(k["failed_requests"])),
        ("unfinished", _fmt(k["unfinished_requests"])),
        ("request throughput", _fmt(s["request_throughput_rps"], " req/s")),
        *_goodput_rows(s, k.get("sla")),
        ("output throughput", _fmt(s["output_throughput_tok_s"], " tok/s")),
        ("total throughput", _fmt(s["total_throughput_tok_s"], " tok/s")),
        ("prefix cache reuse (engine)", _pct(s["prefix_cache_reused_ratio"])),
    ])
    out += [""]
    if k.get("concurrency") is not None:
        out += [f"Closed loop: at most {k['concurrency']} sessions in flight, each next one starting when one "
                "ended (arrival times are when they were sent).", ""]
    out += _table(["latency (ms)", "mean", "p50", "p90", "p99", "max"], [
        (label, *(_fmt(s[f"{stat}_{name}_ms"]) for stat in ("mean", "median", "p90", "p99", "max")))
        for label, name in (("TTFT", "ttft"), ("TTST", "ttst"), ("TPOT", "tpot"), ("ITL", "itl"),
                            ("E2E", "e2e_latency"))
    ])
    out += ["", f"Per-user output speed: mean {_fmt(s['mean_output_token_throughput_per_user'], ' tok/s')}, "
                f"p50 {_fmt(s['median_output_token_throughput_per_user'], ' tok/s')}.", ""]
    out += ["## Per rank", ""]
    out += _table(["worker", "rank", "requests", "completed", "failed", "input tok", "output tok", "cache reuse",
                   "mean active", "max active", "max KV blocks"],
                  [(r["worker_id"], r["dp_rank"], _fmt(r["requests"]), _fmt(r["completed_requests"]),
                    _fmt(r["failed_requests"]), _fmt(r["input_tokens"]), _fmt(r["output_tokens"]),
                    _pct(r["prefix_cache_reused_ratio"]), _fmt(r["mean_active_requests"]),
                    _fmt(r["max_active_requests"]), _fmt(r["max_kv_blocks"])) for r in ranks])
    idle = [f"{r['worker_id']}/{r['dp_rank']}" for r in ranks if r["requests"] == 0]
    dis = k.get("disaggregated")
    if idle and dis is None:
        out += ["", f"Ranks that served no request: {', '.join(idle)}."]
    if dis is not None:
        pools = ", ".join(f"{p['workers']} {name} workers × {p['dp_size']} DP ranks" for name, p in dis["pools"].items())
        out += ["", "## Disaggregated serving", "", f"Pools: {pools}. The per-rank table counts decode ranks; "
                f"prefill ranks served {_fmt(sum(dis['requests_per_prefill_rank'].values()))} prompts "
                f"({', '.join(f'{r}: {n}' for r, n in dis['requests_per_prefill_rank'].items())}).", ""]
        out += _table(["per request (ms)", "mean", "p50", "p99", "max"], [
            (label, *(_fmt(dis[key][stat]) for stat in ("mean", "median", "p99", "max")))
            for label, key in (("KV transfer (reserved → received)", "kv_transfer_ms"),
                               ("wait for decode room (prefill end → reserved)", "decode_reservation_wait_ms"))])
        out += ["", "KV blocks per rank: a prefill rank's are the blocks its router indexed from its KV events; a "
                    "decode rank publishes none (its KV arrives by transfer), so its are the decode router's active "
                    "blocks (booked prompts and outputs)."]
        out += ["", f"Cost: prefill {_fmt(s['prefill_worker_seconds'], ' worker-s')}, decode "
                    f"{_fmt(s['decode_worker_seconds'], ' worker-s')}, {_fmt(s['gpu_hours'])} GPU hours."]
    tiers = k.get("cache_tiers")
    if tiers is not None:
        out += ["", "## Cache hits per tier", "",
                "Prompt tokens each request found cached at its first admission, on the GPU (g1) or loaded from "
                "the engine's host tier.", ""]
        out += _table(["tier", "cached tokens", "of input tokens"], [
            ("GPU (g1)", _fmt(tiers["g1_cached_tokens"]), _pct(tiers["g1_cached_ratio"])),
            ("host", _fmt(tiers["host_cached_tokens"]), _pct(tiers["host_cached_ratio"]))])
        out += ["", f"{_fmt(tiers['requests_with_host_hits'])} of {_fmt(tiers['requests'])} requests loaded blocks "
                    "from the host."]
    rt = k["routing"]
    out += ["", "## Routing truth: predicted vs engine-found cache", "",
            "The router predicts a cached prefix from its (possibly stale) view of KV events; the engine reports "
            "the prefix it actually found at admission, so the gap measures how wrong the router's view was.", ""]
    if "pools" in rt:
        dec = rt["pools"]["decode"]
        out += ["Disaggregated: the prediction figures are the **prefill pool's** (the prefill router's predicted "
                "prefix against what the prefill engine found). The **decode pool** predicts no prefix: each decode "
                f"leg receives its prompt's KV by transfer ({_fmt(dec['requests_received_kv'])} requests, "
                f"{_fmt(dec['transferred_prompt_tokens'])} prompt tokens) and the decode router places it by its "
                "ranks' active blocks (the per-rank KV blocks of decode ranks; routing reasons and attempts below "
                "are the decode legs').", ""]
    out += _table(["figure", "value"], [
        ("requests compared (completed, routed)", _fmt(rt["requests_compared"])),
        ("predicted cached tokens", _fmt(rt["predicted_cached_tokens"])),
        ("engine cached tokens", _fmt(rt["engine_cached_tokens"])),
        ("engine / predicted", _pct(rt["engine_to_predicted_ratio"])),
        ("mean absolute difference per request", _fmt(rt["mean_abs_diff_tokens"], " tok")),
        ("requests where the router overestimated", _fmt(rt["overestimated_requests"])),
        ("requests where the router underestimated", _fmt(rt["underestimated_requests"])),
        ("overlap of chosen rank / best overlap (blocks)",
         f"{_fmt(rt['selection_overlap_blocks'])} / {_fmt(rt['best_overlap_blocks'])} "
         f"({_pct(rt['selection_to_best_ratio'])})"),
        ("mean attempts", _fmt(rt["mean_attempts"])),
        ("retried requests", _fmt(rt["retried_requests"])),
        ("dispatch rejections", _fmt(rt["dispatch_rejections"])),
    ])
    if rt["reasons"]:
        out += ["", "Routing reasons: " + ", ".join(f"`{r}` {n}" for r, n in rt["reasons"].items()) + "."]
    out += ["", "## Session affinity", ""]
    if k["affinity"] is None:
        out += ["Affinity was off."]
    else:
        out += _table(["counter", "value"], [(name, _fmt(v)) for name, v in k["affinity"].items()])
    q = k["queue"]
    out += ["", "## Policy queue", ""]
    if not q["queued_requests"] and not q["queued_events"]:
        out += ["No request was queued."]
    else:
        out += [f"{_fmt(q['queued_requests'])} requests queued ({_fmt(q['queued_events'])} queue events); wait "
                f"before dispatch: mean {_fmt(q['mean_queue_wait_ms'], ' ms')}, "
                f"p99 {_fmt(q['p99_queue_wait_ms'], ' ms')}, max {_fmt(q['max_queue_wait_ms'], ' ms')}."]
    kv = k["kv_events"]
    out += ["", "## KV events", ""]
    if not kv["per_worker"]:
        out += ["No KV-event counters were recorded."]
    else:
        cols = list(KV_COUNTERS) + sorted({c for w in kv["per_worker"] for c in w} - set(KV_COUNTERS) - {"worker_id"})
        out += _table(["worker", *cols], [(w["worker_id"], *(_fmt(w.get(c, 0)) for c in cols))
                                         for w in kv["per_worker"]]
                      + [("**total**", *(_fmt(kv["totals"].get(c, 0)) for c in cols))])
    out += ["", "## Failures", ""]
    if not k["failed_requests_by_reason"]:
        out += ["No request failed."]
    else:
        out += _table(["reason", "requests"], list(k["failed_requests_by_reason"].items()))
    if "autoscaler" in k:
        out += autoscale_markdown(k["autoscaler"], _fmt, _table)
    if data.worker_events:
        out += ["", "## Worker events", ""]
        shown = sorted(data.worker_events, key=lambda e: (e.get("time_ns") or 0, str(e.get("kind"))))
        out += _table(["time (s)", "event", "worker", "why"],
                      [(f"{(e.get('time_ns') or 0) / NS_PER_S:.3f}", e.get("kind"), e.get("worker_id"),
                        e.get("reason") or "") for e in shown[:50]])
        if len(shown) > 50:
            out += ["", f"… and {len(shown) - 50} more."]
    if plots:
        out += ["", "## Plots", ""]
        out += [f"- [{name}]({name})" for name in plots]
        out += [""] + [f"![{name.removesuffix('.png')}]({name})" for name in plots]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------- all of it


class OutputError(KvemuError, OSError):
    """The report directory cannot be created or written."""


def prepare_outdir(outdir: str | Path) -> Path:
    """Create the report directory and prove it writable now, so a bad path fails before the run, not after it."""
    outdir = Path(outdir)
    what = "cannot be created"
    try:
        outdir.mkdir(parents=True, exist_ok=True)
        what = "is not writable"
        probe = outdir / f".kvemu-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except FileExistsError:
        raise OutputError(f"report directory {outdir}: a file of that name exists") from None
    except NotADirectoryError:
        raise OutputError(f"report directory {outdir}: part of the path is a file, not a directory") from None
    except OSError as exc:
        raise OutputError(f"report directory {outdir} {what}: {exc.strerror or exc}") from None
    return outdir


def write_report(data: RunData, outdir: Path) -> dict[str, Any]:
    """Write summary.json, requests.jsonl, report.md and the plots into ``outdir``; return the summary. A run's
    results are never lost to a directory that became unwritable meanwhile: see ``save_report``."""
    return save_report(data, outdir)[0]


def save_report(data: RunData, outdir: Path) -> tuple[dict[str, Any], Path | None]:
    """``write_report``, and where the report went: ``outdir``; or, when that cannot be written (removed, made
    read-only or replaced by a file while the run went), a new directory under the system's temporary directory,
    named on stderr in one line; or None when that fails too, and the summary is printed on stderr instead."""
    summary = summarize(data)
    outdir = Path(outdir)
    try:
        _write_files(data, summary, outdir)
        return summary, outdir
    except OSError as exc:
        why = _why_unwritable(exc)
    try:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", data.scenario_name)[:60] or "run"
        fallback = Path(tempfile.mkdtemp(prefix=f"kvemu-report-{name}-"))
        _write_files(data, summary, fallback)
    except OSError as exc:
        print(f"kvemu: cannot write the report in {outdir} ({why}) nor in a temporary directory "
              f"({_why_unwritable(exc)}); its summary follows", file=sys.stderr, flush=True)
        print(dumps_summary(summary), file=sys.stderr, end="", flush=True)
        return summary, None
    print(f"kvemu: cannot write the report in {outdir} ({why}); wrote it to {fallback} instead", file=sys.stderr,
          flush=True)
    return summary, fallback


def _write_files(data: RunData, summary: dict[str, Any], outdir: Path) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    finish_plots = start_plots(data, outdir)  # drawn meanwhile by a background renderer, if there is one
    try:
        (outdir / "summary.json").write_text(dumps_summary(summary))
        write_requests(data.records, outdir / "requests.jsonl", data.sla)
    finally:
        plots = finish_plots()  # the renderer is done with this job either way
    (outdir / "report.md").write_text(render_markdown(summary, data, plots))


def _why_unwritable(exc: OSError) -> str:
    if isinstance(exc, (FileExistsError, NotADirectoryError)):
        return "part of the path is a file, not a directory"
    return exc.strerror or str(exc)
