"""``run.sla``: which requests meet it, goodput in summary.json, ``met_sla`` in requests.jsonl, the report's rows."""

from __future__ import annotations

import json

import pytest

from harness.report.files import write_report
from harness.report.summary import summarize
from harness.scenario import ScenarioError, parse_scenario
from harness.report.sla import Sla
from kvemu.errors import InvalidArgument

from tests.harness.test_report import sample_run

DURATION_S = 0.22  # sample_run: first arrival 0 ms, last completion 220 ms
# sample_run's completed requests: a (TTFT 100, mean ITL 15, E2E 130, 3 tokens), b (50, 40, 170, 4 tokens),
# c (200, one token: no ITL, 200, 1 token); d failed.


@pytest.mark.parametrize("targets, met, tokens", [
    ({"ttft_ms": 100}, {"a", "b"}, 7),            # bounds are inclusive
    ({"itl_ms": 15}, {"a", "c"}, 4),              # a one-token reply has no ITL: it passes
    ({"ttft_ms": 100, "itl_ms": 15}, {"a"}, 3),   # both must hold
    ({"e2e_ms": 170}, {"a", "b"}, 7),
    ({"ttft_ms": 0.001}, set(), 0),
])
def test_goodput_counts_the_requests_within_every_target(targets, met, tokens):
    sla = Sla(**targets)
    data = sample_run(sla=sla)
    assert {r.request_id for r in data.records if sla.met(r)} == met
    s = summarize(data).to_builtins()
    assert s["goodput_completed_requests"] == len(met)
    assert s["goodput_request_throughput_rps"] == pytest.approx(len(met) / DURATION_S, rel=1e-5)
    assert s["goodput_output_throughput_tok_s"] == pytest.approx(tokens / DURATION_S, rel=1e-5)
    assert s["kvemu"]["sla"]["met_ratio"] == pytest.approx(len(met) / 4, rel=1e-5)  # of all requests, failed ones too


def test_a_failed_request_never_meets_the_sla():
    data = sample_run()
    failed = next(r for r in data.records if r.failure is not None)
    assert not Sla(e2e_ms=1e9).met(failed) and not Sla(ttft_ms=1e9).met(failed)


def test_without_an_sla_the_report_has_no_goodput_and_no_met_sla(tmp_path):
    summary = write_report(sample_run(), tmp_path).to_builtins()
    assert not any(k.startswith("goodput") for k in summary) and "sla" not in summary["kvemu"]
    assert "met_sla" not in (tmp_path / "requests.jsonl").read_text()
    assert "goodput" not in (tmp_path / "report.md").read_text()


def test_requests_jsonl_flags_each_request_and_report_md_shows_goodput_beside_throughput(tmp_path):
    write_report(sample_run(sla=Sla(ttft_ms=100, itl_ms=40)), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert {r["request_id"]: r["met_sla"] for r in rows} == {"a": True, "b": True, "c": False, "d": False}
    assert list(rows[0])[-1] == "met_sla"  # the record's columns first, unchanged
    md = (tmp_path / "report.md").read_text()
    lines = md.splitlines()
    at = lines.index("| request throughput | 13.64 req/s |")
    assert lines[at + 1: at + 5] == ["| SLA | TTFT ≤ 100 ms, ITL ≤ 40 ms |",
                                     "| requests meeting the SLA | 2 (50.0%) |",
                                     "| goodput | 9.09 req/s |",
                                     "| goodput output throughput | 31.82 tok/s |"]


@pytest.mark.parametrize("sla, field, message", [
    ({"ttft_ms": 100, "e2e_ms": 5}, "run.sla.e2e_ms", "mutually exclusive"),
    ({"itl_ms": 1, "e2e_ms": 5}, "run.sla.e2e_ms", "mutually exclusive"),
    ({}, "run.sla.ttft_ms", "needs a target"),
    ({"ttft_ms": 0}, "run.sla.ttft_ms", "> 0"),
    ({"ttft_ms": -3}, "run.sla.ttft_ms", "> 0"),
    ({"tftt_ms": 3}, "run.sla.tftt_ms", "unknown key"),
])
def test_a_bad_sla_is_refused_naming_the_key(sla, field, message):
    text = json.dumps({"run": {"sla": sla}})
    with pytest.raises(ScenarioError, match=rf"{field}.*{message}"):
        parse_scenario(text)


def test_sla_built_in_python_is_checked_too():
    with pytest.raises(InvalidArgument, match="mutually exclusive"):
        Sla(ttft_ms=1, e2e_ms=2)
    with pytest.raises(InvalidArgument, match="finite"):
        Sla(itl_ms=float("nan"))
