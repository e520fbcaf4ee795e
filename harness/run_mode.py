"""Deprecated alias of ``harness.run.mode`` (a run's modules have their folder now), kept for one release."""

import warnings

from harness.run.mode import (
    MODES, RunMode, LiveRun, VirtualRun, run_mode,
)

__all__ = [
    "MODES",
    "RunMode",
    "LiveRun",
    "VirtualRun",
    "run_mode",
]

warnings.warn("harness.run_mode is deprecated: import from harness.run.mode",
              DeprecationWarning, stacklevel=2)
