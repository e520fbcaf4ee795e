"""Deprecated alias of ``harness.workload.turns`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.turns import Turn, Session, Sessions

__all__ = ["Turn", "Session", "Sessions"]

warnings.warn("harness.turns is deprecated: import from harness.workload.turns",
              DeprecationWarning, stacklevel=2)
