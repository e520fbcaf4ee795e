"""SLA goodput and closed-loop replay against the reference's (``replay_concurrency``, ``sla_*_ms``; 1.6.1).

What the reference does, measured, and held here:

* **Closed loop**: at most N sessions in flight; trace timestamps are ignored; the first N rows start at 0 and
  each next session, in trace order, starts when one ends. A multi-turn session keeps its slot through its
  think times (``delay``), and its next turn starts ``delay`` after the previous one completed.
* **SLA**: a completed request meets ``ttft_ms``/``itl_ms`` when its TTFT and its mean inter-token latency are
  at most the targets (a one-token reply has no ITL and passes); ``e2e_ms`` alone compares the end-to-end
  latency. Goodput divides the met requests, and their output tokens, by the run's duration.

Per-request times are compared to 1 µs and the goodput keys exactly (to the report's 6 significant digits).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.report.summary import summarize
from tests.reference_cases import assert_same, kvemu_outcomes, kvemu_run, reference_outcomes, reference_run, write_trace

pytestmark = pytest.mark.reference

ROOT = Path(__file__).resolve().parents[2]
ROWS = 300
GOODPUT_KEYS = ("goodput_completed_requests", "goodput_request_throughput_rps", "goodput_output_throughput_tok_s")


@pytest.fixture(scope="module")
def mooncake_slice(mooncake_trace, tmp_path_factory) -> Path:
    """The first ``ROWS`` rows of the Mooncake trace (or its generated stand-in)."""
    from harness.reference import trace_head

    return trace_head(mooncake_trace, ROWS, tmp_path_factory.mktemp("mooncake"))


def _same_goodput(ours: dict, ref: dict) -> None:
    for key in (*GOODPUT_KEYS, "completed_requests"):
        assert ours[key] == pytest.approx(ref[key], rel=1e-5), (key, ours[key], ref[key])


@pytest.mark.parametrize("concurrency, workers", [(8, 4), (64, 16)])
def test_closed_loop_replay_matches_the_reference_request_by_request(dynamo_core, mooncake_slice, concurrency,
                                                                      workers):
    ours = kvemu_outcomes(mooncake_slice, {}, workers=workers, concurrency=concurrency)
    ref = reference_outcomes(dynamo_core, mooncake_slice, {}, workers=workers, replay_concurrency=concurrency)
    assert_same(ours, ref)
    assert sum(1 for o in ours if o[0] == 0.0) == concurrency  # the first N start at once, timestamps ignored


@pytest.mark.parametrize("sla", [{"ttft_ms": 300.0, "itl_ms": 9.0}, {"ttft_ms": 500.0}, {"itl_ms": 8.5},
                                 {"e2e_ms": 4000.0}])
@pytest.mark.parametrize("concurrency", [None, 32])
def test_goodput_equals_the_reference(dynamo_core, mooncake_slice, sla, concurrency):
    data = kvemu_run(mooncake_slice, {}, workers=8, concurrency=concurrency, sla=sla)
    ours = summarize(data).to_builtins()
    ref = dict(reference_run(dynamo_core, mooncake_slice, {}, workers=8, replay_concurrency=concurrency,
                             **{f"sla_{k}": v for k, v in sla.items()}).summary)
    _same_goodput(ours, ref)
    assert 0 < ours["goodput_completed_requests"] < ROWS  # the targets sit inside the distribution: both sides count


def test_a_session_keeps_its_slot_through_its_think_time(dynamo_core, tmp_path):
    rows = [{"session_id": "a", "timestamp": 0, "input_length": 1000, "output_length": 50, "hash_ids": [1, 2]},
            {"session_id": "b", "timestamp": 0, "input_length": 1000, "output_length": 50, "hash_ids": [3, 4]},
            {"session_id": "c", "timestamp": 100, "input_length": 1000, "output_length": 50, "hash_ids": [5, 6]},
            {"session_id": "a", "delay": 1000, "input_length": 1500, "output_length": 50, "hash_ids": [1, 2, 7]},
            {"session_id": "b", "delay": 1000, "input_length": 1500, "output_length": 50, "hash_ids": [3, 4, 8]},
            {"session_id": "c", "delay": 1000, "input_length": 1500, "output_length": 50, "hash_ids": [5, 6, 9]}]
    trace = write_trace(tmp_path, rows)
    ours = kvemu_outcomes(trace, {}, concurrency=2)
    assert_same(ours, reference_outcomes(dynamo_core, trace, {}, replay_concurrency=2))
    c_start = sorted(o[0] for o in ours)[4]
    assert c_start > 1000  # c waited for a whole session (a or b, think time included), not for a request


def test_one_token_replies_pass_an_itl_target_as_in_the_reference(dynamo_core, tmp_path):
    rows = [{"timestamp": 10 * i, "input_length": 600, "output_length": 1 if i < 2 else 5,
             "hash_ids": [10 * i, 10 * i + 1]} for i in range(4)]
    trace = write_trace(tmp_path, rows)
    ours = summarize(kvemu_run(trace, {}, sla={"itl_ms": 0.001})).to_builtins()
    ref = dict(reference_run(dynamo_core, trace, {}, sla_itl_ms=0.001).summary)
    _same_goodput(ours, ref)
    assert ours["goodput_completed_requests"] == 2 and ours["goodput_output_throughput_tok_s"] > 0


def test_the_reference_refuses_e2e_with_ttft_and_so_does_a_scenario(dynamo_core, tmp_path):
    from harness.scenario import ScenarioError, parse_scenario

    trace = write_trace(tmp_path, [{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}])
    with pytest.raises(Exception, match="mutually exclusive"):
        reference_run(dynamo_core, trace, {}, sla_ttft_ms=1.0, sla_e2e_ms=1.0)
    text = json.dumps({"workload": {"kind": "trace", "trace": str(trace)}, "run": {"sla": {"ttft_ms": 1, "e2e_ms": 1}}})
    with pytest.raises(ScenarioError, match=r"run\.sla\.e2e_ms.*mutually exclusive"):
        parse_scenario(text)
