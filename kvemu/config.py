"""Router configuration: the ``KvRouterConfig`` knobs with Dynamo's defaults, and per-request overrides."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvemu.errors import InvalidArgument
from kvemu.limits import INT64_MAX, MAX_SECONDS, Weight
from kvemu.validation import check_struct

__all__ = ["RouterConfig", "RouterOverrides", "BusyThresholds", "QueuePolicyName"]

QueuePolicyName = Literal["fcfs", "lcfs", "wspt"]
"""Ordering inside a queue class: first come first served, last come first served, or Smith's rule."""

NonNeg = Annotated[float, Meta(ge=0)]
Fraction = Annotated[float, Meta(gt=0, le=1)]
Positive = Annotated[float, Meta(gt=0, le=MAX_SECONDS)]


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Cost-model, tracking and queue knobs of the KV router (Dynamo ``KvRouterConfig`` names and defaults).

    Each knob's range is declared here once (``msgspec.Meta``): scenario files and Python construction
    check the same bounds.
    """

    overlap_score_credit: Weight = 1.0
    overlap_score_credit_decay: Weight = 0.0
    prefill_load_scale: Weight = 1.0
    decode_active_request_weight: Weight = 0.0
    host_cache_hit_weight: Weight = 0.75
    """Credit per host-tier extension block."""
    disk_cache_hit_weight: Weight = 0.25
    """Credit per disk/external-tier extension block."""
    shared_cache_multiplier: Weight = 0.0
    router_temperature: Weight = 0.0
    """Softmax temperature over normalised costs; 0 picks the cheapest rank."""
    use_kv_events: bool = True
    """False: no KV events; the router predicts caches from its own routing (approximate index)."""
    router_track_active_blocks: bool = True
    router_track_output_blocks: bool = False
    """Count a generated block on the rank each time a response crosses a block boundary."""
    router_assume_kv_reuse: bool = True
    router_track_prefill_tokens: bool = True
    router_ttl_secs: Positive = 120.0
    """How long the approximate index keeps a predicted block."""
    router_max_tree_size: Annotated[int, Meta(ge=1, le=INT64_MAX)] = 2**20
    """Approximate index: prune when it holds more (block, rank) entries than this..."""
    router_prune_target_ratio: Fraction = 0.8
    """...down to this fraction of ``router_max_tree_size``."""
    router_queue_threshold: Weight | None = None
    """Queue requests while every eligible rank's active prefill tokens exceed this fraction of its
    ``max_num_batched_tokens``; None admits every request at once."""
    router_queue_policy: QueuePolicyName = "fcfs"
    router_queue_limit_per_worker: Annotated[int, Meta(ge=1, le=INT64_MAX)] | None = None
    """Requests the queue holds per registered worker (Dynamo's ``request_queue_limit_per_worker``); one past
    it is rejected (``queue_rejected``; HTTP 429 at the front door). None: unbounded."""

    def __post_init__(self) -> None:
        check_struct(self)

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

    overlap_score_credit: Weight | None = None
    prefill_load_scale: Weight | None = None
    router_temperature: Weight | None = None
    assume_kv_reuse: bool | None = None
    track_prefill_tokens: bool | None = None
    shared_cache_multiplier: Weight | None = None
    overlap_score_weight: Weight | None = None

    def __post_init__(self) -> None:
        try:
            check_struct(self)
        except InvalidArgument as exc:
            raise InvalidArgument(f"router_config_override.{exc}", field=exc.field) from None


class BusyThresholds(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Overload ("busy") thresholds that exclude a rank from selection; all off by default.

    A rank is overloaded when any configured threshold is exceeded (OR semantics).
    """

    active_decode_blocks_frac: NonNeg | None = None
    """Fraction of the rank's KV capacity (``total_kv_blocks``) in active decode blocks."""
    active_prefill_tokens: Annotated[int, Meta(ge=0)] | None = None
    """Absolute active prefill tokens."""
    active_prefill_tokens_frac: NonNeg | None = None
    """Fraction of the rank's ``max_num_batched_tokens`` in active prefill tokens."""

    def __post_init__(self) -> None:
        try:
            check_struct(self)
        except InvalidArgument as exc:
            raise InvalidArgument(f"busy_thresholds.{exc}", field=exc.field) from None

    @property
    def enabled(self) -> bool:
        """Whether any threshold is configured."""
        return (
            self.active_decode_blocks_frac is not None
            or self.active_prefill_tokens is not None
            or self.active_prefill_tokens_frac is not None
        )
