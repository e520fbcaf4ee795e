"""Deprecated alias of ``harness.workload.lanes`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.lanes import (
    LanePlayer, LaneFigures, Cancel, PRIMER, WARMUP, PROFILE, DEADLINE_REASON, WARMUP_FAILED_REASON, conversation_parents,
    snapshot_cut,
)

__all__ = [
    "LanePlayer",
    "LaneFigures",
    "Cancel",
    "PRIMER",
    "WARMUP",
    "PROFILE",
    "DEADLINE_REASON",
    "WARMUP_FAILED_REASON",
    "conversation_parents",
    "snapshot_cut",
]

warnings.warn("harness.lanes is deprecated: import from harness.workload.lanes",
              DeprecationWarning, stacklevel=2)
