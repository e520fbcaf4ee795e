"""When each node of a graph is released if every request takes a known time: the reference model of replay.

A root goes at its ``not_before``; another node at the latest of its floor and each edge's trigger time (its
source's release, or release plus service time) plus the edge's delay. Tests check the replay against it, and a
lossy conversion to chains uses it (service 0) to place a session that a spawn started.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

from harness.workload.traces.graph import DISPATCH, TraceGraph, indegrees, successors, targets

__all__ = ["release_times", "topological_order"]


def topological_order(g: TraceGraph) -> list[int]:
    """The nodes so that every edge's source comes before its target (file order where it already is)."""
    indegree = indegrees(g.edge_end)
    start, out = successors(g.edge_end, g.edge_source)
    target = targets(g.edge_end)
    order: list[int] = []
    ready = [i for i in range(len(g)) if not indegree[i]]
    ready.reverse()
    while ready:
        i = ready.pop()
        order.append(i)
        for e in reversed(out[start[i]:start[i + 1]]):
            j = target[e]
            indegree[j] -= 1
            if not indegree[j]:
                ready.append(j)
    return order


def release_times(g: TraceGraph, service_ns: Callable[[int], int] = lambda _i: 0) -> array[int]:
    """Each node's release time (ns) when node ``i`` runs ``service_ns(i)`` from its release to its end."""
    release = array("q", [0]) * len(g)
    for i in topological_order(g):
        t = g.not_before_ns[i]
        for e in g.edges(i):
            at = release[e.source] + (0 if e.trigger == DISPATCH else service_ns(e.source))
            t = max(t, at + e.delay_ns)
        release[i] = t
    return release
