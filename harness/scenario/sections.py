"""The scenario's sections, each with its fields, defaults, bounds and its own checks: the cluster (engine, pools),
the router, the workload (synthetic or trace), the run, a chaos event, the autoscaler.

Knobs are defined once: ``router`` takes every field of ``kvemu.RouterConfig`` and of
``kvemu.runtime.router.RouterSettings`` plus how the harness runs the router, and ``cluster.engine`` every
field of ``workers.EngineConfig``; their bounds are the configs' ``msgspec.Meta`` constraints, so a scenario
and a Python caller are held to the same ranges. Checks across sections are the whole scenario's
(``harness.scenario.schema``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, NamedTuple, TypedDict

import msgspec
from msgspec import Meta

from kvemu.autoscale.config import AutoscaleConfig
from kvemu.clock import NS_PER_MS
from kvemu.config import RouterConfig
from kvemu.errors import InvalidArgument
from kvemu.limits import I64, MAX_WEIGHT, RANK_MAX, FilePath, Name, Weight
from kvemu.records import RequestRecord
from kvemu.replica_sync import MAX_REPLICAS
from kvemu.runtime.router import RouterSettings
from kvemu.validation import check_struct
from kvemu.wire.codec import DEFAULT_VLLM_VERSION, STORED_FIELDS, profile_for
from workers.config import EngineConfig
from kvemu.limits import MAX_PROMPT_TOKENS
from kvemu.limits import MAX_TRACE_MS

__all__ = [
    "EngineSpec",
    "ChaosAction",
    "ChaosTargets",
    "CHAOS_TARGETS",
    "PoolSpec",
    "ClusterSpec",
    "AffinitySpec",
    "RouterSpec",
    "Distribution",
    "SyntheticWorkload",
    "TraceWorkload",
    "LanesSpec",
    "RunSpec",
    "ChaosEvent",
    "AutoscalerSpec",
    "MAX_WORKERS",
    "MAX_DP_SIZE",
    "MAX_RANKS",
    "MAX_SCENARIO_S",
    "MAX_SCENARIO_NS",
    "MAX_REQUESTS",
    "Count",
    "Index",
    "NonNeg",
    "Positive",
    "Seconds",
    "PositiveSeconds",
    "Tokens",
]


class _StructOptions(TypedDict):
    """The ``msgspec`` options of every scenario section: passed to ``msgspec.defstruct`` and to a class whose base
    mypy cannot see; the other ``class`` statements spell them out, where mypy reads them."""

    kw_only: bool
    forbid_unknown_fields: bool
    frozen: bool


_STRUCT: _StructOptions = dict(kw_only=True, forbid_unknown_fields=True, frozen=True)

_ROUTER_LIMITS = RouterSettings()
MAX_WORKERS = _ROUTER_LIMITS.max_workers
"""Most workers a scenario's cluster may start (what a router registers by default)."""
MAX_DP_SIZE = _ROUTER_LIMITS.max_ranks_per_worker
"""Most DP ranks one worker may have."""
MAX_RANKS = _ROUTER_LIMITS.max_ranks
"""Largest cluster a scenario may start (workers x dp_size): what a router registers by default."""
MAX_SCENARIO_S = MAX_TRACE_MS / 1000
"""Longest scenario time (about ten years, as for trace rows): durations, delays and chaos instants stay below it."""
MAX_SCENARIO_NS = round(MAX_TRACE_MS * NS_PER_MS)
"""``MAX_SCENARIO_S`` in nanoseconds."""
MAX_REQUESTS = 10_000_000
"""Most requests one scenario may send (a synthetic workload's expected count included)."""

Count = Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
"""A count of at least one."""
Index = Annotated[int, Meta(ge=0, le=RANK_MAX)]
"""A worker's index or a DP rank."""
NonNeg = Weight
"""A finite number in [0, 1e6]."""
Positive = Annotated[float, Meta(gt=0, le=MAX_WEIGHT)]
"""A finite number in (0, 1e6]."""
Seconds = Annotated[float, Meta(ge=0, le=MAX_SCENARIO_S)]
"""Scenario seconds, a duration or an instant, in [0, ``MAX_SCENARIO_S``]."""
Millis = Annotated[float, Meta(ge=0, le=MAX_SCENARIO_S * 1000)]
PositiveSeconds = Annotated[float, Meta(gt=0, le=MAX_SCENARIO_S)]
"""A duration in seconds, above zero."""
Tokens = Annotated[int, Meta(ge=1, le=MAX_PROMPT_TOKENS)]
"""A token count of one prompt or output, at least one."""


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """A scenario section: its declared bounds also hold when it is built in Python (and floats are finite)."""

    def __post_init__(self) -> None:
        check_struct(self)


class _EngineSection(_Section, kw_only=True, forbid_unknown_fields=True, frozen=True):
    def __post_init__(self) -> None:
        config = self.config(dp_size=1)  # EngineConfig's own checks, cross-field ones included
        if self.block_size is None:  # type: ignore[attr-defined]
            msgspec.structs.force_setattr(self, "block_size", config.block_size)  # the backend's default

    def config(self, dp_size: int) -> EngineConfig:
        """The engine configuration of every rank of a worker with ``dp_size`` ranks."""
        return EngineConfig(dp_size=dp_size, **msgspec.structs.asdict(self))


EngineSpec = msgspec.defstruct(
    "EngineSpec",
    [(f.name, f.type, f.default) for f in msgspec.structs.fields(EngineConfig) if f.name != "dp_size"],
    bases=(_EngineSection,), module=__name__, **_STRUCT,
)
"""Mock engine settings per DP rank: every ``EngineConfig`` knob, same names, defaults and bounds, except
``dp_size``, which is ``cluster.dp_size``."""


class PoolSpec(_Section, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """One pool of a disaggregated cluster: its workers, their DP ranks and their engine."""

    workers: Annotated[int, Meta(ge=1, le=MAX_WORKERS)] = 1
    dp_size: Annotated[int, Meta(ge=1, le=MAX_DP_SIZE)] = 1
    engine: EngineSpec = EngineSpec()  # type: ignore[valid-type]


class ClusterSpec(_Section, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """The workers: one aggregated pool (``workers``, ``dp_size``, ``engine``), or a prefill pool and a
    decode pool (``prefill`` and ``decode``, each with its own; the top-level three are then unused)."""

    workers: Annotated[int, Meta(ge=1, le=MAX_WORKERS)] = 4
    dp_size: Annotated[int, Meta(ge=1, le=MAX_DP_SIZE)] = 1
    worker_type: Literal["aggregated", "prefill", "decode"] = "aggregated"
    engine: EngineSpec = EngineSpec()  # type: ignore[valid-type]
    kv_events_version: Name = DEFAULT_VLLM_VERSION
    """vLLM version whose KV-event wire format the workers speak."""
    kv_events_hash_form: Literal["int", "bytes"] = "int"
    """How the workers' KV events carry block hashes: ``int`` (vLLM's default, the low 64 bits of the digest as a
    msgpack uint64) or ``bytes`` (its ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: a 32-byte digest ending in the
    same 64 bits; vLLM >= 0.11 only). Routing is the same either way."""
    kv_events_block_hashes: Literal["kvemu", "vllm-0.34"] = "kvemu"
    """Whose block hashes the workers' KV events carry: kvemu's own (fast), or those vLLM 0.34 computes (SHA-256
    over its pickled blocks, ``docs/vllm-semantics.md``), so a worker's events for a prompt equal a real vLLM's.
    Routing is the same either way; with ``vllm-0.34`` in-memory runs carry events as wire bytes (slower)."""
    heartbeat_interval_s: PositiveSeconds = 1.0
    kv_wire_check: bool = False
    """Virtual mode: carry every actor message and KV-event batch as the bytes live mode sends
    (encoded and decoded on the way) instead of as objects. Same report, slower; proves the codecs."""
    prefill: PoolSpec | None = None
    """Disaggregated serving: the pool that computes prompts (its engine's ``kv_transfer_*`` knobs model the
    link to the decode pool). Give ``decode`` too."""
    decode: PoolSpec | None = None
    """Disaggregated serving: the pool that receives the prompts' KV and produces the tokens."""

    @property
    def disaggregated(self) -> bool:
        """Whether the cluster has a prefill pool and a decode pool."""
        return self.prefill is not None

    def pools(self) -> dict[str, tuple[int, int, Any]]:
        """``pool -> (workers, dp_size, engine spec)``: ``aggregated``, or ``prefill`` and ``decode``."""
        if self.prefill is not None and self.decode is not None:
            return {"prefill": (self.prefill.workers, self.prefill.dp_size, self.prefill.engine),
                    "decode": (self.decode.workers, self.decode.dp_size, self.decode.engine)}
        return {"aggregated": (self.workers, self.dp_size, self.engine)}

    def __post_init__(self) -> None:
        check_struct(self)
        if (self.prefill is None) != (self.decode is None):
            raise InvalidArgument("a disaggregated cluster needs both pools: give cluster.prefill and cluster.decode",
                                  field="prefill" if self.prefill is None else "decode")
        if self.prefill is not None and self.decode is not None:
            ranks = self.prefill.workers * self.prefill.dp_size + self.decode.workers * self.decode.dp_size
            if ranks > MAX_RANKS:
                raise InvalidArgument(f"the pools' {ranks} DP ranks are more than the {MAX_RANKS} ranks a scenario "
                                      "may start", field="decode")
            for name, pool in (("prefill", self.prefill), ("decode", self.decode)):
                # EngineSpec is built by msgspec.defstruct: mypy cannot see its fields
                if pool.engine.backend == "sglang":  # type: ignore[attr-defined]
                    raise InvalidArgument("the SGLang flavour runs no disaggregated "
                                          "pools yet; use vllm or trtllm there", field=f"{name}.engine.backend")
        if self.workers * self.dp_size > MAX_RANKS:
            raise InvalidArgument(f"{self.workers} workers x {self.dp_size} DP ranks is more than the {MAX_RANKS} "
                                  "ranks a scenario may start", field="workers")
        try:
            profile_for(self.kv_events_version)
        except InvalidArgument as exc:
            raise InvalidArgument(str(exc), field="kv_events_version") from None
        try:
            profile_for(self.kv_events_version, self.kv_events_hash_form)
        except InvalidArgument as exc:
            raise InvalidArgument(f"kv_events_hash_form {self.kv_events_hash_form!r} with kv_events_version "
                                  f"{self.kv_events_version!r}: {exc}", field="kv_events_hash_form") from None
        if self.kv_events_block_hashes != "kvemu" and self.kv_events_hash_form != "int":
            raise InvalidArgument("kv_events_block_hashes vllm-0.34 publishes vLLM's int form (its default); "
                                  "kv_events_hash_form must be int", field="kv_events_hash_form")
        self._check_kv_groups_wire()

    def _check_kv_groups_wire(self) -> None:
        """Hybrid KV groups need KV events that name the group (``group_idx``, vLLM >= 0.20); a hybrid decode pool
        runs the prefill pool's model (a decode leg lands the groups its prefill leg computed)."""
        if self.decode is not None and self.prefill is not None and self.decode.engine.kv_groups and (  # type: ignore[attr-defined]
                self.decode.engine.kv_groups != self.prefill.engine.kv_groups):  # type: ignore[attr-defined]
            raise InvalidArgument("decode.engine.kv_groups must be the prefill pool's (the same model's layers): give "
                                  "prefill.engine the same kv_groups", field="decode.engine.kv_groups")
        profile = profile_for(self.kv_events_version)
        if "group_idx" in STORED_FIELDS[:profile.stored_fields]:
            return
        for name, (_, _, engine) in self.pools().items():
            if engine.kv_groups:
                where = "engine" if name == "aggregated" else f"{name}.engine"
                raise InvalidArgument(
                    f"{where}.kv_groups needs kv_events_version 0.20 or later: vLLM {self.kv_events_version}'s KV "
                    "events have no group_idx field, so they cannot say which KV cache group a block belongs to (and "
                    "vLLM before 0.20 turns its hybrid KV cache manager off when KV events are on)",
                    field="kv_events_version")


class AffinitySpec(_Section, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Session affinity (requests with a ``session_id`` or a parent session)."""

    enabled: bool = False
    ttl_secs: PositiveSeconds = 300.0
    mode: Literal["hard", "soft"] = "hard"


class ReplicaSyncSpec(_Section, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Router replicas announce their bookings, prefill completions and frees to each other (Dynamo's
    ``router_replica_sync``): each replica's load view then holds every replica's bookings, ``delay_ms`` late."""

    enabled: bool = False
    delay_ms: Annotated[float, Meta(ge=0, le=60_000)] = 1.0
    """From a replica's first announcement of a batch to the others applying it (Dynamo batches 1 ms)."""
    predictions: bool = False
    """Routers without KV events (``use_kv_events: false``): a booking also carries the prompt's block hashes, and
    every other replica inserts them into its approximate prefix index, as SGLang's gateway mesh syncs its tree
    inserts (Dynamo shares no predicted entries: off by default)."""


_RouterKnobs = msgspec.defstruct(
    "_RouterKnobs",
    [(f.name, f.type, f.default) for f in msgspec.structs.fields(RouterSettings)],
    bases=(RouterConfig,), module=__name__, **_STRUCT,
)
"""Every ``RouterConfig`` and ``RouterSettings`` knob: same names, defaults and bounds."""


# _RouterKnobs is built by msgspec.defstruct: mypy sees a variable, not a class
class RouterSpec(_RouterKnobs, **_STRUCT):  # type: ignore[valid-type,misc]
    """The router: every ``RouterConfig`` and ``RouterSettings`` knob, plus how the harness runs it."""

    policy: FilePath = "kv"
    """``kv`` (default selector), ``round_robin``, ``random``, or ``module:callable`` returning a CustomPolicy."""
    kv_event_lag_ms: Millis = 0.0
    """Every KV publisher publishes this late, in order (the router's view of KV events lags; both modes)."""
    network_latency_ms: Millis = 0.0
    """One-way delivery latency between router and workers (virtual mode)."""
    seed: I64 | None = None
    """Seed of the router's tie-breaking generator (default: the run seed)."""
    affinity: AffinitySpec = AffinitySpec()
    replicas: Annotated[int, Meta(ge=1, le=MAX_REPLICAS)] = 1
    """Router replicas behind one load balancer: each a full router (its own prefix index, load view, queue and
    affinity table) fed by the same KV events; the workers serve them all."""
    replica_front: Literal["round_robin", "random", "session", "prefix"] = "round_robin"
    """How the load balancer spreads requests over the replicas: in turn, at random (seeded), by a hash of the
    session id (a session's turns reach one replica; requests without one go in turn), or by a hash of the
    prompt's first ``replica_prefix_tokens`` tokens (SGLang's gateway's ``prefix_hash``)."""
    replica_prefix_tokens: Annotated[int, Meta(ge=1, le=1 << 20)] = 256
    """``replica_front: prefix``: how many leading prompt tokens choose the replica (SGLang's default 256)."""
    replica_sync: ReplicaSyncSpec = ReplicaSyncSpec()

    def __post_init__(self) -> None:
        check_struct(self)
        if self.policy not in ("kv", "round_robin", "random") and not re.fullmatch(r"[\w.]+:\w+", self.policy):
            raise InvalidArgument(f"policy must be kv, round_robin, random or module:callable, got {self.policy!r}",
                                  field="policy")
        if self.replica_sync.predictions and self.use_kv_events:
            raise InvalidArgument("replica_sync.predictions shares approximate-index inserts: it needs use_kv_events: "
                                  "false (with KV events every replica's index is fed by the workers already)",
                                  field="replica_sync.predictions")

    def config(self) -> RouterConfig:
        """The ``RouterConfig`` part of this section."""
        return RouterConfig(**{name: getattr(self, name) for name in RouterConfig.__struct_fields__})

    def settings(self) -> RouterSettings:
        """The ``RouterSettings`` part of this section."""
        return RouterSettings(**{name: getattr(self, name) for name in RouterSettings.__struct_fields__})


class Distribution(_Section, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """A positive integer distribution: ``constant``, ``uniform`` [low, high], ``normal`` or ``lognormal``."""

    kind: Literal["constant", "uniform", "normal", "lognormal"] = "constant"
    mean: Annotated[float, Meta(ge=0, le=MAX_PROMPT_TOKENS)] = 512
    std: Annotated[float, Meta(ge=0, le=MAX_PROMPT_TOKENS)] = 0.0
    low: Tokens = 1
    high: Tokens = 1 << 20

    def __post_init__(self) -> None:
        check_struct(self)
        if self.low > self.high:
            raise InvalidArgument(f"low ({self.low}) must be <= high ({self.high})", field="low")


class _Workload(_Section, kw_only=True, forbid_unknown_fields=True, frozen=True):
    concurrency: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None
    """Closed loop: at most this many sessions in flight, each next one (in start order) starting when one
    ends; start times are ignored (the reference replay's ``replay_concurrency``). None: open loop."""


class SyntheticWorkload(_Workload, tag="synthetic", tag_field="kind",
                        kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Generated traffic: sessions of several turns, shared prefixes, sub-agents, pins."""

    arrival: Literal["poisson", "constant"] = "poisson"
    rate_rps: Annotated[float, Meta(gt=0, le=1e6)] = 4.0
    """New sessions per second."""
    isl: Distribution = Distribution(mean=1024, std=256, kind="normal", low=64, high=8192)
    """Tokens added to the conversation per turn (the first turn's prompt)."""
    osl: Distribution = Distribution(mean=128, std=32, kind="normal", low=8, high=2048)
    turns: Annotated[int, Meta(ge=1, le=100_000)] = 3
    think_time_s: Seconds = 2.0
    system_prefix_tokens: Annotated[int, Meta(ge=0, le=MAX_PROMPT_TOKENS)] = 512
    num_prefix_groups: Annotated[int, Meta(ge=1, le=1_000_000)] = 4
    """Distinct system prompts; each session draws one."""
    sub_agents: Annotated[int, Meta(ge=0, le=1000)] = 0
    """Sibling sub-agent requests per turn, sharing the parent session's sibling-group affinity."""
    pin_fraction: Annotated[float, Meta(ge=0, le=1)] = 0.0
    """Fraction of sessions whose requests pin an explicit worker."""
    vocab_size: Annotated[int, Meta(ge=1, le=1 << 32)] = 32000


MAX_LANES = 100_000
"""Most lanes (concurrent play instances) a scenario may run."""


class LanesSpec(_Section, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Continuous agentic lanes (docs/lanes.md): ``lanes`` client lanes, each replaying whole plays of the trace
    one after another, taken from one shared corpus cursor; optionally a seeded snapshot cut of the first plays,
    a warm-up before measuring, and a continuous profile recycling the corpus for ``duration_s``."""

    lanes: Annotated[int, Meta(ge=1, le=MAX_LANES)]
    """Play instances in flight at most; a lane that finished its play takes the next one."""
    duration_s: PositiveSeconds | None = None
    """Continuous profile: admit plays (the cursor wraps around the corpus, each instance afresh) and requests for
    this long from the start of measurement. None: the corpus (or, with a snapshot, the lanes' first plays) once."""
    grace_s: Seconds = 30.0
    """After ``duration_s``: responses still count for this long; then what is still open is cancelled."""
    tree_idle_cap_s: PositiveSeconds | None = 300.0
    """Continuous profile: a play with nothing in flight waits at most this long for its next request (its pending
    timers move earlier, keeping their gaps). None: no cap."""
    global_idle_cap_s: PositiveSeconds | None = 10.0
    """Continuous profile: the whole client with nothing in flight waits at most this long (every pending timer
    moves earlier by the same amount). None: no cap."""
    snapshot_seed: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)] | None = None
    """Start each lane's first play part way (a seeded cut between 25% and 75% of its recorded span): what came
    before is history and is not replayed. None: plays start at their first request."""
    warmup: bool = False
    """With a snapshot: before measuring, prime each conversation with history (its last historical prompt, one
    output token), then send ``warmup_requests`` per lane; neither counts in the report's headline figures."""
    warmup_requests: Annotated[int, Meta(ge=0, le=10_000)] = 10
    """Warm-up requests per lane (each repeats one of the lane's primer prompts, one output token)."""
    settle_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 60.0
    """With a warm-up: after its last response, measurement waits for the server to settle (no request running
    or waiting, no KV transfer or offload in flight) at most this long; then it starts anyway, and the report
    counts what was still in the server (``unsettled_server_requests``)."""

    def __post_init__(self) -> None:
        check_struct(self)
        if self.warmup and self.snapshot_seed is None:
            raise InvalidArgument("a warm-up primes the history a snapshot cut off: give snapshot_seed too, or drop "
                                  "warmup", field="warmup")


class TraceWorkload(_Workload, tag="trace", tag_field="kind",
                    kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Replay of a trace file: Mooncake JSONL (``timestamp`` or ``delay``, ``hash_ids``...) or any format of
    ``harness.workload.traces`` (docs/traces.md), agentic graphs included."""

    trace: FilePath
    """Path of the trace, relative to the scenario file unless absolute (a directory: a Weka corpus)."""
    format: Literal["auto", "mooncake", "mooncake-delta", "agentic_mooncake", "agentic_mooncake_legacy",
                    "applied_compute_agentic", "weka", "dynamo"] = "auto"
    """The trace's format; ``auto`` tells it from the file where that is unambiguous (never ``mooncake-delta``)."""
    trace_block_size: Tokens | None = None
    """Tokens per hash id. None: the file's own (Agentic Mooncake v2, Weka, Dynamo say it), else 512; a value
    given for such a file must agree with it."""
    arrival_speedup_ratio: Positive = 1.0
    lanes: LanesSpec | None = None
    """Continuous agentic lanes (docs/lanes.md): plays replayed by a fixed number of client lanes, in phases."""

    def __post_init__(self) -> None:
        check_struct(self)
        if self.lanes is not None and self.concurrency is not None:
            raise InvalidArgument("lanes already bound the plays in flight: give workload.lanes or "
                                  "workload.concurrency, not both", field="lanes")
        if self.lanes is not None and self.format in ("mooncake", "mooncake-delta"):
            raise InvalidArgument(f"a {self.format} trace has no plays (a session per row chain) for lanes to "
                                  "replay; use an agentic format or drop workload.lanes", field="lanes")

    @property
    def block_size(self) -> int:
        """``trace_block_size``, or 512 when not given (for the formats whose files do not say it)."""
        return 512 if self.trace_block_size is None else self.trace_block_size


_SlaMillis = Annotated[float, Meta(gt=0, le=1e12)]


class Sla(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Per-request latency targets in ms (``run.sla``): ``ttft_ms`` and/or ``itl_ms``, or ``e2e_ms`` alone.

    A request meets them when it completed and its TTFT is at most ``ttft_ms`` and its mean inter-token latency
    ((last token − first token) / (output tokens − 1); a one-token reply has none and passes) at most ``itl_ms``;
    or, with ``e2e_ms`` instead, when its end-to-end latency is at most that. Bounds are inclusive (as the
    reference replay counts)."""

    ttft_ms: _SlaMillis | None = None
    itl_ms: _SlaMillis | None = None
    e2e_ms: _SlaMillis | None = None

    def __post_init__(self) -> None:
        check_struct(self)
        if self.e2e_ms is not None and (self.ttft_ms is not None or self.itl_ms is not None):
            raise InvalidArgument("e2e_ms is mutually exclusive with ttft_ms and itl_ms (as in the reference "
                                  "replay): give ttft_ms and/or itl_ms, or e2e_ms alone", field="e2e_ms")
        if self.ttft_ms is None and self.itl_ms is None and self.e2e_ms is None:
            raise InvalidArgument("an SLA needs a target: ttft_ms and/or itl_ms, or e2e_ms", field="ttft_ms")

    def met(self, rec: RequestRecord) -> bool:
        """Whether ``rec`` completed within every target."""
        if not rec.done or rec.first_token_ns is None or rec.completion_ns is None:  # done has a completion: narrows
            return False
        if self.e2e_ms is not None:
            return (rec.completion_ns - rec.arrival_ns) / NS_PER_MS <= self.e2e_ms
        if self.ttft_ms is not None and (rec.first_token_ns - rec.arrival_ns) / NS_PER_MS > self.ttft_ms:
            return False
        if self.itl_ms is not None:
            times = rec.token_times_ns
            if len(times) >= 2 and (times[-1] - times[0]) / (len(times) - 1) / NS_PER_MS > self.itl_ms:
                return False
        return True


class RunSpec(_Section, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """How to run: mode, seed, and when to stop."""

    mode: Literal["virtual", "live"] = "virtual"
    seed: I64 = 0
    duration_s: PositiveSeconds | None = None
    """Stop arrivals after this much scenario time, then drain."""
    max_requests: Annotated[int, Meta(ge=1, le=MAX_REQUESTS)] | None = None
    """Stop after this many requests (trace rows or synthetic turns)."""
    drain_timeout_s: PositiveSeconds = 600.0
    """Open loop: how long after the last session start the run may drain. Closed loop
    (``workload.concurrency``): the run stops when no request has ended for this long."""
    sla: Sla | None = None
    """Latency targets (``ttft_ms`` and/or ``itl_ms``, or ``e2e_ms``): the report adds goodput and per-request
    ``met_sla``."""
    router_silence_s: PositiveSeconds | None = None
    """``kvemu loadgen``: how long its router may stay silent before the load generator declares it lost (its open
    requests fail with ``router_lost``); default five heartbeat intervals, at least 5 s."""
    router_stall_s: PositiveSeconds = 120.0
    """``kvemu up``: its load generator knows whether the router process is alive, and waits this long for one
    that is alive but silent (stopped, or swamped) before declaring it lost; a router that exited is lost at once."""
    event_truth: bool = False
    """``kvemu up``/``loadgen``: derive the routing truth (``kvemu.routing.regret``) from the workers' KV events,
    which the load generator then follows itself (``harness.procs.truth_oracle``); the engines of separate processes
    cannot be read at the decision. Off: no regret figures in processes mode. Elsewhere the engines are read and
    this changes nothing."""
    stop_on_worker_exit: bool = False
    """``kvemu up``/``serve``: stop the run when a worker process exits unasked (a crash, a kill). By default a
    worker's death is a fault the cluster handles (the router fences it when its heartbeats stop; what it held
    fails with ``worker_lost``) and the report shows, not a reason to stop."""


ChaosAction = Literal["remove_worker", "add_worker", "kill_rank", "drop_kv_events", "delay_kv_events",
                      "slow_worker", "restart_router"]
"""What a chaos event does (``harness.chaos.apply_chaos`` maps each onto the host that applies it)."""


class ChaosTargets(NamedTuple):
    """What a chaos action may aim at, as the scenario's checks play the timeline."""

    worker: Literal["none", "optional", "required"]
    """Whether it names a worker (``optional``: the first running one when it does not)."""
    rank: bool = False
    """It names one of that worker's DP ranks (``dp_rank``)."""
    replica: bool = False
    """It may name a router replica (``replica``) instead of a worker."""


CHAOS_TARGETS: dict[ChaosAction, ChaosTargets] = {
    "remove_worker": ChaosTargets("optional"),
    "add_worker": ChaosTargets("none"),
    "kill_rank": ChaosTargets("required", rank=True),
    "drop_kv_events": ChaosTargets("optional", rank=True, replica=True),
    "delay_kv_events": ChaosTargets("none", replica=True),
    "slow_worker": ChaosTargets("required"),
    "restart_router": ChaosTargets("none", replica=True),
}
"""Per chaos action, what it aims at: one row per action, read by the timeline's checks (``harness.scenario.
schema``)."""


class ChaosEvent(_Section, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """One scheduled fault."""

    at_s: Seconds
    action: ChaosAction
    worker: Index | None = None
    """Target worker id (``remove_worker``, ``kill_rank``, ``drop_kv_events``, ``slow_worker``)."""
    dp_rank: Index = 0
    graceful: bool = True
    count: Annotated[int, Meta(ge=1, le=1 << 30)] = 1
    """Batches to drop (``drop_kv_events``)."""
    lag_ms: Annotated[float, Meta(ge=0, le=MAX_SCENARIO_S * 1000)] = 0.0
    factor: Annotated[float, Meta(gt=0, le=1e6)] = 1.0
    """Slowdown factor (``slow_worker``): durations are multiplied by it."""
    replica: Annotated[int, Meta(ge=0, lt=MAX_REPLICAS)] | None = None
    """With ``router.replicas``: the router replica it hits (``restart_router``: that replica, default 0;
    ``drop_kv_events``, ``delay_kv_events``: that replica's KV feed instead of a worker's publisher, in one process
    only: ``kvemu run``, virtual or live)."""


class AutoscalerSpec(AutoscaleConfig, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Add and remove workers of one pool as the load goes: every ``kvemu.autoscale.AutoscaleConfig`` knob."""

    def managed_pool(self, cluster: ClusterSpec) -> str:
        """The pool it scales: ``pool``, else the aggregated pool, or the decode pool of a disaggregated cluster."""
        return self.pool or ("decode" if cluster.disaggregated else "aggregated")
