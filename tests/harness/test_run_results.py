"""No run loses its results: a bad report path fails before the run, and an error or an interrupt part way
still writes the report, marked partial with why it stopped."""

import json

import pytest

from harness.report.files import OutputError
from harness.run.runner import RunAborted, Terminated, run_scenario
from harness.scenario import parse_scenario
from workers.actor.actor import WorkerActor

SCENARIO = """
name: safety
cluster: {workers: 2, dp_size: 1}
workload: {kind: synthetic, rate_rps: 4, turns: 2, think_time_s: 0.5}
run: {mode: virtual, seed: 3, duration_s: 20}
"""


def _summary(out):
    return json.loads((out / "summary.json").read_text())


def _accounted(summary):
    k = summary["kvemu"]
    return summary["completed_requests"] + k["failed_requests"] + k["unfinished_requests"] == summary["num_requests"]


@pytest.mark.parametrize("where", ["a-file", "a-file/below"])
def test_a_report_path_that_cannot_be_a_directory_fails_before_anything_runs(tmp_path, where):
    (tmp_path / "a-file").write_text("keep me")
    seen = []
    with pytest.raises(OutputError, match="a file of that name exists|part of the path is a file"):
        run_scenario(parse_scenario(SCENARIO), tmp_path / where, observers=[seen.append])
    assert seen == []  # not one request was sent
    assert (tmp_path / "a-file").read_text() == "keep me"


def test_an_error_part_way_writes_a_partial_report_then_raises(tmp_path, monkeypatch):
    def broken(self, factor):
        raise RuntimeError("the GPU caught fire")

    monkeypatch.setattr(WorkerActor, "slow_down", broken)
    scenario = parse_scenario(SCENARIO + "chaos:\n  - {at_s: 8, action: slow_worker, worker: 1, factor: 2}\n")
    with pytest.raises(RunAborted, match="RuntimeError: the GPU caught fire; partial report in") as info:
        run_scenario(scenario, tmp_path / "out")
    summary = _summary(tmp_path / "out")
    assert summary["partial"] is True
    assert summary["kvemu"]["stop_reason"] == "error: RuntimeError: the GPU caught fire"
    assert 0 < summary["completed_requests"] < summary["num_requests"]  # what finished before 8 s is there
    assert _accounted(summary)
    assert info.value.outcome.data.partial
    assert "interrupted (error: RuntimeError: the GPU caught fire)" in (tmp_path / "out" / "report.md").read_text()
    lines = (tmp_path / "out" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == summary["num_requests"]


def test_an_interrupt_part_way_writes_a_partial_report_naming_the_signal(tmp_path):
    done = []

    def interrupt_after_ten(ev):
        if ev.kind == "completed":
            done.append(ev)
            if len(done) == 10:
                raise Terminated("SIGTERM")  # what the CLI's SIGTERM handler raises

    outcome = run_scenario(parse_scenario(SCENARIO), tmp_path / "out", observers=[interrupt_after_ten])
    summary = _summary(tmp_path / "out")
    assert outcome.data.partial and summary["kvemu"]["stop_reason"] == "SIGTERM"
    assert 10 <= summary["completed_requests"] < summary["num_requests"]
    assert _accounted(summary)


def test_a_complete_run_has_no_stop_reason(tmp_path):
    outcome = run_scenario(parse_scenario(SCENARIO), tmp_path / "out")
    summary = _summary(tmp_path / "out")
    assert not outcome.data.partial and summary["kvemu"]["stop_reason"] is None
    assert summary["completed_requests"] == summary["num_requests"] > 0


def test_the_cli_refuses_a_bad_report_path_and_validate_a_bad_timeline(tmp_path, capsys):
    from harness.cli import main

    (tmp_path / "a-file").write_text("")
    assert main(["run", "-o", str(tmp_path / "a-file" / "out"), "--quiet"]) == 2
    assert "part of the path is a file" in capsys.readouterr().err
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO + "chaos:\n  - {at_s: 1, action: kill_rank, worker: 5}\n")
    assert main(["validate", str(scenario)]) == 2
    assert "chaos[0].worker (line 7): chaos[0] (kill_rank at 1 s): worker 5 is not running then" in capsys.readouterr().err


def test_requests_a_stalled_worker_holds_fail_at_the_router_deadline(tmp_path):
    scenario = parse_scenario(SCENARIO + "router: {request_deadline_s: 4}\nchaos:\n"
                              "  - {at_s: 2, action: slow_worker, worker: 1, factor: 100000}\n")
    outcome = run_scenario(scenario, tmp_path / "out")
    summary = _summary(tmp_path / "out")
    k = summary["kvemu"]
    stalled = [r for r in outcome.data.records if r.failure == "deadline_exceeded"]
    assert stalled and k["failed_requests_by_reason"] == {"deadline_exceeded": len(stalled)}
    assert all(r.worker_id == 1 for r in stalled)
    assert summary["completed_requests"] + len(stalled) == summary["num_requests"]  # every request ended
    assert not outcome.data.partial
