"""The autoscaling protocol: what a policy is given and what it returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal, Protocol, runtime_checkable

import msgspec
from msgspec import Meta

from kvemu.autoscale.config import AutoscaleConfig
from kvemu.autoscale.snapshot import MetricsSnapshot
from kvemu.errors import InvalidArgument
from kvemu.validation import check_struct

__all__ = ["ScaleDecision", "Autoscaler", "AutoscalerFactory"]


class ScaleDecision(msgspec.Struct, frozen=True, kw_only=True):
    """Add ``count`` workers to a pool, or remove ``count`` (or the one ``worker_id`` names); ``reason`` is shown
    in the report."""

    action: Literal["add", "remove"]
    count: Annotated[int, Meta(ge=1, le=1 << 16)] = 1
    pool: str | None = None
    """The pool (None: the autoscaler's pool)."""
    worker_id: int | None = None
    """Remove this worker (``count`` must then be 1); None lets the governor pick the least busy."""
    reason: str = ""

    def __post_init__(self) -> None:
        check_struct(self)
        if self.worker_id is not None and (self.action != "remove" or self.count != 1):
            raise InvalidArgument("worker_id names one worker to remove: action remove, count 1", field="worker_id")


@runtime_checkable
class Autoscaler(Protocol):
    """A scaling policy: synchronous and free of I/O, asked at every tick."""

    def decide(self, snapshot: MetricsSnapshot) -> list[ScaleDecision]:
        """What to add or remove now (an empty list: nothing)."""
        ...


AutoscalerFactory = Callable[[AutoscaleConfig], Autoscaler]
"""What ``autoscaler.policy: module:callable`` names: called once with the config, returns the policy (a class
whose ``__init__`` takes the config is one)."""
