"""Deprecated alias of ``harness.workload.traces.graph`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.traces.graph import (
    grouped, successors, targets, indegrees, DISPATCH, COMPLETION, TRIGGERS, RELATIONS, SEQUENCE, SPAWN, JOIN,
    REPLAY_BARRIER, MAX_SESSION_BYTES, Dependency, Edge, Node, TraceGraph, GraphBuilder, Source,
)

__all__ = [
    "grouped",
    "successors",
    "targets",
    "indegrees",
    "DISPATCH",
    "COMPLETION",
    "TRIGGERS",
    "RELATIONS",
    "SEQUENCE",
    "SPAWN",
    "JOIN",
    "REPLAY_BARRIER",
    "MAX_SESSION_BYTES",
    "Dependency",
    "Edge",
    "Node",
    "TraceGraph",
    "GraphBuilder",
    "Source",
]

warnings.warn("harness.traces.graph is deprecated: import from harness.workload.traces.graph",
              DeprecationWarning, stacklevel=2)
