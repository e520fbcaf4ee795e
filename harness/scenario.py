"""The scenario file: a cluster, a router, a workload, how to run it, and what to break.

Every field is typed (msgspec) and documented with its default. Loading rejects unknown keys, wrong
types, out-of-range values and missing files with an error naming the key path and its line; nothing
runs on an invalid scenario. ``--set key.path=value`` overrides are applied before validation.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from kvemu.errors import InvalidArgument, KvemuError
from workers.config import EngineConfig

__all__ = [
    "EngineSpec",
    "ClusterSpec",
    "AffinitySpec",
    "QueueSpec",
    "RouterSpec",
    "Distribution",
    "SyntheticWorkload",
    "TraceWorkload",
    "RunSpec",
    "ChaosEvent",
    "Scenario",
    "ScenarioError",
    "load_scenario",
    "parse_scenario",
    "apply_overrides",
    "default_scenario_text",
]

_STRUCT = dict(kw_only=True, forbid_unknown_fields=True, frozen=True)


class ScenarioError(KvemuError, ValueError):
    """An invalid scenario; the message names the key path (and line, when known)."""


def _check(cond: bool, path: str, message: str) -> None:
    if not cond:
        raise ScenarioError(f"{path}: {message}")


_ENGINE = EngineConfig()  # the single source of the engine's defaults and range checks


class EngineSpec(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """Mock engine settings, per DP rank (Dynamo mocker defaults, taken from ``EngineConfig``)."""

    num_gpu_blocks: int = _ENGINE.num_gpu_blocks
    block_size: int = _ENGINE.block_size
    max_num_seqs: int = _ENGINE.max_num_seqs
    max_num_batched_tokens: int = _ENGINE.max_num_batched_tokens
    enable_prefix_caching: bool = _ENGINE.enable_prefix_caching
    enable_chunked_prefill: bool = _ENGINE.enable_chunked_prefill
    speedup_ratio: float = _ENGINE.speedup_ratio
    """Prefill durations are divided by this; 0 means no engine delay at all."""
    decode_speedup_ratio: float = _ENGINE.decode_speedup_ratio
    preemption_mode: Literal["lifo", "fifo"] = _ENGINE.preemption_mode
    eviction: Literal["lru", "lineage"] = _ENGINE.eviction_policy

    def __post_init__(self) -> None:
        try:
            self.config(dp_size=1)
        except InvalidArgument as exc:  # its message starts with the field name
            field, _, rest = str(exc).partition(" ")
            raise ScenarioError(f"cluster.engine.{field}: {rest}") from None

    def config(self, dp_size: int) -> EngineConfig:
        """The engine configuration of every rank of a worker with ``dp_size`` ranks."""
        fields = msgspec.structs.asdict(self)
        fields["eviction_policy"] = fields.pop("eviction")
        return EngineConfig(dp_size=dp_size, **fields)


class ClusterSpec(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """The workers."""

    workers: int = 4
    dp_size: int = 1
    worker_type: Literal["aggregated", "prefill", "decode"] = "aggregated"
    engine: EngineSpec = EngineSpec()
    kv_events_version: str = "0.33"
    """vLLM version whose KV-event wire format the workers speak."""
    heartbeat_interval_s: float = 1.0

    def __post_init__(self) -> None:
        _check(self.workers >= 1, "cluster.workers", f"must be >= 1, got {self.workers}")
        _check(self.dp_size >= 1, "cluster.dp_size", f"must be >= 1, got {self.dp_size}")
        _check(self.heartbeat_interval_s > 0, "cluster.heartbeat_interval_s", "must be > 0")


class AffinitySpec(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """Session affinity (requests with a ``session_id`` or a parent session)."""

    enabled: bool = False
    ttl_secs: float = 300.0
    mode: Literal["hard", "soft"] = "hard"


class QueueSpec(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """The router's policy queue; off unless a threshold is set."""

    threshold: float | None = None
    """Busy when a rank's active prefill tokens exceed this."""
    threshold_frac: float | None = None
    """Busy when they exceed this fraction of ``max_num_batched_tokens``."""
    policy: Literal["fcfs", "lcfs", "wspt"] = "fcfs"


class RouterSpec(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """Routing policy and every KvRouterConfig-style knob."""

    policy: str = "kv"
    """``kv`` (default selector), ``round_robin``, ``random``, or ``module:callable`` returning a CustomPolicy."""
    overlap_score_credit: float = 1.0
    overlap_score_credit_decay: float = 0.0
    prefill_load_scale: float = 1.0
    decode_active_request_weight: float = 0.0
    router_temperature: float = 0.0
    use_kv_events: bool = True
    router_track_active_blocks: bool = True
    router_assume_kv_reuse: bool = True
    router_track_prefill_tokens: bool = True
    router_ttl_secs: float = 120.0
    kv_event_lag_ms: float = 0.0
    """Delay of the router's view of KV events (virtual mode)."""
    network_latency_ms: float = 0.0
    """One-way delivery latency between router and workers (virtual mode)."""
    retry_limit: int = 3
    heartbeat_timeout_s: float = 5.0
    seed: int | None = None
    """Seed of the router's tie-breaking generator (default: the run seed)."""
    affinity: AffinitySpec = AffinitySpec()
    queue: QueueSpec = QueueSpec()

    def __post_init__(self) -> None:
        _check(self.policy in ("kv", "round_robin", "random") or ":" in self.policy, "router.policy",
               f"must be kv, round_robin, random or module:callable, got {self.policy!r}")
        for name in ("kv_event_lag_ms", "network_latency_ms"):
            _check(getattr(self, name) >= 0, f"router.{name}", "must be >= 0")
        _check(self.retry_limit >= 0, "router.retry_limit", "must be >= 0")


class Distribution(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """A positive integer distribution: ``constant``, ``uniform`` [low, high], ``normal`` or ``lognormal``."""

    kind: Literal["constant", "uniform", "normal", "lognormal"] = "constant"
    mean: float = 512
    std: float = 0.0
    low: int = 1
    high: int = 1 << 20


class SyntheticWorkload(msgspec.Struct, tag="synthetic", tag_field="kind", **_STRUCT):  # type: ignore[call-arg]
    """Generated traffic: sessions of several turns, shared prefixes, sub-agents, pins."""

    arrival: Literal["poisson", "constant"] = "poisson"
    rate_rps: float = 4.0
    """New sessions per second."""
    isl: Distribution = Distribution(mean=1024, std=256, kind="normal", low=64, high=8192)
    """Tokens added to the conversation per turn (the first turn's prompt)."""
    osl: Distribution = Distribution(mean=128, std=32, kind="normal", low=8, high=2048)
    turns: int = 3
    think_time_s: float = 2.0
    system_prefix_tokens: int = 512
    num_prefix_groups: int = 4
    """Distinct system prompts; each session draws one."""
    sub_agents: int = 0
    """Sibling sub-agent requests per turn, sharing the parent session's sibling-group affinity."""
    pin_fraction: float = 0.0
    """Fraction of sessions whose requests pin an explicit worker."""
    vocab_size: int = 32000

    def __post_init__(self) -> None:
        _check(self.rate_rps > 0 and math.isfinite(self.rate_rps), "workload.rate_rps", "must be > 0")
        _check(self.turns >= 1, "workload.turns", "must be >= 1")
        _check(0 <= self.pin_fraction <= 1, "workload.pin_fraction", "must be in [0, 1]")
        _check(self.sub_agents >= 0, "workload.sub_agents", "must be >= 0")


class TraceWorkload(msgspec.Struct, tag="trace", tag_field="kind", **_STRUCT):  # type: ignore[call-arg]
    """Replay of a Mooncake-format JSONL trace (``timestamp`` or ``delay``, ``hash_ids``...)."""

    trace: str
    """Path of the JSONL file, relative to the scenario file unless absolute."""
    format: Literal["mooncake"] = "mooncake"
    trace_block_size: int = 512
    arrival_speedup_ratio: float = 1.0

    def __post_init__(self) -> None:
        _check(self.trace_block_size >= 1, "workload.trace_block_size", "must be >= 1")
        _check(self.arrival_speedup_ratio > 0, "workload.arrival_speedup_ratio", "must be > 0")


class RunSpec(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """How to run: mode, seed, and when to stop."""

    mode: Literal["virtual", "live"] = "virtual"
    seed: int = 0
    duration_s: float | None = None
    """Stop arrivals after this much scenario time, then drain."""
    max_requests: int | None = None
    drain_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        _check(self.duration_s is None or self.duration_s > 0, "run.duration_s", "must be > 0")
        _check(self.max_requests is None or self.max_requests >= 1, "run.max_requests", "must be >= 1")


class ChaosEvent(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """One scheduled fault."""

    at_s: float
    action: Literal["remove_worker", "add_worker", "kill_rank", "drop_kv_events", "delay_kv_events",
                    "slow_worker", "restart_router"]
    worker: int | None = None
    """Target worker id (``remove_worker``, ``kill_rank``, ``drop_kv_events``, ``slow_worker``)."""
    dp_rank: int = 0
    graceful: bool = True
    count: int = 1
    """Batches to drop (``drop_kv_events``)."""
    lag_ms: float = 0.0
    factor: float = 1.0
    """Slowdown factor (``slow_worker``): durations are multiplied by it."""

    def __post_init__(self) -> None:
        _check(self.at_s >= 0, "chaos.at_s", "must be >= 0")
        _check(self.factor > 0, "chaos.factor", "must be > 0")


class Scenario(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """A whole scenario file."""

    name: str = "scenario"
    cluster: ClusterSpec = ClusterSpec()
    router: RouterSpec = RouterSpec()
    workload: SyntheticWorkload | TraceWorkload = SyntheticWorkload()
    run: RunSpec = RunSpec()
    chaos: list[ChaosEvent] = []
    base_dir: str = "."
    """Directory relative paths resolve against (set by the loader)."""


# ---------------------------------------------------------------------------------- loading


def _line_of(text: str, path: list[str | int]) -> int | None:
    """1-based line of the key at ``path`` (or of its nearest existing ancestor)."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in path:
        if isinstance(node, yaml.MappingNode):
            entry = next(((k, v) for k, v in node.value if k.value == part), None)
            if entry is None:
                return line
            line = entry[0].start_mark.line + 1
            node = entry[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _parse_path(where: str) -> list[str | int]:
    parts: list[str | int] = []
    for piece in where.removeprefix("$").split("."):
        if not piece:
            continue
        while "[" in piece:
            head, _, rest = piece.partition("[")
            if head:
                parts.append(head)
            idx, _, piece = rest.partition("]")
            parts.append(int(idx))
        if piece:
            parts.append(piece)
    return parts


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
    if not isinstance(raw, dict):
        raise ScenarioError(f"{source}: the scenario must be a mapping of sections, got {type(raw).__name__}")
    workload = raw.get("workload")
    if isinstance(workload, dict) and "kind" not in workload:
        workload["kind"] = "trace" if "trace" in workload else "synthetic"
    apply_overrides(raw, overrides or [])
    raw["base_dir"] = str(base_dir)
    try:
        scenario = msgspec.convert(raw, Scenario, strict=True)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).partition(" - at `")
        key = where.rstrip("`").removeprefix("$.").removeprefix("$")
        checked = re.match(r"^([a-z_]+(?:\.[a-z_]+|\[\d+\])*): (.*)$", message)
        unknown = re.match(r"^Object contains unknown field `(.+)`$", message)
        if checked:  # one of our own range checks: it names the field itself
            named, message = checked.group(1), checked.group(2)
            plain = re.sub(r"\[\d+\]", "", key)
            key = key + named[len(plain):] if key and named.startswith(plain) else named
        elif unknown:
            key = f"{key}.{unknown.group(1)}" if key else unknown.group(1)
            message = "unknown key (check its spelling and section)"
        line = _line_of(text, _parse_path(key))
        at = f" (line {line})" if line else ""
        raise ScenarioError(f"{source}: {key or '(top level)'}{at}: {message}") from None
    except InvalidArgument as exc:
        raise ScenarioError(f"{source}: {exc}") from None
    if isinstance(scenario.workload, TraceWorkload):
        path = resolve(scenario, scenario.workload.trace)
        if not path.is_file():
            line = _line_of(text, ["workload", "trace"])
            at = f" (line {line})" if line else ""
            raise ScenarioError(f"{source}: workload.trace{at}: file not found: {path}")
    return scenario


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    """Read and validate a scenario file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ScenarioError(f"{p}: cannot read the scenario: {exc.strerror}") from None
    return parse_scenario(text, base_dir=p.resolve().parent, overrides=overrides, source=str(p))


def resolve(scenario: Scenario, path: str) -> Path:
    """A path from the scenario, resolved against its directory."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(scenario.base_dir) / p


def default_scenario_text() -> str:
    """The built-in default scenario (also ``examples/quickstart.yaml``)."""
    return (Path(__file__).parent / "quickstart.yaml").read_text()
