"""Trace formats: one loader (and writer, where a format can hold a graph) per module, one common graph.

``graph`` (the model: request nodes and typed dependency edges), ``rows`` (bounded reading, field checks),
``mooncake`` (``mooncake``, ``mooncake-delta``), ``agentic_legacy`` (``agentic_mooncake`` rows with ``wait_for``),
``agentic_v2`` (Agentic Mooncake v2: header and typed dependencies), ``applied_compute`` (``applied_compute_agentic``),
``weka`` (Weka trace objects lowered to the graph), ``dynamo`` (``dynamo.request.trace.v1``), ``formats`` (the
names, detection, ``load_graph``; ``names`` the names alone), ``convert`` (writing a graph as another format,
refusing lossy ones) and ``timing`` (release times under known service times: replay's reference model).
Replay is ``harness.workload.sessions.GraphPlayer``; the formats are described in docs/traces.md.
"""
