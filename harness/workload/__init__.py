"""The workload: what a run sends and how it is played.

``build`` makes it from a scenario (a Mooncake trace's sessions, a synthetic one, or a trace's dependency graph);
``turns`` holds sessions of turns and the ``Workload`` protocol every form gives (``forms``: the forms as one type),
``trace_sessions`` a loaded trace's sessions kept column-wise, ``traces`` the trace formats and their graph;
``players`` (the protocol), ``sessions`` (sessions and graphs) and ``lanes`` (continuous agentic lanes) play it;
``synthetic_trace`` and ``agentic_corpus`` write example traces.
"""

from harness.workload.build import Session, Turn, build_sessions, count_requests, load_trace, sample, synthesize
from harness.workload.forms import Sessions, Workload

__all__ = ["Turn", "Session", "load_trace", "synthesize", "build_sessions", "count_requests", "sample", "Sessions",
           "Workload"]
