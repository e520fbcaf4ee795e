"""Clocks: integer nanoseconds from wall time or from a host that advances virtual time.

Every policy object takes its clock at construction, so the same code runs live and in simulation.
This is the only module of kvemu that reads the system clock.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

from kvemu.errors import InvalidArgument

__all__ = [
    "MAX_TIME_NS",
    "NS_PER_S",
    "NS_PER_MS",
    "Clock",
    "WallClock",
    "ManualClock",
    "seconds_to_ns",
    "ns_to_seconds",
    "check_deadline",
]

NS_PER_S = 1_000_000_000
"""Nanoseconds in a second, the unit every kvemu time is counted in."""
NS_PER_MS = 1_000_000
"""Nanoseconds in a millisecond."""
MAX_TIME_NS = 2**63 - 1
"""Largest representable instant; any deadline beyond it is rejected rather than wrapped."""


def seconds_to_ns(seconds: float) -> int:
    """Convert seconds (int or float) to integer nanoseconds, rounding to the nearest nanosecond."""
    if seconds != seconds:  # NaN
        raise InvalidArgument("seconds must be a number, got NaN", field="seconds")
    scaled = seconds * NS_PER_S  # an infinite float (or one too large to round) is out of range too
    ns = round(scaled) if -MAX_TIME_NS <= scaled <= MAX_TIME_NS else MAX_TIME_NS + 1
    if not -MAX_TIME_NS <= ns <= MAX_TIME_NS:
        raise InvalidArgument(f"{seconds!r} s is outside the clock range of ±{MAX_TIME_NS} ns", field="seconds")
    return ns


def ns_to_seconds(ns: int) -> float:
    """Convert integer nanoseconds to float seconds (for display and reports)."""
    return ns / NS_PER_S


def check_deadline(now_ns: int, delta_ns: int, what: str) -> int:
    """Return ``now_ns + delta_ns``, or raise ``InvalidArgument`` naming ``what`` if it overflows."""
    if delta_ns < 0:
        raise InvalidArgument(f"{what}: negative duration {delta_ns} ns")
    if now_ns > MAX_TIME_NS - delta_ns:
        raise InvalidArgument(f"{what}: deadline {now_ns} + {delta_ns} ns exceeds the clock maximum {MAX_TIME_NS} ns")
    return now_ns + delta_ns


@runtime_checkable
class Clock(Protocol):
    """A source of monotonic time in integer nanoseconds."""

    def now_ns(self) -> int:
        """Current time in nanoseconds; never decreases."""
        ...

    @property
    def is_virtual(self) -> bool:
        """True when a host advances this clock (no reapers or sleeps should be started)."""
        ...


class WallClock:
    """Monotonic wall time (``time.monotonic_ns``), for live mode."""

    __slots__ = ()
    is_virtual = False

    def now_ns(self) -> int:
        """Current monotonic wall time in nanoseconds."""
        return time.monotonic_ns()

    @staticmethod
    def unix_s() -> int:
        """Seconds since the Unix epoch (the ``created`` field of OpenAI responses); never for intervals."""
        return int(time.time())

    def __repr__(self) -> str:
        return "WallClock()"


class ManualClock:
    """Virtual time that only moves when the host says so; going backwards is an error."""

    __slots__ = ("_now",)
    is_virtual = True

    def __init__(self, start_ns: int = 0) -> None:
        if not isinstance(start_ns, int) or not 0 <= start_ns <= MAX_TIME_NS:
            raise InvalidArgument(f"start_ns must be an integer in [0, {MAX_TIME_NS}], got {start_ns!r}", field="start_ns")
        self._now = start_ns

    def now_ns(self) -> int:
        """Current virtual time in nanoseconds."""
        return self._now

    def advance(self, delta_ns: int) -> int:
        """Move time forward by ``delta_ns`` (≥ 0) and return the new time."""
        if not isinstance(delta_ns, int):
            raise InvalidArgument(f"delta_ns must be an integer number of nanoseconds, got {delta_ns!r}", field="delta_ns")
        self._now = check_deadline(self._now, delta_ns, "ManualClock.advance")
        return self._now

    def advance_to(self, t_ns: int) -> int:
        """Move time forward to ``t_ns`` (≥ now) and return it."""
        if not isinstance(t_ns, int):
            raise InvalidArgument(f"t_ns must be an integer number of nanoseconds, got {t_ns!r}", field="t_ns")
        if t_ns < self._now:
            raise InvalidArgument(f"ManualClock.advance_to: {t_ns} ns is before the current time {self._now} ns",
                                  field="t_ns")
        if t_ns > MAX_TIME_NS:
            raise InvalidArgument(f"ManualClock.advance_to: {t_ns} ns exceeds the clock maximum {MAX_TIME_NS} ns",
                                  field="t_ns")
        self._now = t_ns
        return t_ns

    def __repr__(self) -> str:
        return f"ManualClock(now_ns={self._now})"
