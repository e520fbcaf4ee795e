"""The scenario file: a cluster, a router, a workload, how to run it, and what to break.

Every field is typed (msgspec) and documented with its default. Loading rejects unknown keys, wrong
types, out-of-range values and missing files with an error naming the key path and its line; nothing
runs on an invalid scenario. ``--set key.path=value`` overrides are applied before validation.

Knobs are defined once: ``router`` takes every field of ``kvemu.RouterConfig`` and of
``kvemu.runtime.router.RouterSettings`` plus how the harness runs the router, and ``cluster.engine`` every
field of ``workers.EngineConfig``; their bounds are the configs' ``msgspec.Meta`` constraints, so a scenario
and a Python caller are held to the same ranges.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, TypedDict

import msgspec
import yaml
from msgspec import Meta

from kvemu.autoscale.config import AutoscaleConfig
from kvemu.clock import NS_PER_MS
from kvemu.config import RouterConfig
from kvemu.errors import InvalidArgument, KvemuError
from kvemu.runtime.router import RouterSettings
from kvemu.validation import check_struct
from kvemu.wire.codec import DEFAULT_VLLM_VERSION, profile_for
from workers.config import EngineConfig
from workers.profile import cached_profile_timing
from workers.trace import MAX_PROMPT_TOKENS, MAX_TRACE_MS

from harness.report.sla import Sla
from harness.text import counted
from harness.yaml_validation import describe_validation_error, floats_where_expected, key_location, line_of, value_at

__all__ = [
    "EngineSpec",
    "ClusterSpec",
    "AffinitySpec",
    "RouterSpec",
    "Distribution",
    "SyntheticWorkload",
    "TraceWorkload",
    "RunSpec",
    "ChaosEvent",
    "AutoscalerSpec",
    "Scenario",
    "ScenarioError",
    "load_scenario",
    "parse_scenario",
    "apply_overrides",
    "paths_from_cwd",
    "floats_where_expected",
    "default_scenario_text",
    "describe_validation_error",
    "read_text_file",
    "line_of",
    "file_kind",
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
MAX_DP_SIZE = _ROUTER_LIMITS.max_ranks_per_worker
MAX_RANKS = _ROUTER_LIMITS.max_ranks
"""Largest cluster a scenario may start (workers x dp_size): what a router registers by default."""
MAX_SCENARIO_S = MAX_TRACE_MS / 1000
"""Longest scenario time (about ten years, as for trace rows): durations, delays and chaos instants stay below it."""
MAX_SCENARIO_NS = round(MAX_TRACE_MS * NS_PER_MS)
MAX_REQUESTS = 10_000_000
"""Most requests one scenario may send (a synthetic workload's expected count included)."""
MAX_SCENARIO_BYTES = 1 << 20
"""Largest scenario file read."""

Count = Annotated[int, Meta(ge=1)]
Index = Annotated[int, Meta(ge=0)]
NonNeg = Annotated[float, Meta(ge=0)]
Positive = Annotated[float, Meta(gt=0)]
Seconds = Annotated[float, Meta(ge=0, le=MAX_SCENARIO_S)]
PositiveSeconds = Annotated[float, Meta(gt=0, le=MAX_SCENARIO_S)]
Tokens = Annotated[int, Meta(ge=1, le=MAX_PROMPT_TOKENS)]


class ScenarioError(KvemuError, ValueError):
    """An invalid scenario; the message names the key path (and line, when known)."""


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
    kv_events_version: str = DEFAULT_VLLM_VERSION
    """vLLM version whose KV-event wire format the workers speak."""
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


class AffinitySpec(_Section, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Session affinity (requests with a ``session_id`` or a parent session)."""

    enabled: bool = False
    ttl_secs: PositiveSeconds = 300.0
    mode: Literal["hard", "soft"] = "hard"


_RouterKnobs = msgspec.defstruct(
    "_RouterKnobs",
    [(f.name, f.type, f.default) for f in msgspec.structs.fields(RouterSettings)],
    bases=(RouterConfig,), module=__name__, **_STRUCT,
)
"""Every ``RouterConfig`` and ``RouterSettings`` knob: same names, defaults and bounds."""


# _RouterKnobs is built by msgspec.defstruct: mypy sees a variable, not a class
class RouterSpec(_RouterKnobs, **_STRUCT):  # type: ignore[valid-type,misc]
    """The router: every ``RouterConfig`` and ``RouterSettings`` knob, plus how the harness runs it."""

    policy: str = "kv"
    """``kv`` (default selector), ``round_robin``, ``random``, or ``module:callable`` returning a CustomPolicy."""
    kv_event_lag_ms: NonNeg = 0.0
    """Every KV publisher publishes this late, in order (the router's view of KV events lags; both modes)."""
    network_latency_ms: NonNeg = 0.0
    """One-way delivery latency between router and workers (virtual mode)."""
    seed: int | None = None
    """Seed of the router's tie-breaking generator (default: the run seed)."""
    affinity: AffinitySpec = AffinitySpec()

    def __post_init__(self) -> None:
        check_struct(self)
        if self.policy not in ("kv", "round_robin", "random") and not re.fullmatch(r"[\w.]+:\w+", self.policy):
            raise InvalidArgument(f"policy must be kv, round_robin, random or module:callable, got {self.policy!r}",
                                  field="policy")

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


class TraceWorkload(_Workload, tag="trace", tag_field="kind",
                    kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Replay of a Mooncake-format JSONL trace (``timestamp`` or ``delay``, ``hash_ids``...)."""

    trace: str
    """Path of the JSONL file, relative to the scenario file unless absolute."""
    format: Literal["mooncake"] = "mooncake"
    trace_block_size: Count = 512
    arrival_speedup_ratio: Positive = 1.0


class RunSpec(_Section, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """How to run: mode, seed, and when to stop."""

    mode: Literal["virtual", "live"] = "virtual"
    seed: int = 0
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
    stop_on_worker_exit: bool = False
    """``kvemu up``/``serve``: stop the run when a worker process exits unasked (a crash, a kill). By default a
    worker's death is a fault the cluster handles (the router fences it when its heartbeats stop; what it held
    fails with ``worker_lost``) and the report shows, not a reason to stop."""


class ChaosEvent(_Section, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """One scheduled fault."""

    at_s: Seconds
    action: Literal["remove_worker", "add_worker", "kill_rank", "drop_kv_events", "delay_kv_events",
                    "slow_worker", "restart_router"]
    worker: Index | None = None
    """Target worker id (``remove_worker``, ``kill_rank``, ``drop_kv_events``, ``slow_worker``)."""
    dp_rank: Index = 0
    graceful: bool = True
    count: Annotated[int, Meta(ge=1, le=1 << 30)] = 1
    """Batches to drop (``drop_kv_events``)."""
    lag_ms: Annotated[float, Meta(ge=0, le=MAX_SCENARIO_S * 1000)] = 0.0
    factor: Annotated[float, Meta(gt=0, le=1e6)] = 1.0
    """Slowdown factor (``slow_worker``): durations are multiplied by it."""


class AutoscalerSpec(AutoscaleConfig, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Add and remove workers of one pool as the load goes: every ``kvemu.autoscale.AutoscaleConfig`` knob."""

    def managed_pool(self, cluster: ClusterSpec) -> str:
        """The pool it scales: ``pool``, else the aggregated pool, or the decode pool of a disaggregated cluster."""
        return self.pool or ("decode" if cluster.disaggregated else "aggregated")


class Scenario(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """A whole scenario file."""

    name: str = "scenario"
    """Names the report and the default output directory ``out/<name>``: letters, digits, ``.``, ``_``, ``-``."""
    cluster: ClusterSpec = ClusterSpec()
    router: RouterSpec = RouterSpec()
    workload: SyntheticWorkload | TraceWorkload = SyntheticWorkload()
    run: RunSpec = RunSpec()
    chaos: list[ChaosEvent] = []
    autoscaler: AutoscalerSpec | None = None
    """Scale one pool on a policy's decisions (optional; see README "Autoscaling")."""
    base_dir: str = "."
    """Directory relative paths resolve against (set by the loader)."""

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise InvalidArgument(f"{self.name!r} is not a plain name: up to 100 letters, digits, '.', '_' or '-', "
                                  "starting with a letter or digit (it names the output directory)", field="name")
        _check_chaos(self)
        if self.autoscaler is not None:
            _check_autoscaler(self, self.autoscaler)
        if isinstance(self.workload, SyntheticWorkload):
            _check_synthetic(self.workload, self.run)


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_WORKER_ACTIONS = ("remove_worker", "kill_rank", "drop_kv_events", "slow_worker")
_RANK_ACTIONS = ("kill_rank", "drop_kv_events")
MAX_SYNTHETIC_TOKENS = 250_000_000
"""Most prompt token slots a synthetic workload may generate up front (about 2 GB of lists)."""


def _check_chaos(s: Scenario) -> None:
    """Play the chaos timeline on worker ids (initial ``0..workers-1``, each ``add_worker`` the next id): every
    action must name a running worker and an existing rank, as the run will need them."""
    pools = list(s.cluster.pools().values())  # worker ids run pool by pool: prefill first, then decode
    dp_of: dict[int, int] = {}
    for n, dp, _ in pools:
        base = len(dp_of)
        dp_of.update((base + k, dp) for k in range(n))
    live = list(dp_of)
    next_id = len(dp_of)
    added_dp = pools[-1][1]  # add_worker adds to the last pool: the aggregated one, or the decode pool
    for i in sorted(range(len(s.chaos)), key=lambda k: s.chaos[k].at_s):  # same-instant events keep file order
        ev = s.chaos[i]
        at = f"chaos[{i}] ({ev.action} at {ev.at_s:g} s)"
        if ev.action == "restart_router" and s.cluster.disaggregated:
            raise InvalidArgument(f"{at}: restarting the routers of a disaggregated cluster is not supported yet",
                                  field=f"chaos[{i}].action")
        if ev.action not in _WORKER_ACTIONS:
            if ev.worker is not None:
                raise InvalidArgument(f"{at} takes no worker" + (f" (the new worker will be {next_id})"
                                      if ev.action == "add_worker" else ""), field=f"chaos[{i}].worker")
            if ev.action == "add_worker":
                if sum(dp_of[w] for w in live) + added_dp > MAX_RANKS:
                    raise InvalidArgument(f"{at}: the cluster would exceed {MAX_RANKS} ranks", field=f"chaos[{i}]")
                live.append(next_id)
                dp_of[next_id] = added_dp
                next_id += 1
            continue
        target = ev.worker
        if target is None:
            if ev.action in ("kill_rank", "slow_worker"):
                raise InvalidArgument(f"{at} needs a worker id", field=f"chaos[{i}].worker")
            if not live:
                raise InvalidArgument(f"{at}: no worker is running then", field=f"chaos[{i}]")
            target = min(live)
        if target not in live:
            running = ", ".join(map(str, live[:12])) + (" ..." if len(live) > 12 else "") if live else "none"
            raise InvalidArgument(f"{at}: worker {target} is not running then (running: {running})",
                                  field=f"chaos[{i}].worker")
        if ev.action in _RANK_ACTIONS and ev.dp_rank >= dp_of[target]:
            raise InvalidArgument(f"{at}: dp_rank {ev.dp_rank} does not exist (worker {target} has {dp_of[target]} "
                                  "DP ranks)", field=f"chaos[{i}].dp_rank")
        if ev.action == "remove_worker":
            live.remove(target)


def _check_autoscaler(s: Scenario, a: AutoscalerSpec) -> None:
    """The autoscaler's pool exists and starts within its bounds, its largest cluster stays within the rank limit,
    and chaos names only workers whose ids are known before the run (the autoscaler's workers take ids as they
    start)."""
    pools = s.cluster.pools()
    pool = a.managed_pool(s.cluster)
    if pool not in pools:
        raise InvalidArgument(f"autoscaler.pool {pool} is not a pool of this cluster (pools: {', '.join(pools)})",
                              field="autoscaler.pool")
    n, dp, _ = pools[pool]
    if not a.min_workers <= n <= a.max_workers:
        raise InvalidArgument(f"the {pool} pool starts with {counted(n, 'worker')}, outside autoscaler.min_workers.."
                              f"max_workers ({a.min_workers}..{a.max_workers})", field="autoscaler.min_workers"
                              if n < a.min_workers else "autoscaler.max_workers")
    adds = sum(ev.action == "add_worker" for ev in s.chaos)
    last = list(pools)[-1]  # where chaos adds workers
    ranks = sum(w * d for p, (w, d, _) in pools.items() if p != pool) + a.max_workers * dp
    ranks += adds * pools[last][1]
    workers = sum(w for p, (w, _, _) in pools.items() if p != pool) + a.max_workers + adds
    if workers > MAX_WORKERS:
        raise InvalidArgument(f"with autoscaler.max_workers {a.max_workers} and the chaos timeline's {adds} added "
                              f"workers, the cluster could reach {workers} workers, more than the {MAX_WORKERS} a "
                              "router registers", field="autoscaler.max_workers")
    if ranks > MAX_RANKS:
        raise InvalidArgument(f"with autoscaler.max_workers {a.max_workers} ({dp} DP ranks each) and the chaos "
                              f"timeline's {adds} added workers, the cluster could reach {ranks} ranks, more than "
                              f"the {MAX_RANKS} a scenario may start", field="autoscaler.max_workers")
    initial = sum(w for w, _, _ in pools.values())
    for i, ev in enumerate(s.chaos):
        if ev.worker is not None and ev.worker >= initial:
            raise InvalidArgument(f"chaos[{i}] ({ev.action} at {ev.at_s:g} s) names worker {ev.worker}: with an "
                                  f"autoscaler, only the {initial} initial workers (0..{initial - 1}) have ids known "
                                  "before the run", field=f"chaos[{i}].worker")


def _check_synthetic(w: SyntheticWorkload, run: RunSpec) -> None:
    """Bound what synthesis builds up front: requests, the longest prompt and the token lists, on average."""
    duration = run.duration_s if run.duration_s is not None else 60.0
    sessions = w.rate_rps * duration
    per_session = w.turns * (1 + w.sub_agents)
    if run.max_requests is not None:
        sessions = min(sessions, run.max_requests / per_session + 1)
    isl, osl = (min(max(d.mean, d.low), d.high) for d in (w.isl, w.osl))
    last_prompt = w.system_prefix_tokens + w.turns * isl + (w.turns - 1) * osl
    if last_prompt > MAX_PROMPT_TOKENS:
        raise InvalidArgument(f"a session's last prompt would average {last_prompt:,.0f} tokens (system prefix + turns x "
                              f"(isl + osl)), more than the {MAX_PROMPT_TOKENS:,} kvemu simulates", field="workload.turns")
    if sessions * per_session > MAX_REQUESTS:
        raise InvalidArgument(f"about {sessions * per_session:,.0f} requests (rate_rps x duration_s x turns x "
                              f"(1 + sub_agents)), more than the {MAX_REQUESTS:,} a scenario may send; lower the rate "
                              "or the duration, or set run.max_requests", field="workload.rate_rps")
    slots = sessions * (1 + w.sub_agents) * w.turns * (w.system_prefix_tokens + (w.turns + 1) * (isl + osl) / 2)
    if slots > MAX_SYNTHETIC_TOKENS:
        raise InvalidArgument(f"the workload would generate about {slots:,.0f} prompt tokens up front, more than "
                              f"{MAX_SYNTHETIC_TOKENS:,}; lower the rate, duration, turns or lengths, or set "
                              "run.max_requests", field="workload.rate_rps")


# ---------------------------------------------------------------------------------- loading


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides (values parsed as YAML scalars) to raw scenario data."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ScenarioError(f"--set {item!r}: expected key.path=value")
        value = yaml.safe_load(raw) if raw else ""
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ScenarioError(f"--set {key}: {part} is not a mapping")
            node = child
        node[parts[-1]] = value
    return data


def parse_scenario(text: str, *, base_dir: str | Path = ".", overrides: list[str] | None = None,
                   source: str = "<scenario>") -> Scenario:
    """Validate scenario YAML text; raises ``ScenarioError`` naming the key path and line."""
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{source}: not valid YAML: {exc}") from None
    except RecursionError:
        raise ScenarioError(f"{source}: nested too deeply to be a scenario") from None
    if not isinstance(raw, dict):
        raise ScenarioError(f"{source}: the scenario must be a mapping of sections, got {type(raw).__name__}")
    if file_kind(raw) == "sweep":
        raise ScenarioError(f"{source}: a sweep file (it has axes:), not a scenario: run it with kvemu sweep {source}")
    apply_overrides(raw, overrides or [])
    workload = raw.get("workload")
    if isinstance(workload, dict) and "kind" not in workload:  # after the overrides: they may add the section
        workload["kind"] = "trace" if "trace" in workload else "synthetic"
    overridden = {item.partition("=")[0] for item in overrides or []}
    floats_where_expected(raw, Scenario)
    raw["base_dir"] = str(base_dir)
    for where in _ENGINES:
        timing = value_at(raw, [*where, "timing_model"])[1]
        if isinstance(timing, dict) and isinstance(timing.get("path"), str) and timing["path"]:
            timing["path"] = str(_resolve_in(base_dir, timing["path"]))  # engines may run in another directory
    cluster_raw = raw.get("cluster")
    if isinstance(cluster_raw, dict) and ("prefill" in cluster_raw or "decode" in cluster_raw):
        for key in ("workers", "dp_size", "engine"):
            if key in cluster_raw:
                at = key_location(text, ["cluster", key], overridden)
                raise ScenarioError(f"{source}: cluster.{key}{at}: a disaggregated cluster sizes each pool: set "
                                    f"cluster.prefill.{key} and cluster.decode.{key} instead")
    try:
        scenario = msgspec.convert(raw, Scenario, strict=True)
    except msgspec.ValidationError as exc:
        raise ScenarioError(describe_validation_error(exc, raw, text, source, schema=Scenario,
                                                      overridden=overridden)) from None
    except InvalidArgument as exc:
        raise ScenarioError(f"{source}: {exc}") from None
    for where in _ENGINES:
        spec = value_at(msgspec.to_builtins(scenario), [*where, "timing_model"])[1]
        if isinstance(spec, dict) and spec.get("type") == "interpolated":
            try:
                cached_profile_timing(spec["path"])  # read once now: a bad profile is refused before anything runs
            except InvalidArgument as exc:
                at = key_location(text, [*where, "timing_model", "path"], overridden)
                raise ScenarioError(f"{source}: {'.'.join(where)}.timing_model.path{at}: {exc}") from None
    if isinstance(scenario.workload, TraceWorkload):
        path = resolve(scenario, scenario.workload.trace)
        if not path.is_file():
            at = key_location(text, ["workload", "trace"], overridden)
            raise ScenarioError(f"{source}: workload.trace{at}: file not found: {path}")
    return scenario


_ENGINES: list[list[str]] = [["cluster", "engine"], ["cluster", "prefill", "engine"], ["cluster", "decode", "engine"]]
"""Where engine sections are in a scenario."""
PATH_KEYS = ("workload.trace", *(".".join(map(str, [*where, "timing_model", "path"])) for where in _ENGINES))
"""Scenario keys that name files (relative to the scenario file, or, given with ``--set``, to the working
directory)."""


def paths_from_cwd(overrides: list[str], cwd: str | Path | None = None) -> list[str]:
    """``--set`` overrides with the relative paths they give (``PATH_KEYS``, also inside a mapping value) made
    absolute against ``cwd`` (default: the working directory): a path typed on a command line means one from
    where it was typed, not from the scenario's folder."""
    base = Path.cwd() if cwd is None else Path(cwd)
    out = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if sep and key and raw:
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError:
                value = None  # apply_overrides reports it
            for path_key in PATH_KEYS:
                if path_key == key and isinstance(value, str) and value:
                    value = str(_resolve_in(base, value))
                    item = f"{key}={json.dumps(value)}"  # JSON is YAML: the path stays a string
                elif path_key.startswith(key + ".") and isinstance(value, dict):  # e.g. a whole timing_model
                    node: Any = value
                    *parents, leaf = path_key[len(key) + 1:].split(".")
                    for part in parents:
                        node = node.get(part) if isinstance(node, dict) else None
                    if isinstance(node, dict) and isinstance(node.get(leaf), str) and node[leaf]:
                        node[leaf] = str(_resolve_in(base, node[leaf]))
                        item = f"{key}={json.dumps(value)}"
        out.append(item)
    return out


_SCENARIO_KEYS = frozenset(("cluster", "router", "workload", "run", "chaos", "autoscaler"))
"""Top-level keys only a scenario has."""


def file_kind(raw: Any) -> Literal["scenario", "sweep"] | None:
    """What a parsed YAML file is by its top-level keys (a sweep has ``axes``, a scenario sections such as
    ``cluster``; None: cannot tell), so that a file given to the wrong command gets told which command it is for."""
    if not isinstance(raw, dict):
        return None
    scenario, sweep = bool(_SCENARIO_KEYS & raw.keys()), "axes" in raw
    return "scenario" if scenario and not sweep else "sweep" if sweep and not scenario else None


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    """Read and validate a scenario file."""
    p = Path(path)
    text = read_text_file(p, "scenario")
    return parse_scenario(text, base_dir=p.resolve().parent, overrides=overrides, source=str(p))


def read_text_file(path: Path, what: str, limit: int | None = None) -> str:
    """The UTF-8 text of a small input file (a ``what``: scenario, sweep); ``ScenarioError`` past ``limit`` bytes
    (default ``MAX_SCENARIO_BYTES``)."""
    limit = MAX_SCENARIO_BYTES if limit is None else limit
    try:
        with path.open("rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read the {what}: {exc.strerror}") from None
    if len(data) > limit:
        raise ScenarioError(f"{path}: larger than {limit:,} bytes; is it a {what}?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ScenarioError(f"{path}: line {line}: not UTF-8 text") from None


def resolve(scenario: Scenario, path: str) -> Path:
    """A path from the scenario, resolved against its directory."""
    return _resolve_in(scenario.base_dir, path)


def _resolve_in(base_dir: str | Path, path: str) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(base_dir) / p


def default_scenario_text() -> str:
    """The built-in default scenario (also ``examples/quickstart.yaml``), shipped as package data."""
    return resources.files("harness").joinpath("quickstart.yaml").read_text(encoding="utf-8")
