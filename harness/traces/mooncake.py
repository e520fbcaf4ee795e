"""Deprecated alias of ``harness.workload.traces.mooncake`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.traces.mooncake import (
    DEFAULT_MODEL, MooncakeRow, mooncake_row, read_mooncake, mooncake_request, MooncakeTurn, mooncake_turns, load_mooncake, load_mooncake_delta, mooncake_rows, mooncake_delta_rows,
)

__all__ = [
    "DEFAULT_MODEL",
    "MooncakeRow",
    "mooncake_row",
    "read_mooncake",
    "mooncake_request",
    "MooncakeTurn",
    "mooncake_turns",
    "load_mooncake",
    "load_mooncake_delta",
    "mooncake_rows",
    "mooncake_delta_rows",
]

warnings.warn("harness.traces.mooncake is deprecated: import from harness.workload.traces.mooncake",
              DeprecationWarning, stacklevel=2)
