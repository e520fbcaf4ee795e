"""The workload: what a run sends and how it is played.

``build`` makes it from a scenario (a Mooncake trace's sessions, a synthetic one, or a trace's dependency graph);
``turns`` holds sessions of turns and the ``Workload`` protocol every form gives (``forms``: the forms as one type),
``trace_sessions`` a loaded trace's sessions kept column-wise, ``traces`` the trace formats and their graph;
``players`` (the protocol), ``sessions`` (sessions and graphs) and ``lanes`` (continuous agentic lanes) play it;
``synthetic_trace`` and ``agentic_corpus`` write example traces.

The names below load on first use, so that reading a trace file (``traces.rows``) does not load the workload's
builder (which reads scenarios, whose checks read trace bounds).
"""

from __future__ import annotations

import importlib

_FROM = {"Turn": "build", "Session": "build", "load_trace": "build", "synthesize": "build",
         "build_sessions": "build", "count_requests": "build", "sample": "build", "Sessions": "forms",
         "Workload": "forms"}

__all__ = list(_FROM)


def __getattr__(name: str) -> object:
    """``Turn``, ``build_sessions``, … from their module (``build`` or ``forms``), imported on first use."""
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_FROM[name]}"), name)
