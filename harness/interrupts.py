"""Deprecated alias of ``harness.run.interrupts`` (a run's modules have their folder now), kept for one release."""

import warnings

from harness.run.interrupts import (
    RunSignals, Terminated, held_signals, terminate_as_interrupt,
)

__all__ = [
    "RunSignals",
    "Terminated",
    "held_signals",
    "terminate_as_interrupt",
]

warnings.warn("harness.interrupts is deprecated: import from harness.run.interrupts",
              DeprecationWarning, stacklevel=2)
