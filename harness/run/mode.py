"""The run's mode, chosen once: a virtual run (a manual clock driven by its own loop, as fast as the code goes) or
a live one (wall time from the run's start, on uvloop). ``run_mode`` is the one place of the runner that asks
which; the runner then only calls what the chosen mode offers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Literal, Protocol

from kvemu.clock import Clock, ManualClock, WallClock
from kvemu.runtime.loop import run_live, run_virtual

__all__ = ["MODES", "RunMode", "LiveRun", "VirtualRun", "run_mode"]

GroupUsage = Mapping[tuple[int, int], dict[int, int]]


class RunMode(Protocol):
    """What the runner needs of a mode: its clock (scenario time, 0 at the start), how to run the run's main
    coroutine, how often to sample, and whether the engines' per-group usage is read for the samples."""

    name: Literal["virtual", "live"]
    clock: Clock
    sample_interval_s: float
    opens_sockets: bool
    """Its router and KV events listen on this machine's sockets (which then want a secret)."""
    shares_the_machine: bool
    """Runs side by side with others would disturb each other (wall time is shared): no parallel sweeps."""
    young_gc_threshold: int
    """The run's first-generation collection threshold (``harness.tuning.tune_gc``)."""

    def run(self, main: Callable[[], Awaitable[None]]) -> None:
        """Run ``main()`` to its end on this mode's loop."""
        ...

    def engine_usage(self, usage: Callable[[], GroupUsage]) -> GroupUsage | None:
        """The engines' blocks per KV cache group for a sample, where the mode reads them (``usage()``)."""
        ...


class VirtualRun:
    """Virtual time: a manual clock its own loop advances; the engines are read in place for every sample."""

    name: Literal["virtual", "live"] = "virtual"
    sample_interval_s = 1.0
    opens_sockets = False
    shares_the_machine = False
    young_gc_threshold = 2_000_000
    """A virtual run's heap mostly grows while it plays, and each young collection walks every container that
    survived since the last one (token lists included): one in two million allocations leaves the one-hour trace
    with none (~5 % of its CPU before), while still bounding what a run that makes cycles can leave behind."""

    def __init__(self) -> None:
        self._clock = ManualClock()
        self.clock: Clock = self._clock

    def run(self, main: Callable[[], Awaitable[None]]) -> None:
        run_virtual(main, self._clock)

    def engine_usage(self, usage: Callable[[], GroupUsage]) -> GroupUsage | None:
        return usage()


class _ShiftedClock:
    """Wall time measured from the run's start, so both modes start at 0."""

    is_virtual = False

    def __init__(self, base: Clock) -> None:
        self._base = base
        self._t0 = base.now_ns()

    def now_ns(self) -> int:
        return self._base.now_ns() - self._t0


class LiveRun:
    """Wall time from the run's start on a uvloop loop; samples four times a second, without the engines' group
    usage (the engines move on while they would be read)."""

    name: Literal["virtual", "live"] = "live"
    sample_interval_s = 0.25
    opens_sockets = True
    shares_the_machine = True
    young_gc_threshold = 50_000

    def __init__(self) -> None:
        self.clock: Clock = _ShiftedClock(WallClock())

    def run(self, main: Callable[[], Awaitable[None]]) -> None:
        run_live(main)

    def engine_usage(self, usage: Callable[[], GroupUsage]) -> GroupUsage | None:
        return None


MODES: dict[str, type[VirtualRun] | type[LiveRun]] = {"virtual": VirtualRun, "live": LiveRun}
"""Each mode by its ``run.mode`` name; its class says its facts (``opens_sockets``, ``shares_the_machine``)
without starting a clock."""


def run_mode(name: Literal["virtual", "live"]) -> RunMode:
    """The mode a scenario's ``run.mode`` names (its clock starts now, for a live one)."""
    return MODES[name]()

