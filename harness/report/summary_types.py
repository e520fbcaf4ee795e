"""summary.json's shape: ``Summary`` and its sections as msgspec structs, read by attribute.

Fields are declared in the order ``harness.report.summary.summarize`` has always emitted its keys. A field whose
key is left out of summary.json when it does not apply (an SLA's goodput, a disaggregated cluster's section...)
defaults to ``UNSET`` (absent); a field that is always there but may have no value is ``X | None`` (null). A
section whose keys are data (reasons, ranks, hook kinds, worker ids) stays a ``dict``. ``Num`` is a figure copied
from the scenario (``int`` or ``float`` as it was given), so that it is written as it was.
"""

from __future__ import annotations

import warnings
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from kvemu.autoscale.records import ConfigValue

__all__ = ["Num", "Stats", "RankRow", "GroupBlocks", "PredictionTruth", "DecodeTruth",
           "RoutingPools", "RecoverableBlocks", "RegretBucket", "Regret", "Routing", "Queue", "KvEvents",
           "SlaSection", "Disaggregated", "CacheTiers", "OutcomeCounts", "AutoscaleDecision", "Autoscaler",
           "Speculative", "ReplicaSync", "ReplicaRow", "Replicas", "LanePhase", "LanePhases", "Lanes",
           "KvemuSection", "Summary"]

Num = int | float
"""A figure copied from the scenario, written as it was given."""


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A part of summary.json (unknown keys refused: a figure is never dropped on its way into a section)."""


class Stats(_Section, kw_only=True):
    """mean/min/max/median/p75/p90/p95/p99/std of a set of values (each None when the set is empty)."""

    mean: float | None
    min: float | None
    max: float | None
    median: float | None
    p75: float | None
    p90: float | None
    p95: float | None
    p99: float | None
    std: float | None


class GroupBlocks(_Section, kw_only=True):
    """A hybrid KV cache group's blocks on a rank over the run's samples."""

    mean: float | None
    max: int


class RankRow(_Section, kw_only=True):
    """``kvemu.per_rank[]``: one (worker, DP rank)'s requests, tokens, reuse and sampled load."""

    worker_id: int
    dp_rank: int
    requests: int
    completed_requests: int
    failed_requests: int
    input_tokens: int
    output_tokens: int
    prefix_cache_reused_ratio: float | None
    mean_active_requests: float | None
    max_active_requests: int | None
    mean_kv_blocks: float | None
    max_kv_blocks: int | None
    kv_blocks_per_group: dict[str, GroupBlocks] | UnsetType = UNSET
    held_blocks_per_group: dict[str, GroupBlocks] | UnsetType = UNSET


class PredictionTruth(_Section, kw_only=True):
    """The router's predicted cached prefix against the one the engine found, and the chosen rank's overlap
    against the best rank's."""

    requests_compared: int
    predicted_cached_tokens: int
    engine_cached_tokens: int
    engine_to_predicted_ratio: float | None
    mean_abs_diff_tokens: float | None
    overestimated_requests: int
    underestimated_requests: int
    selection_overlap_blocks: int
    best_overlap_blocks: int
    selection_to_best_ratio: float | None


class DecodeTruth(_Section, kw_only=True):
    """A decode pool's truth: its KV came by transfer."""

    kv_source: str
    requests_received_kv: int
    transferred_prompt_tokens: int


class RoutingPools(_Section, kw_only=True):
    """``kvemu.routing.pools`` of a disaggregated cluster: each pool's own truth."""

    prefill: PredictionTruth
    decode: DecodeTruth


class RecoverableBlocks(_Section, kw_only=True):
    """Lost prompt blocks by where they were cached."""

    peer: int
    cache_owner: int
    shared: int


class RegretBucket(_Section, kw_only=True):
    """One minute of routing regret (by the decision's time since the first arrival)."""

    t_s: int
    regret_ratio: float | None
    lost_blocks: int


class Regret(_Section, kw_only=True):
    """Routing regret against the engines' truth at each decision."""

    requests_compared: int
    requests_with_loss: int
    lost_blocks: int
    novel_blocks: int
    regret_ratio: float | None
    recoverable_prefill_blocks: RecoverableBlocks
    unrecoverable_prefill_blocks: int
    over_time: list[RegretBucket]
    truth: str | UnsetType = UNSET
    """``kv_events`` when the truth was the load generator's view from the KV events; absent: the engines'."""
    truth_feed: dict[str, int] | UnsetType = UNSET
    """The oracle's own KV feed counters (with ``truth``)."""


class Routing(PredictionTruth, kw_only=True):
    """``kvemu.routing``: the prediction's truth (the prefill pool's when disaggregated), reasons, attempts, regret."""

    reasons: dict[str, int]
    routed_requests: int
    mean_attempts: float | None
    max_attempts: int
    retried_requests: int
    dispatch_rejections: int
    regret: Regret | None
    regret_ratio: float | None
    pools: RoutingPools | UnsetType = UNSET


class Queue(_Section, kw_only=True):
    """``kvemu.queue``: the policy queue's requests and waits."""

    queued_requests: int
    queued_events: int
    dispatched_after_queue: int
    mean_queue_wait_ms: float | None
    p99_queue_wait_ms: float | None
    max_queue_wait_ms: float | None


class KvEvents(_Section, kw_only=True):
    """``kvemu.kv_events``: per worker (``worker_id`` and its counters) and the totals."""

    per_worker: list[dict[str, int]]
    totals: dict[str, int]


class SlaSection(_Section, kw_only=True):
    """``kvemu.sla``: the targets (ms) and the share of requests that met them."""

    ttft_ms: Num | None
    itl_ms: Num | None
    e2e_ms: Num | None
    met_ratio: float | None


class Disaggregated(_Section, kw_only=True):
    """``kvemu.disaggregated``: the pools, the requests per rank, the KV transfer and the reservation wait."""

    pools: dict[str, dict[str, int]]
    requests_per_prefill_rank: dict[str, int]
    requests_per_decode_rank: dict[str, int]
    kv_transfer_ms: Stats
    decode_reservation_wait_ms: Stats


class CacheTiers(_Section, kw_only=True):
    """``kvemu.cache_tiers``: first-admission cached tokens per tier (GPU = g1, host)."""

    requests: int
    g1_cached_tokens: int
    host_cached_tokens: int
    requests_with_host_hits: int
    g1_cached_ratio: float | None
    host_cached_ratio: float | None


class OutcomeCounts(_Section, kw_only=True):
    """The autoscaler's decisions by outcome."""

    applied: int
    clamped: int
    refused: int


class AutoscaleDecision(_Section, kw_only=True):
    """One decision of the autoscaler's policy."""

    time_s: float
    action: str
    pool: str
    requested: int
    applied: int
    outcome: str
    detail: str
    reason: str
    worker_ids: list[int]
    ready_s: list[float]


class Autoscaler(_Section, kw_only=True):
    """``kvemu.autoscaler``: the config, decision counts, the first decisions and the managed pool's counts."""

    config: dict[str, ConfigValue]
    pool: str
    decisions_total: int
    decisions_by_outcome: OutcomeCounts
    workers_added: int
    workers_removed: int
    min_running_workers: int | None
    max_running_workers: int | None
    max_provisioned_workers: int | None
    decisions: list[AutoscaleDecision]
    workers_over_time_total: int
    workers_over_time: list[list[Num]]
    """(time s, running, starting, draining)."""


class Speculative(_Section, kw_only=True):
    """``kvemu.speculative``: the settings, and what speculative decoding did."""

    method: str
    num_speculative_tokens: int
    conditional_acceptance_rates: list[Num]
    draft_cost: Num
    expected_tokens_per_decode_pass: Num
    decode_tokens: int
    decode_passes: int
    tokens_per_decode_pass: float | None
    itl_per_pass_ms: Stats


class ReplicaSync(_Section, kw_only=True):
    """Router replicas' sync: on or off, and its delay."""

    enabled: bool
    delay_ms: Num


class ReplicaRow(_Section, kw_only=True):
    """``kvemu.replicas.per_replica[]``: one replica's requests, reuse, regret and own counters."""

    replica: int
    requests: int
    completed_requests: int
    failed_requests: int
    prefix_cache_reused_ratio: float | None
    regret_ratio: float | None
    regret: Regret | None
    restarts: int
    kv_events: dict[str, int]
    kv_feed_dropped_batches: int
    workers_registered: int
    affinity: dict[str, int] | UnsetType = UNSET
    sync: dict[str, int] | UnsetType = UNSET


class Replicas(_Section, kw_only=True):
    """``kvemu.replicas``: router replicas, their front and sync, and each replica's row."""

    count: int
    front: str
    sync: ReplicaSync
    per_replica: list[ReplicaRow]


class LanePhase(_Section, kw_only=True):
    """One lane phase's requests and span (ms)."""

    requests: int
    completed_requests: int
    failed_requests: int
    start_ms: float | None
    end_ms: float | None
    duration_ms: float | None


class LanePhases(_Section, kw_only=True):
    """The lane player's three phases."""

    primer: LanePhase
    warmup: LanePhase
    profile: LanePhase


class Lanes(_Section, kw_only=True):
    """``kvemu.lanes``: the lane player's figures (alphabetical, as written) and its phases."""

    corpus_cursor: int
    corpus_plays: int
    duration_s: Num | None
    failed_preparation: bool
    grace_s: Num
    idle_shifts_global: int
    idle_shifts_tree: int
    lanes: int
    plays_completed: int
    plays_cut: int
    plays_started: int
    requests_cancelled: int
    requests_issued: int
    requests_never_issued: int
    snapshot_seed: int | None
    unsettled_server_requests: int | None
    warmup: bool
    phases: LanePhases


class KvemuSection(_Section, kw_only=True):
    """summary.json's ``kvemu``: kvemu's own figures (the reference replay has none of these)."""

    scenario: str
    build: str
    mode: str
    seed: int
    partial: bool
    stop_reason: str | None
    block_size: int
    failed_requests: int
    unfinished_requests: int
    failed_requests_by_reason: dict[str, int]
    concurrency: int | None
    per_rank: list[RankRow]
    routing: Routing
    affinity: dict[str, int] | None
    queue: Queue
    kv_events: KvEvents
    hook_counts: dict[str, int]
    worker_events: dict[str, int]
    sla: SlaSection | UnsetType = UNSET
    disaggregated: Disaggregated | UnsetType = UNSET
    cache_tiers: CacheTiers | UnsetType = UNSET
    autoscaler: Autoscaler | UnsetType = UNSET
    speculative: Speculative | UnsetType = UNSET
    replicas: Replicas | UnsetType = UNSET
    lanes: Lanes | UnsetType = UNSET
    worker_exits: dict[str, str] | UnsetType = UNSET
    """Worker processes their supervisor saw exit (worker id -> how)."""


class Summary(_Section, kw_only=True):
    """summary.json: the reference replay's keys at top level (latency in ms, throughput per second), kvemu's own
    under ``kvemu``. ``msgspec.to_builtins`` gives the file's content."""

    num_requests: int
    completed_requests: int
    total_input_tokens: int
    total_output_tokens: int
    duration_ms: float | None
    wall_time_ms: float
    request_throughput_rps: float | None
    input_throughput_tok_s: float | None
    output_throughput_tok_s: float | None
    total_throughput_tok_s: float | None
    prefix_cache_reused_ratio: float | None
    first_admission_prefix_cache_reused_ratio: float | None
    partial: bool
    prefill_worker_seconds: float
    decode_worker_seconds: float
    prefill_gpus_per_worker: int
    decode_gpus_per_worker: int
    gpu_hours: float
    goodput_completed_requests: int | UnsetType = UNSET
    goodput_request_throughput_rps: float | None | UnsetType = UNSET
    goodput_output_throughput_tok_s: float | None | UnsetType = UNSET
    mean_ttft_ms: float | None
    min_ttft_ms: float | None
    max_ttft_ms: float | None
    median_ttft_ms: float | None
    p75_ttft_ms: float | None
    p90_ttft_ms: float | None
    p95_ttft_ms: float | None
    p99_ttft_ms: float | None
    std_ttft_ms: float | None
    mean_ttst_ms: float | None
    min_ttst_ms: float | None
    max_ttst_ms: float | None
    median_ttst_ms: float | None
    p75_ttst_ms: float | None
    p90_ttst_ms: float | None
    p95_ttst_ms: float | None
    p99_ttst_ms: float | None
    std_ttst_ms: float | None
    mean_tpot_ms: float | None
    min_tpot_ms: float | None
    max_tpot_ms: float | None
    median_tpot_ms: float | None
    p75_tpot_ms: float | None
    p90_tpot_ms: float | None
    p95_tpot_ms: float | None
    p99_tpot_ms: float | None
    std_tpot_ms: float | None
    mean_itl_ms: float | None
    min_itl_ms: float | None
    max_itl_ms: float | None
    median_itl_ms: float | None
    p75_itl_ms: float | None
    p90_itl_ms: float | None
    p95_itl_ms: float | None
    p99_itl_ms: float | None
    std_itl_ms: float | None
    mean_e2e_latency_ms: float | None
    min_e2e_latency_ms: float | None
    max_e2e_latency_ms: float | None
    median_e2e_latency_ms: float | None
    p75_e2e_latency_ms: float | None
    p90_e2e_latency_ms: float | None
    p95_e2e_latency_ms: float | None
    p99_e2e_latency_ms: float | None
    std_e2e_latency_ms: float | None
    mean_output_token_throughput_per_user: float | None
    min_output_token_throughput_per_user: float | None
    max_output_token_throughput_per_user: float | None
    median_output_token_throughput_per_user: float | None
    p75_output_token_throughput_per_user: float | None
    p90_output_token_throughput_per_user: float | None
    p95_output_token_throughput_per_user: float | None
    p99_output_token_throughput_per_user: float | None
    std_output_token_throughput_per_user: float | None
    kvemu: KvemuSection

    def to_builtins(self) -> dict[str, Any]:
        """summary.json's content as plain dicts and lists (absent sections left out)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    def __getitem__(self, key: str) -> Any:
        """Deprecated (one release): ``summary["kvemu"]["routing"]``, as when the summary was a dict."""
        _deprecated(f'summary["{key}"]')
        return self.to_builtins()[key]

    def get(self, key: str, default: Any = None) -> Any:
        """Deprecated (one release): ``summary.get("median_ttft_ms")``, as when the summary was a dict."""
        _deprecated(f'summary.get("{key}")')
        return self.to_builtins().get(key, default)

    def __contains__(self, key: object) -> bool:
        """Deprecated (one release): ``"goodput_completed_requests" in summary``, as when it was a dict."""
        _deprecated(f"{key!r} in summary")
        return key in self.to_builtins()


def _deprecated(what: str) -> None:
    warnings.warn(f"{what}: the run's summary is a typed Summary now; read its attributes (summary.kvemu.routing...), "
                  "or summary.to_builtins() for summary.json's plain data", DeprecationWarning, stacklevel=3)
