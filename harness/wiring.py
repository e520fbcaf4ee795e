"""Deprecated alias of ``harness.run.wiring`` (a run's modules have their folder now), kept for one release."""

import warnings

from harness.run.wiring import (
    MemoryWiring, Wiring, ZmqWiring, liveness_observable, replay_observable, wiring_for,
)

__all__ = [
    "MemoryWiring",
    "Wiring",
    "ZmqWiring",
    "liveness_observable",
    "replay_observable",
    "wiring_for",
]

warnings.warn("harness.wiring is deprecated: import from harness.run.wiring",
              DeprecationWarning, stacklevel=2)
