"""What an autoscaler did over a run: its decisions and the worker counts over time (plain data for reports)."""

from __future__ import annotations

import msgspec

__all__ = ["ConfigValue", "DecisionRecord", "WorkerCount", "AutoscaleLog"]

ConfigValue = str | int | float | bool | None
"""A knob's value in ``AutoscaleLog.config`` (``AutoscaleConfig``'s knobs are all scalars)."""


class DecisionRecord(msgspec.Struct, kw_only=True):
    """One policy decision as the governor let it through; ``worker_ids``/``ready_ns`` fill in as workers start."""

    time_ns: int
    action: str
    """``add`` or ``remove``."""
    pool: str
    requested: int
    applied: int
    outcome: str
    """``applied``, ``clamped`` (fewer than requested) or ``refused`` (none)."""
    detail: str = ""
    """Why it was clamped or refused (``max_workers 6``, ``cooldown ...``), or ``min_workers floor``."""
    reason: str = ""
    """The policy's own text."""
    worker_ids: list[int] = []
    """Removed workers; for an add, the workers started, as each becomes routable."""
    ready_ns: list[int] = []
    """For an add: when each started worker became routable."""


class WorkerCount(msgspec.Struct, frozen=True):
    """A pool's workers by state from ``time_ns`` on (a step series point)."""

    time_ns: int
    pool: str
    running: int
    starting: int
    draining: int

    @property
    def provisioned(self) -> int:
        """Workers holding GPUs: running, starting or draining."""
        return self.running + self.starting + self.draining


class AutoscaleLog(msgspec.Struct, kw_only=True):
    """An autoscaled run's decisions and worker counts, with the config they ran under."""

    config: dict[str, ConfigValue] = {}
    """The ``AutoscaleConfig`` it ran under, knob by knob (as ``msgspec.to_builtins`` writes it)."""
    pool: str = "aggregated"
    decisions: list[DecisionRecord] = []
    series: list[WorkerCount] = []
