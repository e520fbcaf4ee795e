"""A run's progress line: the phase it is in, what is counted so far, and when it should end.

One ``RunProgress`` follows a run (``kvemu run``'s bar, ``kvemu loadgen``'s lines on a terminal): the workload
generator counts the requests it made (``generated``), then the runner reports each sample (``running``, the
runner's ``Progress`` callback); ``line()`` says it in words. Progress goes to stderr only: no report changes.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from harness.scenario import Scenario, SyntheticWorkload

__all__ = ["RunProgress", "GENERATING", "RUNNING", "PROGRESS_EVERY_S", "eta_text", "expected_requests", "workload_end_s", "for_scenario",
           "print_progress"]

GENERATING = "generating the workload"
RUNNING = "running"

PROGRESS_EVERY_S = 5.0
"""On a terminal, a load generator prints its progress line this often."""
MIN_ETA_WALL_S = 1.0
"""An ETA is given once the run has gone this long (wall time): before, a rate says little."""


class RunProgress:
    """What a run has done so far, read by whoever shows it (another thread may call ``line`` at any time)."""

    def __init__(self, *, end_s: float | None = None, expected: int | None = None,
                 wall: Callable[[], float] = time.monotonic) -> None:
        self.phase = GENERATING
        self.end_s = end_s
        """When the workload's last request arrives, in scenario time, when known (``run.duration_s``)."""
        self.made = 0
        self.expected = expected
        """About how many requests generation makes, when known in advance (a synthetic workload)."""
        self.done = 0
        self.total: int | None = None
        self.scenario_s = 0.0
        self._wall = wall
        self._phase_wall = wall()
        self._run_wall: float | None = None
        self._seen_wall = self._phase_wall
        """When ``running`` last told of the run (its rates are measured up to then, not to now)."""
        self._run_from_s = 0.0
        """The scenario time of the run's first news."""

    def enter(self, phase: str) -> None:
        """A phase between generating and running (waiting for a router), or after (writing the report)."""
        self.phase, self._phase_wall = phase, self._wall()

    def generated(self, n: int) -> None:
        """The workload generator made ``n`` more requests."""
        self.made += n

    def running(self, now_ns: int, done: int, total: int) -> None:
        """The run's state at scenario time ``now_ns`` (the runner's ``Progress`` callback)."""
        self._seen_wall = self._wall()
        if self._run_wall is None:
            self._run_wall = self._phase_wall = self._seen_wall
            self._run_from_s = now_ns / 1e9  # (a live run's first news may come a moment into it)
            self.phase = RUNNING
        self.scenario_s, self.done, self.total = now_ns / 1e9, done, total

    def fraction(self) -> float | None:
        """How far the run is, in [0, 1]: its scenario time over the workload's end while requests still arrive,
        then the requests done over all of them; None before it runs."""
        if self.phase != RUNNING:
            return None
        if self.end_s and self.scenario_s < self.end_s:
            return self.scenario_s / self.end_s
        return self.done / self.total if self.total else None

    def _measured_s(self) -> float:
        """Wall seconds from the run's start to its last news."""
        return self._seen_wall - self._run_wall if self._run_wall is not None else 0.0

    def eta_s(self) -> float | None:
        """Wall seconds left, counted down since the run's last news (None: not known yet): while requests still
        arrive, the scenario time left at the speed scenario time has gone (virtual time runs faster than the
        wall); after, the requests left at the rate requests were done."""
        spent = self._measured_s()
        if self.phase != RUNNING or spent < MIN_ETA_WALL_S:
            return None
        if self.end_s and self.scenario_s < self.end_s:
            speed = (self.scenario_s - self._run_from_s) / spent
            if speed <= 0:
                return None
            left = (self.end_s - self.scenario_s) / speed
        else:
            f = self.fraction()
            if not f:
                return None
            left = spent * (1 - min(f, 1.0)) / f
        return max(0.0, left - (self._wall() - self._seen_wall))

    def line(self) -> str:
        """The progress line: the phase, its counts, and (running) scenario time, its speed and the ETA."""
        spent = self._wall() - self._phase_wall
        if self.phase == GENERATING:
            of = f" (of ~{self.expected:,})" if self.expected else ""
            return f"{GENERATING}: {self.made:,} requests so far{of}, {_duration(spent)}"
        if self.phase != RUNNING:
            return f"{self.phase}, {_duration(spent)}"
        total = f"{self.total:,}" if self.total is not None else "?"
        parts = [f"{RUNNING}: {self.done:,}/{total} requests",
                 f"t={_duration(self.scenario_s)}" + (f" of {_duration(self.end_s)}" if self.end_s else "")]
        if self._measured_s() >= MIN_ETA_WALL_S:
            parts.append(f"{(self.scenario_s - self._run_from_s) / self._measured_s():,.1f}x real time")
        parts.append(eta_text(self.eta_s()))
        return ", ".join(parts)


def eta_text(seconds: float | None) -> str:
    """``ETA 45s``, ``ETA 3m05s``, ``ETA 1h02m``; ``ETA --`` when not known yet."""
    if seconds is None:
        return "ETA --"
    return f"ETA {_duration(seconds)}"


def _duration(seconds: float) -> str:
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def expected_requests(scenario: Scenario) -> int | None:
    """About how many requests a synthetic workload makes (its mean rate over the run, each session's turns and
    their sub-agents); None for a trace (its rows are counted as they are read)."""
    w = scenario.workload
    if not isinstance(w, SyntheticWorkload):
        return None
    duration = scenario.run.duration_s if scenario.run.duration_s is not None else 60.0
    per_session = w.turns * (1 + w.sub_agents)
    expected = round(w.rate_rps * duration) * per_session
    if scenario.run.max_requests is not None:
        expected = min(expected, scenario.run.max_requests * (1 + w.sub_agents))
    return expected


def workload_end_s(scenario: Scenario) -> float | None:
    """When the workload's last request may arrive, in scenario time, when the scenario says it."""
    if scenario.run.duration_s is not None:
        return scenario.run.duration_s
    return 60.0 if isinstance(scenario.workload, SyntheticWorkload) else None


def for_scenario(scenario: Scenario, wall: Callable[[], float] = time.monotonic) -> RunProgress:
    """A ``RunProgress`` for a run of ``scenario``, with what is known before it runs."""
    return RunProgress(end_s=workload_end_s(scenario), expected=expected_requests(scenario), wall=wall)


def print_progress(progress: RunProgress, who: str, every_s: float, out: TextIO | None = None) -> threading.Event:
    """Print ``who: LINE`` on ``out`` (stderr) now and every ``every_s`` seconds until the returned event is set
    (a daemon thread: a run on a terminal is never silent for long)."""
    stop = threading.Event()
    stream = out if out is not None else sys.stderr

    def tick() -> None:
        while True:
            print(f"{who}: {progress.line()}", file=stream, flush=True)
            if stop.wait(every_s):
                return

    threading.Thread(target=tick, daemon=True, name="progress").start()
    return stop
