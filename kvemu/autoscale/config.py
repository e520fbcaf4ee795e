"""The autoscaler's knobs: how it is run (tick, window, bounds, delays) and the built-in policy's targets."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvemu.errors import InvalidArgument
from kvemu.limits import FilePath
from kvemu.validation import check_struct

__all__ = ["AutoscaleConfig", "MAX_AUTOSCALE_S"]

MAX_AUTOSCALE_S = 3.2e8
"""Longest interval, window, delay or cooldown (about ten years, the longest scenario)."""

Interval = Annotated[float, Meta(ge=0.1, le=MAX_AUTOSCALE_S)]
Seconds = Annotated[float, Meta(ge=0, le=MAX_AUTOSCALE_S)]
Workers = Annotated[int, Meta(ge=1, le=1 << 16)]
Target = Annotated[float, Meta(gt=0, le=1e9)]


class AutoscaleConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One autoscaler: its policy, the pool it scales, its tick and bounds, and the built-in policy's targets.

    Bounds are declared once (``msgspec.Meta``): a scenario and a Python caller are held to the same ranges.
    """

    max_workers: Workers
    """Most workers the pool may have running or starting; an add beyond it is clamped."""
    policy: FilePath = "builtin"
    """``builtin`` (``LoadSlaAutoscaler``) or ``module:callable``: called with this config, returns an ``Autoscaler``."""
    pool: Literal["aggregated", "prefill", "decode"] | None = None
    """The pool it scales (default: the aggregated pool, or the decode pool of a disaggregated cluster)."""
    interval_s: Interval = 10.0
    """The policy is asked every this much scenario time (first at ``interval_s``)."""
    window_s: Interval | None = None
    """Latency percentiles, arrivals and failures cover the requests of the last ``window_s`` (default: ``interval_s``)."""
    startup_delay_s: Seconds = 30.0
    """From an add decision to the worker starting to register; it is ``starting`` (and costs GPU time) meanwhile."""
    cooldown_s: Seconds = 60.0
    """No add within this long after a removal, and no removal within this long after an add."""
    min_workers: Workers = 1
    """Fewest workers running or starting: a removal below it is clamped, and workers lost below it (chaos) are
    replaced at the next tick whatever the cooldown."""
    graceful: bool = True
    """Removed workers drain (finish what they run) before they go; false: they stop at once."""
    target_queue_per_worker: Target | None = 2.0
    """Built-in policy: requests waiting (router queue + engine waiting) per running worker."""
    target_kv_usage: Annotated[float, Meta(gt=0, le=1)] | None = 0.8
    """Built-in policy: mean share of a running rank's KV blocks held by its active requests (router's view)."""
    target_active_per_worker: Target | None = None
    """Built-in policy: requests routed and not ended per running worker."""
    target_ttft_ms: Target | None = None
    """Built-in policy: p90 time to first token of the requests completed in the window."""
    target_itl_ms: Target | None = None
    """Built-in policy: p90 inter-token latency of the requests completed in the window."""
    scale_down_below: Annotated[float, Meta(gt=0, lt=1)] = 0.6
    """Built-in policy: remove a worker when every signal would stay below this share of its target without it."""
    max_scale_up: Annotated[int, Meta(ge=1, le=1 << 16)] = 2
    """Built-in policy: most workers added at one tick."""

    def __post_init__(self) -> None:
        check_struct(self)
        if self.min_workers > self.max_workers:
            raise InvalidArgument(f"min_workers ({self.min_workers}) must be <= max_workers ({self.max_workers})",
                                  field="min_workers")
        if self.policy != "builtin" and not re.fullmatch(r"[\w.]+:\w+", self.policy):
            raise InvalidArgument(f"policy must be builtin or module:callable, got {self.policy!r}", field="policy")

    @property
    def window(self) -> float:
        """The window in seconds (``window_s``, else ``interval_s``)."""
        return self.window_s if self.window_s is not None else self.interval_s
