"""The run model: everything a report is made of, as plain data (``RunData``, its ``Sample``s).

The in-process runner and the load generator build it; the summary, report.md, requests.jsonl and the plots
(``harness.report.summary``, ``markdown``, ``files``, ``plots``) are drawn from it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kvemu.autoscale.records import AutoscaleLog
from kvemu.limits import MAX_KV_GROUPS, Count, Name, Rank, TimeNs, WorkerId
from kvemu.records import RequestRecord

from harness.report.sla import Sla
from harness.scenario import RunOrigin, Scenario


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
    lanes: dict[str, Any] | None = None
    """Continuous agentic lanes (``workload.lanes``): the lane player's figures (``harness.workload.lanes``); None: off."""
    phases: dict[str, str] | None = None
    """With lanes: each request's phase (``primer``, ``warmup``, ``profile``); the headline figures are the
    profile's, and requests.jsonl gives each row's ``phase``."""
    replicas: dict[str, Any] | None = None
    """Router replicas (``router.replicas`` > 1): ``count``, ``front``, ``sync``, ``replica_of`` (request id -> the
    replica it reached) and ``per_replica`` (each replica's own counters: KV feed, sync, restarts); None: one
    router."""
    truth_source: str | None = None
    """Where the routing truth came from when not from the engines themselves: ``kv_events`` (the load generator's
    oracle, ``harness.procs.truth_oracle``)."""
    truth_feed: dict[str, int] | None = None
    """With ``truth_source`` ``kv_events``: the oracle's own KV feed (batches, gaps, replays, lost batches)."""
    chaos: list[dict[str, Any]] = []
    """The scenario's chaos timeline (``harness.chaos.timeline``: ``t_s``, ``action``, ``replica``, ``worker``,
    ``lag_ms``), for the plots' marks."""
    speculative: dict[str, Any] | None = None
    """The decoding engines' speculative-decoding settings (``workers.config.SpeculativeConfig`` as a dict; None:
    off): the summary then reports acceptance and the gaps between passes."""
    scenario: Scenario | None = None
    """The resolved scenario that ran (overrides applied, defaults filled): written beside the report as
    scenario.yaml and listed under "What ran" (None: not known, as for a report rebuilt by hand)."""
    origin: RunOrigin | None = None
    """What the scenario was built from: the command, the file it named and its ``--set`` overrides."""


EXITED = "process_exited"
"""The reason of a worker the router fenced because its supervisor saw its process exit: ``process_exited (how)``."""
