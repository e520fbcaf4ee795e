"""Deprecated alias of ``harness.workload.sessions`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.sessions import (
    Player, Played, SessionPlayer, GraphPlayer, Submit, awaiting, play_workload, drain_deadline_s,
)

__all__ = [
    "Player",
    "Played",
    "SessionPlayer",
    "GraphPlayer",
    "Submit",
    "awaiting",
    "play_workload",
    "drain_deadline_s",
]

warnings.warn("harness.sessions is deprecated: import from harness.workload.sessions",
              DeprecationWarning, stacklevel=2)
