"""Router configuration: the ``KvRouterConfig`` knobs with Dynamo's defaults, and per-request overrides."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from kvemu.errors import InvalidArgument

__all__ = ["RouterConfig", "RouterOverrides", "BusyThresholds", "QueuePolicyName"]

QueuePolicyName = Literal["fcfs", "lcfs", "wspt"]


def _finite_nonneg(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise InvalidArgument(f"{name} must be a finite number >= 0, got {value!r}")


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Cost-model and tracking knobs of the KV router (Dynamo ``KvRouterConfig`` names and defaults)."""

    overlap_score_credit: float = 1.0
    overlap_score_credit_decay: float = 0.0
    prefill_load_scale: float = 1.0
    decode_active_request_weight: float = 0.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    shared_cache_multiplier: float = 0.0
    router_temperature: float = 0.0
    use_kv_events: bool = True
    router_track_active_blocks: bool = True
    router_track_output_blocks: bool = False
    router_assume_kv_reuse: bool = True
    router_track_prefill_tokens: bool = True
    router_ttl_secs: float = 120.0
    router_max_tree_size: int = 2**20
    router_prune_target_ratio: float = 0.8
    router_queue_threshold: float | None = None
    router_queue_policy: QueuePolicyName = "fcfs"

    def __post_init__(self) -> None:
        for name in (
            "overlap_score_credit",
            "overlap_score_credit_decay",
            "prefill_load_scale",
            "decode_active_request_weight",
            "host_cache_hit_weight",
            "disk_cache_hit_weight",
            "shared_cache_multiplier",
            "router_temperature",
        ):
            _finite_nonneg(name, getattr(self, name))
        if not (math.isfinite(self.router_ttl_secs) and self.router_ttl_secs > 0):
            raise InvalidArgument(f"router_ttl_secs must be a finite number > 0, got {self.router_ttl_secs!r}")
        if self.router_max_tree_size < 1:
            raise InvalidArgument(f"router_max_tree_size must be >= 1, got {self.router_max_tree_size!r}")
        if not 0 < self.router_prune_target_ratio <= 1:
            raise InvalidArgument(
                f"router_prune_target_ratio must be in (0, 1], got {self.router_prune_target_ratio!r}"
            )
        if self.router_queue_threshold is not None:
            _finite_nonneg("router_queue_threshold", self.router_queue_threshold)

    def with_overrides(self, overrides: RouterOverrides | None) -> RouterConfig:
        """This config with a request's overrides applied (the legacy weight translated as Dynamo does)."""
        if overrides is None:
            return self
        changes: dict[str, object] = {}
        if overrides.overlap_score_weight is not None:
            changes["prefill_load_scale"] = overrides.overlap_score_weight
            if overrides.overlap_score_weight == 0:
                changes["overlap_score_credit"] = 0.0
        for src, dst in (
            ("overlap_score_credit", "overlap_score_credit"),
            ("prefill_load_scale", "prefill_load_scale"),
            ("router_temperature", "router_temperature"),
            ("assume_kv_reuse", "router_assume_kv_reuse"),
            ("track_prefill_tokens", "router_track_prefill_tokens"),
            ("shared_cache_multiplier", "shared_cache_multiplier"),
        ):
            value = getattr(overrides, src)
            if value is not None:
                changes[dst] = value
        return msgspec.structs.replace(self, **changes) if changes else self


class RouterOverrides(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-request ``router_config_override`` fields; ``None`` keeps the router's value."""

    overlap_score_credit: float | None = None
    prefill_load_scale: float | None = None
    router_temperature: float | None = None
    assume_kv_reuse: bool | None = None
    track_prefill_tokens: bool | None = None
    shared_cache_multiplier: float | None = None
    overlap_score_weight: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "overlap_score_credit",
            "prefill_load_scale",
            "router_temperature",
            "shared_cache_multiplier",
            "overlap_score_weight",
        ):
            value = getattr(self, name)
            if value is not None:
                _finite_nonneg(f"router_config_override.{name}", value)


class BusyThresholds(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Overload ("busy") thresholds that exclude a rank from selection; all off by default.

    A rank is overloaded when any configured threshold is exceeded (OR semantics).
    """

    active_decode_blocks_frac: float | None = None
    """Fraction of the rank's KV capacity (``total_kv_blocks``) in active decode blocks."""
    active_prefill_tokens: int | None = None
    """Absolute active prefill tokens."""
    active_prefill_tokens_frac: float | None = None
    """Fraction of the rank's ``max_num_batched_tokens`` in active prefill tokens."""

    def __post_init__(self) -> None:
        for name in ("active_decode_blocks_frac", "active_prefill_tokens", "active_prefill_tokens_frac"):
            value = getattr(self, name)
            if value is not None:
                _finite_nonneg(f"busy_thresholds.{name}", value)

    @property
    def enabled(self) -> bool:
        """Whether any threshold is configured."""
        return (
            self.active_decode_blocks_frac is not None
            or self.active_prefill_tokens is not None
            or self.active_prefill_tokens_frac is not None
        )
