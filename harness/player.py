"""Deprecated alias of ``harness.workload.players`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.players import Player, Submit, awaiting

__all__ = ["Player", "Submit", "awaiting"]

warnings.warn("harness.player is deprecated: import from harness.workload.players",
              DeprecationWarning, stacklevel=2)
