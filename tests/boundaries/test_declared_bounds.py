"""A value past one of the bounds the walk asks for is refused at decoding, naming the field (issue #43): control
messages, router overrides, replies (records, samples), a worker's truth pages, the fleet's start line and a sweep
file. The scenario file's are in tests/harness/test_scenario.py."""

from __future__ import annotations

import msgspec
import pytest

from harness.chaos import Control, ControlReply, SyncPeers, WorkerExited
from harness.procs.engine_truth import MAX_PAGE, TruthPage, Unsettled
from harness.procs.fleet import FleetInfo
from harness.procs.protocol import RecordReply, Stats, client_decoder, reply_decoder
from harness.report.run_data import Sample
from harness.scenario import ChaosEvent
from harness.sweep.spec import SweepError, parse_sweep
from kvemu.errors import InvalidArgument
from kvemu.config import RouterOverrides
from kvemu.limits import MAX_OUTPUT_TOKENS, MAX_TEXT_CHARS
from kvemu.messages import ClientRequest
from kvemu.records import RequestRecord

HUGE = "x" * (1 << 20)
EVENT = ChaosEvent(at_s=0, action="add_worker")


def refused(decode, data: bytes) -> str:
    with pytest.raises(msgspec.ValidationError) as exc:
        decode(data)
    return str(exc.value)


@pytest.mark.parametrize(("msg", "where"), [
    (Control(token=HUGE, event=EVENT), "$.token"),
    (WorkerExited(token=HUGE, worker_id=1, how="code 1"), "$.token"),
    (SyncPeers(token=HUGE, peers={}), "$.token"),
])
def test_a_control_message_with_a_megabyte_token_is_refused(msg, where):
    assert f"length <= 256 - at `{where}`" in refused(client_decoder.decode, msgspec.msgpack.encode(msg))


def test_a_control_reply_with_a_megabyte_detail_is_refused():
    data = msgspec.msgpack.encode(ControlReply(ok=True, detail=HUGE))
    assert f"length <= {MAX_TEXT_CHARS} - at `$.detail`" in refused(reply_decoder.decode, data)


def test_router_overrides_refuse_an_absurd_float_over_the_wire_and_in_python():
    body = msgspec.to_builtins(ClientRequest(request_id="r", tokens=[1, 2]))
    body["router_overrides"] = {"router_temperature": 1e300}
    data = msgspec.msgpack.encode(body)
    assert "<= 1000000.0 - at `$.router_overrides.router_temperature`" in refused(client_decoder.decode, data)
    with pytest.raises(InvalidArgument, match="router_config_override.router_temperature"):
        RouterOverrides(router_temperature=float("inf"))


@pytest.mark.parametrize(("change", "where"), [
    ({"token_times_ns": [1] * (MAX_OUTPUT_TOKENS + 1)}, "$.record.token_times_ns"),
    ({"arrival_ns": -1}, "$.record.arrival_ns"),
    ({"failure": HUGE}, "$.record.failure"),
    ({"worker_id": -5}, "$.record.worker_id"),
])
def test_a_record_reply_past_a_bound_is_refused(change, where):
    reply = RecordReply(record=RequestRecord(request_id="r", **change))
    assert f"at `{where}`" in refused(reply_decoder.decode, msgspec.msgpack.encode(reply))


def test_a_failure_around_a_workers_longest_refusal_still_reaches_the_client():
    """The lifecycle's ``no_endpoints ... (the last refusal, by <worker>/<rank>: <reason>)``, a disaggregated
    router's pool prefix around it: longer than the worker's ``Text`` reason, shorter than the record's bound."""
    failure = f"prefill: no_endpoints: every rank refused (the last refusal, by 9/511: {'r' * MAX_TEXT_CHARS})"
    data = msgspec.msgpack.encode(RecordReply(record=RequestRecord(request_id="r", failure=failure)))
    assert reply_decoder.decode(data).record.failure == failure


def test_a_stats_sample_with_a_huge_group_map_is_refused():
    sample = Sample(time_ns=0, worker_id=0, dp_rank=0, active_requests=0, kv_blocks=0,
                    group_blocks={i: 1 for i in range(5000)})
    data = msgspec.msgpack.encode(Stats(now_ns=0, workers=[], ranks=[], samples=[sample], kv_stats={}))
    assert "at `$.samples[0].group_blocks`" in refused(reply_decoder.decode, data)


def _stats_with_event(event: dict) -> bytes:
    stats = msgspec.to_builtins(Stats(now_ns=0, workers=[], ranks=[], samples=[], kv_stats={}))
    return msgspec.msgpack.encode({**stats, "worker_events": [event]})


def test_a_stats_worker_event_is_typed_and_bounded():
    event = {"kind": "worker_removed", "time_ns": 5, "worker_id": 1, "reason": "process_exited (code 1)"}
    [got] = reply_decoder.decode(_stats_with_event(event)).worker_events
    assert (got.kind, got.time_ns, got.worker_id, got.reason) == ("worker_removed", 5, 1, "process_exited (code 1)")
    assert "at `$.worker_events[0].reason`" in refused(reply_decoder.decode,
                                                        _stats_with_event({**event, "reason": HUGE}))
    assert "`$.worker_events[0]`" in refused(reply_decoder.decode, _stats_with_event({**event, "extra": {"a": [1]}}))
    assert "at `$.worker_events[0].worker_id`" in refused(reply_decoder.decode,
                                                           _stats_with_event({**event, "worker_id": "one"}))


def test_a_truth_page_past_its_page_size_or_a_negative_count_is_refused():
    page = TruthPage(records=[RequestRecord(request_id="r")] * (MAX_PAGE + 1), next=0, dropped=0)
    assert "at `$.records`" in refused(lambda b: msgspec.json.decode(b, type=TruthPage), msgspec.json.encode(page))
    assert "at `$.requests`" in refused(lambda b: msgspec.json.decode(b, type=Unsettled), b'{"requests": -1}')


def test_a_fleet_start_line_with_an_overlong_url_is_refused():
    worker = {"worker_id": 0, "pool": "aggregated", "url": "http://" + HUGE, "dp_size": 1, "block_size": 16,
              "kv_events": [], "kv_replay": []}
    with pytest.raises(msgspec.ValidationError, match=r"at `\$.workers\[0\].url`"):
        msgspec.convert({"event": "fleet", "model": "m", "workers": [worker], "kv_events_version": "0.11"}, FleetInfo)


@pytest.mark.parametrize(("text", "key"), [
    ("axes:\n  router.overlap_score_credit: [1.0, .inf]\n", "axes"),
    ("axes:\n  cluster.workers: [1]\nseeds: [18446744073709551616]\n", "seeds"),
    ("axes:\n  cluster.workers: [1]\nset:\n  router.policy: " + "m" * 5000 + "\n", "set"),
    ("axes:\n  cluster.workers: [1]\nobjective: {ttft_ms: 1e300}\n", "objective.ttft_ms"),
])
def test_a_sweep_file_past_a_bound_is_refused_naming_the_key(text, key):
    with pytest.raises(SweepError) as exc:
        parse_sweep(text, source="s.yaml")
    assert f"s.yaml: {key}" in str(exc.value)
