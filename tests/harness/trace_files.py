"""Small trace files of every format, written from Python rows, for the trace format tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.workload.traces.agentic_v2 import SCHEMA as V2_SCHEMA
from harness.workload.traces.dynamo import SCHEMA as DYNAMO_SCHEMA

HEADER = {"schema": V2_SCHEMA, "version": 2, "block_size": 4, "hash_id_scope": "local",
          "source": {"format": "test", "digest": "d"}}


def write(path: Path, rows: list[Any]) -> Path:
    """JSON Lines of ``rows`` (a string row is written as is)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def v2_row(rid: str, *deps: tuple[str, str, str, float], play: str = "p", session: str = "s", isl: int = 8,
           osl: int = 2, ids: tuple[int, ...] = (1, 2), at: float = 0, **extra: Any) -> dict[str, Any]:
    """A v2 request row; ``deps`` are ``(request_id, trigger, relation, delay_ms)``."""
    row: dict[str, Any] = {"request_id": rid, "play_id": play, "session_id": session, "model": "m",
                           "input_length": isl, "output_length": osl, "hash_ids": list(ids), "not_before_ms": at}
    if deps:
        row["dependencies"] = [{"request_id": d, "trigger": t, "relation": r, "delay_ms": ms} for d, t, r, ms in deps]
    row.update(extra)
    return row


def legacy_row(rid: str, *wait_for: str, session: str | None = None, ids: tuple[int, ...] = (1, 2), isl: int = 8,
               osl: int = 2, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"request_id": rid, "input_length": isl, "output_length": osl, "hash_ids": list(ids)}
    if wait_for:
        row["wait_for"] = list(wait_for)
    if session is not None:
        row["session_id"] = session
    row.update(extra)
    return row


def applied_row(turns: int = 2, prompt: int = 10, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"num_turns": turns, "input_prompt_length": prompt,
                           "assistant_response_length": [3] * turns, "tool_call_output_length": [5] * turns,
                           "tool_call_latency": [0.5] * turns, "final_assistant_response_length": 4}
    row.update(extra)
    return row


def weka_request(t: float, isl: int = 8, ids: tuple[int, ...] = (1, 2), api: float | None = 1.0,
                 kind: str = "n", **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"type": kind, "t": t, "model": "m", "in": isl, "out": 2, "hash_ids": list(ids)}
    if api is not None:
        row["api_time"] = api
    row.update(extra)
    return row


def weka_trace(trace_id: str = "p1", requests: list[Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A Weka play: by default an outer request, a blocking sub-agent spawned during it, and a later request."""
    if requests is None:
        requests = [weka_request(0.0),
                    {"type": "subagent", "t": 0.5, "agent_id": "a", "duration_ms": 2000, "status": "completed",
                     "requests": [weka_request(0.6, isl=6, ids=(1, 3), api=0.5)]},
                    weka_request(3.0, isl=12, ids=(1, 2, 4), kind="s")]
    row: dict[str, Any] = {"id": trace_id, "models": ["m"], "block_size": 4, "hash_id_scope": "local",
                           "requests": requests}
    row.update(extra)
    return row


def dynamo_end(rid: str, start: int, total: int, *, session: str | None = None, parent: str | None = None,
               ids: tuple[int, ...] = (1, 2), isl: int = 8, block: int = 4, **request: Any) -> dict[str, Any]:
    """A ``request_end`` record of a Dynamo request trace (times in unix ms)."""
    req: dict[str, Any] = {"request_id": rid, "request_received_ms": start, "total_time_ms": total,
                           "output_tokens": 2, "replay": {"trace_block_size": block, "input_length": isl,
                                                          "input_sequence_hashes": list(ids)}}
    req.update(request)
    rec: dict[str, Any] = {"schema": DYNAMO_SCHEMA, "event_type": "request_end", "event_time_unix_ms": start + total,
                           "request": req}
    if session is not None:
        rec["agent_context"] = {"session_id": session, **({"parent_session_id": parent} if parent else {})}
    return rec


def dynamo_tool(source: str, child: str, consumer: str | None = None, mode: str = "blocking",
                at: int = 0) -> dict[str, Any]:
    claude: dict[str, Any] = {"source_request_id": source, "child_session_id": child, "execution_mode": mode}
    if consumer is not None:
        claude["consumer_request_id"] = consumer
    return {"event": {"schema": DYNAMO_SCHEMA, "event_type": "tool_end", "event_time_unix_ms": at,
                      "tool": {"tool_call_id": "c1", "tool_class": "Task", "claude": claude}}}
