"""Every validation rule of every trace format: the error is typed and names the file, the 1-based line and the field."""

from __future__ import annotations

from typing import Any

import pytest

from kvemu.errors import InvalidArgument

from harness.workload.traces.formats import load_graph
from harness.workload.traces.names import EMBEDDED_BLOCK_SIZE

from tests.harness.trace_files import (HEADER, applied_row, dynamo_end, dynamo_tool, legacy_row, v2_row, weka_request,
                                       weka_trace)

NAN = float("nan")


def hdr(**changes: Any) -> dict[str, Any]:
    return {**HEADER, **changes}


T0 = 1_700_000_000_000
CASES: list[tuple[str, str, list[Any], int, str]] = [
    # (case, format, rows, line, field)
    ("mooncake missing hash_ids", "mooncake", [{"input_length": 4, "output_length": 1}], 1, "hash_ids"),
    ("mooncake missing output_length", "mooncake", [{"input_length": 4, "hash_ids": [1]}], 1, "output_length"),
    ("mooncake-delta bad delay", "mooncake-delta", ["", {"input_length": 4, "output_length": 1, "hash_ids": [1],
                                                        "delay": -1}], 2, "delay"),
    ("mooncake-delta prompt too long", "mooncake-delta",
     [{"session_id": "a", "input_length": 1 << 22, "output_length": 1, "hash_ids": list(range(1 << 20))},
      {"session_id": "a", "input_length": 4, "output_length": 1, "hash_ids": [1]}], 2, "input_length"),
    # legacy agentic_mooncake
    ("legacy empty request_id", "agentic_mooncake_legacy", [legacy_row("")], 1, "request_id"),
    ("legacy missing request_id", "agentic_mooncake_legacy", [{"input_length": 4, "output_length": 1,
                                                               "hash_ids": [1]}], 1, "request_id"),
    ("legacy repeated request_id", "agentic_mooncake_legacy", [legacy_row("a"), legacy_row("a")], 2, "request_id"),
    ("legacy empty hash_ids", "agentic_mooncake_legacy", [legacy_row("a", ids=())], 1, "hash_ids"),
    ("legacy negative tool_wait_ms", "agentic_mooncake_legacy", [legacy_row("a", tool_wait_ms=-1)], 1,
     "tool_wait_ms"),
    ("legacy NaN delay", "agentic_mooncake_legacy", [legacy_row("a", delay=NAN)], 1, "delay"),
    ("legacy delay and delay_ms", "agentic_mooncake_legacy", [legacy_row("a", delay=1, delay_ms=1)], 1, "delay_ms"),
    ("legacy unknown wait_for", "agentic_mooncake_legacy", [legacy_row("a"), legacy_row("b", "zz")], 2,
     "wait_for[0]"),
    ("legacy self wait_for", "agentic_mooncake_legacy", [legacy_row("a"), legacy_row("b", "a", "b")], 2,
     "wait_for[1]"),
    ("legacy cycle", "agentic_mooncake_legacy", [legacy_row("r"), legacy_row("a", "b"), legacy_row("b", "a")], 2,
     "wait_for[0]"),
    ("legacy wait_for not a string", "agentic_mooncake_legacy", [legacy_row("a"), legacy_row("b", 3)], 2,  # type: ignore[arg-type]
     "wait_for[0]"),
    ("legacy input past hash ids", "agentic_mooncake_legacy", [legacy_row("a", isl=9)], 1, "input_length"),
    ("legacy bad output_token_ids", "agentic_mooncake_legacy", [legacy_row("a", output_token_ids=[1])], 1,
     "output_token_ids"),
    ("legacy given a v2 file", "agentic_mooncake_legacy", [HEADER, v2_row("a")], 1, "schema"),
    # Agentic Mooncake v2
    ("v2 missing header", "agentic_mooncake", [HEADER | {"schema": "x"}, v2_row("a")], 1, "schema"),
    ("v2 wrong version", "agentic_mooncake", [hdr(version=1), v2_row("a")], 1, "version"),
    ("v2 bad hash_id_scope", "agentic_mooncake", [hdr(hash_id_scope="global"), v2_row("a")], 1, "hash_id_scope"),
    ("v2 empty source format", "agentic_mooncake", [hdr(source={"format": "", "digest": "d"}), v2_row("a")], 1,
     "source.format"),
    ("v2 missing source digest", "agentic_mooncake", [hdr(source={"format": "f"}), v2_row("a")], 1, "source.digest"),
    ("v2 block_size 0", "agentic_mooncake", [hdr(block_size=0), v2_row("a")], 1, "block_size"),
    ("v2 second header", "agentic_mooncake", [HEADER, v2_row("a"), HEADER], 3, "schema"),
    ("v2 empty play_id", "agentic_mooncake", [HEADER, v2_row("a", play="")], 2, "play_id"),
    ("v2 empty model", "agentic_mooncake", [HEADER, v2_row("a") | {"model": ""}], 2, "model"),
    ("v2 id too long", "agentic_mooncake", [HEADER, v2_row("a", session="s" * 300)], 2, "session_id"),
    ("v2 repeated request_id", "agentic_mooncake", [HEADER, v2_row("a"), "", v2_row("a")], 4, "request_id"),
    ("v2 missing input_length", "agentic_mooncake",
     [HEADER, {k: v for k, v in v2_row("a").items() if k != "input_length"}], 2, "input_length"),
    ("v2 missing output_length", "agentic_mooncake",
     [HEADER, {k: v for k, v in v2_row("a").items() if k != "output_length"}], 2, "output_length"),
    ("v2 input_length 0", "agentic_mooncake", [HEADER, v2_row("a", isl=0)], 2, "input_length"),
    ("v2 input_length a float", "agentic_mooncake", [HEADER, v2_row("a") | {"input_length": 8.0}], 2,
     "input_length"),
    ("v2 hash ids not exact", "agentic_mooncake", [HEADER, v2_row("a", isl=4)], 2, "hash_ids"),
    ("v2 hash id past u64", "agentic_mooncake", [HEADER, v2_row("a", ids=(1, 1 << 64))], 2, "hash_ids[1]"),
    ("v2 missing hash_ids", "agentic_mooncake", [HEADER, {k: v for k, v in v2_row("a").items() if k != "hash_ids"}],
     2, "hash_ids"),
    ("v2 output_token_ids length", "agentic_mooncake", [HEADER, v2_row("a", output_token_ids=[1])], 2,
     "output_token_ids"),
    ("v2 negative not_before_ms", "agentic_mooncake", [HEADER, v2_row("a", at=-1)], 2, "not_before_ms"),
    ("v2 missing not_before_ms", "agentic_mooncake",
     [HEADER, {k: v for k, v in v2_row("a").items() if k != "not_before_ms"}], 2, "not_before_ms"),
    ("v2 infinite recorded api time", "agentic_mooncake", [HEADER, v2_row("a", recorded_api_time_ms=float("inf"))],
     2, "recorded_api_time_ms"),
    ("v2 dependency empty id", "agentic_mooncake", [HEADER, v2_row("a"), v2_row("b", ("", "completion", "sequence", 0))],
     3, "dependencies[0].request_id"),
    ("v2 dependency negative delay", "agentic_mooncake",
     [HEADER, v2_row("a"), v2_row("b", ("a", "completion", "sequence", -5))], 3, "dependencies[0].delay_ms"),
    ("v2 dependency missing delay", "agentic_mooncake",
     [HEADER, v2_row("a"), v2_row("b") | {"dependencies": [{"request_id": "a", "trigger": "completion",
                                                             "relation": "join"}]}], 3, "dependencies[0].delay_ms"),
    ("v2 unknown trigger", "agentic_mooncake", [HEADER, v2_row("a"), v2_row("b", ("a", "start", "spawn", 0))], 3,
     "dependencies[0].trigger"),
    ("v2 unknown relation", "agentic_mooncake", [HEADER, v2_row("a"), v2_row("b", ("a", "completion", "fork", 0))], 3,
     "dependencies[0].relation"),
    ("v2 join on dispatch", "agentic_mooncake", [HEADER, v2_row("a"), v2_row("b", ("a", "dispatch", "join", 0))], 3,
     "dependencies[0].trigger"),
    ("v2 sequence on dispatch", "agentic_mooncake",
     [HEADER, v2_row("a"), v2_row("b", ("a", "dispatch", "sequence", 0))], 3, "dependencies[0].trigger"),
    ("v2 unknown dependency", "agentic_mooncake",
     [HEADER, v2_row("a"), v2_row("b", ("a", "completion", "sequence", 0), ("zz", "completion", "join", 0))], 3,
     "dependencies[1].request_id"),
    ("v2 self dependency", "agentic_mooncake", [HEADER, v2_row("a"), v2_row("b", ("b", "completion", "sequence", 0))],
     3, "dependencies[0].request_id"),
    ("v2 cross-play dependency", "agentic_mooncake",
     [HEADER, v2_row("a"), v2_row("b", ("a", "completion", "sequence", 0), play="other")], 3,
     "dependencies[0].request_id"),
    ("v2 cycle", "agentic_mooncake",
     [HEADER, v2_row("r"), v2_row("a", ("c", "completion", "sequence", 0)), v2_row("b", ("a", "completion", "join", 0)),
      v2_row("c", ("b", "completion", "join", 0))], 3, "dependencies[0].request_id"),
    ("v2 ordinal on some rows", "agentic_mooncake",
     [HEADER, v2_row("a", source_play_ordinal=0), v2_row("b", play="q")], 3, "source_play_ordinal"),
    ("v2 two ordinals in a play", "agentic_mooncake",
     [HEADER, v2_row("a", source_play_ordinal=0), v2_row("b", source_play_ordinal=1)], 3, "source_play_ordinal"),
    ("v2 ordinals not contiguous", "agentic_mooncake",
     [HEADER, v2_row("a", source_play_ordinal=0), v2_row("b", play="q", source_play_ordinal=2)], 1,
     "source_play_ordinal"),
    ("v2 header only", "agentic_mooncake", [HEADER], 1, "request_id"),
    ("v2 not JSON", "agentic_mooncake", [HEADER, "{nope"], 2, None),
    ("v2 row not an object", "agentic_mooncake", [HEADER, "[1, 2]"], 2, None),
    # applied_compute_agentic
    ("applied array length", "applied_compute_agentic", [applied_row(), applied_row(tool_call_latency=[1])], 2,
     "tool_call_latency"),
    ("applied response length", "applied_compute_agentic", [applied_row(assistant_response_length=[1, 2, 3])], 1,
     "assistant_response_length"),
    ("applied prompt 0", "applied_compute_agentic", [applied_row(prompt=0)], 1, "input_prompt_length"),
    ("applied negative latency", "applied_compute_agentic", [applied_row(tool_call_latency=[0.5, -1])], 1,
     "tool_call_latency[1]"),
    ("applied NaN latency", "applied_compute_agentic", [applied_row(tool_call_latency=[NAN, 1])], 1,
     "tool_call_latency[0]"),
    ("applied missing final", "applied_compute_agentic",
     [{k: v for k, v in applied_row().items() if k != "final_assistant_response_length"}], 1,
     "final_assistant_response_length"),
    # weka
    ("weka empty id", "weka", [weka_trace("")], 1, "id"),
    ("weka model not listed", "weka", [weka_trace("p", [weka_request(0, model="other")])], 1, "requests[0].model"),
    ("weka block_size 0", "weka", [weka_trace("p", block_size=0)], 1, "block_size"),
    ("weka scope", "weka", [weka_trace("p", hash_id_scope="global")], 1, "hash_id_scope"),
    ("weka in 0", "weka", [weka_trace("p", [weka_request(0, isl=0)])], 1, "requests[0].in"),
    ("weka negative t", "weka", [weka_trace("p", [weka_request(-1)])], 1, "requests[0].t"),
    ("weka negative api_time", "weka", [weka_trace("p", [weka_request(0, api=-2)])], 1, "requests[0].api_time"),
    ("weka unknown entry", "weka", [weka_trace("p", [{"type": "x"}])], 1, "requests[0].type"),
    ("weka bad status", "weka", [weka_trace("p", [weka_request(0), {"type": "subagent", "t": 1, "agent_id": "a",
                                                                    "status": "failed", "requests": []}])], 1,
     "requests[1].status"),
    ("weka empty blocking sub-agent", "weka", [weka_trace("p", [weka_request(0), {
        "type": "subagent", "t": 1, "agent_id": "a", "status": "completed", "requests": []}])], 1, "requests[1].requests"),
    ("weka nested sub-agent", "weka", [weka_trace("p", [weka_request(0), {
        "type": "subagent", "t": 1, "agent_id": "a", "status": "completed", "requests": [{"type": "subagent"}]}])], 1,
     "requests[1].requests[0].type"),
    ("weka understated duration", "weka", [weka_trace("p", [weka_request(0), {
        "type": "subagent", "t": 0.5, "agent_id": "a", "status": "completed", "duration_ms": 10,
        "requests": [weka_request(0.6)]}])], 1, "requests[1].duration_ms"),
    ("weka mixed block sizes", "weka", [weka_trace("p"), weka_trace("q", block_size=8)], 2, "block_size"),
    ("weka missing agent_id", "weka", [weka_trace("p", [weka_request(0), {
        "type": "subagent", "t": 1, "status": "async_launched", "requests": [weka_request(1.1)]}])], 1,
     "requests[1].agent_id"),
    # dynamo
    ("dynamo wrong schema", "dynamo", [dynamo_end("a", T0, 1) | {"schema": "other"}], 1, "schema"),
    ("dynamo unknown event", "dynamo", [dynamo_end("a", T0, 1), dynamo_end("b", T0, 1) | {"event_type": "x"}], 2,
     "event_type"),
    ("dynamo empty request_id", "dynamo", [dynamo_end("", T0, 1)], 1, "request.request_id"),
    ("dynamo repeated request_id", "dynamo", [dynamo_end("a", T0, 1), dynamo_end("a", T0, 1)], 2,
     "request.request_id"),
    ("dynamo mixed block sizes", "dynamo", [dynamo_end("a", T0, 1), dynamo_end("b", T0, 1, block=8, ids=(1,))], 2,
     "request.replay.trace_block_size"),
    ("dynamo mixed agent_context", "dynamo", [dynamo_end("a", T0, 1), dynamo_end("b", T0, 1, session="s")], 2,
     "agent_context"),
    ("dynamo no request_end", "dynamo", [dynamo_tool("a", "kid")], 1, "event_type"),
    ("dynamo bad execution_mode", "dynamo", [dynamo_end("a", T0, 1, session="s"), dynamo_tool("a", "k", mode="x")],
     2, "event.tool.claude.execution_mode"),
    ("dynamo conflicting parents", "dynamo",
     [dynamo_end("a", T0, 1, session="s"), dynamo_end("b", T0, 1, session="t"),
      dynamo_end("c", T0 + 5, 1, session="k", parent="s"), dynamo_end("d", T0 + 9, 1, session="k", parent="t")], 4,
     "agent_context.parent_session_id"),
    ("dynamo missing replay", "dynamo", [{**dynamo_end("a", T0, 1), "request": {"request_id": "a"}}], 1,
     "request.replay"),
    ("dynamo hashes short", "dynamo", [dynamo_end("a", T0, 1, isl=9)], 1, "request.replay.input_length"),
]


@pytest.mark.parametrize("case, fmt, rows, line, field", CASES, ids=[c[0] for c in CASES])
def test_a_bad_row_is_refused_naming_file_line_and_field(tmp_path, case, fmt, rows, line, field):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join((r if isinstance(r, str) else __import__("json").dumps(r)) + "\n" for r in rows))
    with pytest.raises(InvalidArgument) as info:
        load_graph(path, fmt, None if fmt in EMBEDDED_BLOCK_SIZE else 4)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    if fmt.startswith("mooncake"):  # (kvemu's Mooncake rows keep their messages: "not a Mooncake trace row: ...")
        assert field in message and info.value.field == field, message
    elif field is not None:
        assert message.startswith(f"{path}:{line}: {field}"), message
        assert info.value.field is not None and info.value.field.endswith(field)
    assert "Traceback" not in message


def test_an_explicit_block_size_must_agree_with_the_file(tmp_path):
    path = tmp_path / "v2.jsonl"
    path.write_text("\n".join(__import__("json").dumps(r) for r in (HEADER, v2_row("a"))))
    with pytest.raises(InvalidArgument, match=r"v2.jsonl:1: block_size: the header says 4 .* but 8 was given"):
        load_graph(path, "agentic_mooncake", 8)


def test_a_row_past_the_bound_is_refused_at_its_line(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_text("\n".join(__import__("json").dumps(legacy_row(f"r{i}")) for i in range(5)))
    with pytest.raises(InvalidArgument, match=r"l.jsonl:4: more than 3 rows"):
        load_graph(path, "agentic_mooncake_legacy", 4, max_rows=3)
