"""Deprecated alias of ``harness.run.routing_truth`` (a run's modules have their folder now), kept for one release."""

import warnings

from harness.run.routing_truth import (
    RoutingTruth, RegretJudge, MAX_SESSIONS,
)

__all__ = [
    "RoutingTruth",
    "RegretJudge",
    "MAX_SESSIONS",
]

warnings.warn("harness.routing_truth is deprecated: import from harness.run.routing_truth",
              DeprecationWarning, stacklevel=2)
