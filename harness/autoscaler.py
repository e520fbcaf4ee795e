"""Deprecated alias of ``harness.run.autoscaler`` (a run's modules have their folder now), kept for one release."""

import warnings

from harness.run.autoscaler import (
    make_autoscaler, AutoscalerShell,
)

__all__ = [
    "make_autoscaler",
    "AutoscalerShell",
]

warnings.warn("harness.autoscaler is deprecated: import from harness.run.autoscaler",
              DeprecationWarning, stacklevel=2)
