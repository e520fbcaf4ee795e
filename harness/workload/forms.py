"""The forms a workload takes, as one type: ``Sessions``. Each is a ``harness.workload.turns.Workload`` (what callers
ask of it); only ``play_workload``, which picks the player, asks which one it is."""

from harness.workload.trace_sessions import TraceSessions
from harness.workload.traces.graph import TraceGraph
from harness.workload.turns import SessionList, Workload

__all__ = ["Sessions", "Workload"]

Sessions = SessionList | TraceSessions | TraceGraph
"""What a workload plays: sessions of turns (a list, or a loaded trace's kept column-wise), or a trace's
dependency graph (``harness.workload.traces``)."""
