"""The run model: everything a report is made of, as plain data (``RunData``, its ``Sample``s, its replicas' rows).

The in-process runner and the load generator build it; the summary, report.md, requests.jsonl and the plots
(``harness.report.summary``, ``markdown``, ``files``, ``plots``) are drawn from it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from kvemu.autoscale.records import AutoscaleLog
from kvemu.limits import MAX_KV_GROUPS, Count, Name, Rank, TimeNs, WorkerId
from kvemu.records import RequestRecord
from workers.config import SpeculativeConfig

from harness.chaos import ChaosMark
from harness.report.recorder import WorkerEvent
from harness.report.sla import Sla
from harness.report.summary_types import ReplicaSync
from harness.scenario import RunOrigin, Scenario
from harness.workload.lanes import LaneFigures


GroupBlocks = Annotated[dict[Annotated[int, Meta(ge=0, lt=MAX_KV_GROUPS)], Count], Meta(max_length=MAX_KV_GROUPS)]
"""Blocks per KV cache group (``group_idx``)."""


class Sample(msgspec.Struct, frozen=True):
    """One periodic sample of the router's view of one rank."""

    time_ns: TimeNs
    worker_id: WorkerId
    dp_rank: Rank
    active_requests: Count
    kv_blocks: Count
    """The router's indexed blocks of the rank (a decode rank's: its router's active blocks, see ``pools.samples``)."""
    pool: Name = "aggregated"
    """The rank's pool: ``aggregated``, ``prefill`` or ``decode``."""
    group_blocks: GroupBlocks | None = None
    """Hybrid KV cache groups (``kv_groups``): the router's indexed blocks of the rank per ``group_idx`` (its main
    full-attention group's are ``kv_blocks``); None for a plain rank."""
    group_held: GroupBlocks | None = None
    """Hybrid KV cache groups, virtual mode: the blocks the rank's requests hold per ``group_idx`` (its engine's
    count; freed sliding-window blocks that stay cached are not held); None otherwise."""


REPLICA_KV_COUNTERS = ("batches", "gaps", "replays", "replayed_batches", "lost_batches")
"""The KV-feed counters each replica's row keeps (``ReplicaCounters.kv_events``)."""


class ReplicaCounters(msgspec.Struct, frozen=True, kw_only=True):
    """One replica's own counters: its KV feed as it saw it, restarts, workers, affinity and sync."""

    replica: int
    restarts: int
    kv_events: dict[str, int]
    """``REPLICA_KV_COUNTERS``, summed over the workers."""
    kv_feed_dropped_batches: int
    """KV batches chaos made its own feed lose (``drop_kv_events`` naming it)."""
    workers_registered: int
    affinity: dict[str, int] | None = None
    """Its session-affinity counters (None: affinity is off)."""
    sync: dict[str, int] | None = None
    """Its replica sync's counters (None: sync is off)."""


class ReplicaRun(msgspec.Struct, frozen=True, kw_only=True):
    """Router replicas (``router.replicas`` > 1): how many, their front and sync, where each request went and each
    replica's own counters."""

    count: int
    front: str
    sync: ReplicaSync
    replica_of: dict[str, int]
    """Request id -> the replica it reached."""
    per_replica: list[ReplicaCounters]


class RunData(msgspec.Struct, kw_only=True):
    """Everything a report is made of (plain data; built by the runner from the recorder and samplers)."""

    records: list[RequestRecord] = []
    """Per-request records, sorted by arrival (re-sorted by arrival then id where order matters)."""
    scenario_name: str = "scenario"
    command: str = "kvemu run"
    """The command that ran it (``kvemu run``, ``kvemu up``, ``kvemu loadgen``...): report.md's title."""
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
    worker_events: list[WorkerEvent] = []
    """Workers added, fenced and removed (the recorder's ``worker_*`` hooks)."""
    pools: dict[str, dict[str, int]] = {}
    """The cluster's pools as started, ``pool -> {"workers", "dp_size", "kv_blocks"}`` (``kv_blocks``: a rank's
    KV capacity, optional): ``aggregated``, or ``prefill`` and ``decode``."""
    sla: Sla | None = None
    """The run's latency targets (``run.sla``): the summary adds goodput, requests.jsonl ``met_sla``."""
    concurrency: int | None = None
    """Closed-loop replay: the sessions in flight at most (``workload.concurrency``); None: open loop."""
    autoscale: AutoscaleLog | None = None
    """An autoscaled run's decisions and worker counts over time (None without an autoscaler)."""
    lanes: LaneFigures | None = None
    """Continuous agentic lanes (``workload.lanes``): the lane player's figures (``LanePlayer.report``); None: off."""
    phases: dict[str, str] | None = None
    """With lanes: each request's phase (``primer``, ``warmup``, ``profile``); the headline figures are the
    profile's, and requests.jsonl gives each row's ``phase``."""
    replicas: ReplicaRun | None = None
    """Router replicas (``router.replicas`` > 1): their front and sync, where each request went and each replica's
    own counters (KV feed, sync, restarts); None: one router."""
    truth_source: str | None = None
    """Where the routing truth came from when not from the engines themselves: ``kv_events`` (the load generator's
    oracle, ``harness.procs.truth_oracle``)."""
    truth_feed: dict[str, int] | None = None
    """With ``truth_source`` ``kv_events``: the oracle's own KV feed (batches, gaps, replays, lost batches)."""
    chaos: list[ChaosMark] = []
    """The scenario's chaos timeline (``harness.chaos.timeline``), for the plots' marks."""
    speculative: SpeculativeConfig | None = None
    """The decoding engines' speculative-decoding settings (None: off): the summary then reports acceptance and the
    gaps between passes."""
    scenario: Scenario | None = None
    """The resolved scenario that ran (overrides applied, defaults filled): written beside the report as
    scenario.yaml and listed under "What ran" (None: not known, as for a report rebuilt by hand)."""
    origin: RunOrigin | None = None
    """What the scenario was built from: the command, the file it named and its ``--set`` overrides."""


EXITED = "process_exited"
"""The reason of a worker the router fenced because its supervisor saw its process exit: ``process_exited (how)``."""
