"""Deprecated alias of ``harness.run.runner`` (a run's modules have their folder now), kept for one release."""

import warnings

from harness.run.runner import (
    run_scenario, RunOutcome, RunAborted, NothingRan, Terminated, Progress, drain_deadline_s, count_requests,
)

__all__ = [
    "run_scenario",
    "RunOutcome",
    "RunAborted",
    "NothingRan",
    "Terminated",
    "Progress",
    "drain_deadline_s",
    "count_requests",
]

warnings.warn("harness.runner is deprecated: import from harness.run.runner",
              DeprecationWarning, stacklevel=2)
