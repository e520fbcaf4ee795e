"""Deprecated alias of ``harness.run.progress`` (a run's modules have their folder now), kept for one release."""

import warnings

from harness.run.progress import (
    RunProgress, GENERATING, RUNNING, PROGRESS_EVERY_S, eta_text, expected_requests, workload_end_s, for_scenario, print_progress,
)

__all__ = [
    "RunProgress",
    "GENERATING",
    "RUNNING",
    "PROGRESS_EVERY_S",
    "eta_text",
    "expected_requests",
    "workload_end_s",
    "for_scenario",
    "print_progress",
]

warnings.warn("harness.progress is deprecated: import from harness.run.progress",
              DeprecationWarning, stacklevel=2)
