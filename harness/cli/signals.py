"""What SIGINT and SIGTERM do while a command runs: the names of ``harness.run.interrupts``, where they live (the
runner and the load generators use them too), re-exported for the imports of this older path."""

from __future__ import annotations

from harness.run.interrupts import held_signals, terminate_as_interrupt

__all__ = ["held_signals", "terminate_as_interrupt"]
