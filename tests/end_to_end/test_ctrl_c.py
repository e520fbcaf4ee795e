"""Ctrl-C as a terminal sends it (SIGINT to the whole foreground process group, on a pty): a run stopped after it
started keeps a partial report and says where; one stopped before it ran says that nothing ran; a second Ctrl-C
stops sooner, without a traceback, keeping what was written (issue #44, defects 1 and 8)."""

import json
import time

import pytest

from tests.end_to_end.test_processes import FAST, _gone, small
from tests.process_output import tagged_env
from tests.terminal import ROOT, Terminal

pytestmark = pytest.mark.process_supervision

BIG = ("workload: {kind: synthetic, rate_rps: 100, turns: 4, think_time_s: 0.2, system_prefix_tokens: 64,\n"
       "           isl: {kind: constant, mean: 256}, osl: {kind: constant, mean: 8}}\n")
"""A workload that takes seconds to generate (24,000 requests), so that a Ctrl-C lands while it is made."""


def _partial_report(out, reason="SIGINT") -> dict:
    """The partial report in ``out``: its summary (checked against requests.jsonl and report.md)."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["partial"] is True and summary["kvemu"]["stop_reason"] == reason, summary["kvemu"]
    assert summary["num_requests"] > 0 and summary["completed_requests"] > 0
    assert len((out / "requests.jsonl").read_text().splitlines()) == summary["num_requests"]
    assert "PARTIAL RUN" in (out / "report.md").read_text() and f"({reason})" in (out / "report.md").read_text()
    return summary


def _no_traceback(text: str) -> None:
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]


def test_ctrl_c_of_kvemu_up_in_a_terminal_leaves_a_partial_report_and_says_where(tmp_path):
    """Issue #44: the terminal's SIGINT reached every child too, and the load generator then got kvemu up's SIGTERM
    with no handler left: exit 130 in 0.2 s, no report. Now the children are out of the terminal's process group
    and kvemu up passes the Ctrl-C on to the load generator, which reports before the others stop."""
    out = tmp_path / "out"
    tag, env = tagged_env()
    scenario = small(tmp_path, ["run: {mode: live, seed: 4, duration_s: 30}\n"])
    with Terminal("up", str(scenario), *FAST, "-o", str(out), env=env) as term:
        code, text = term.interrupt_when(r"kvemu loadgen: running: [1-9]")  # requests are being answered
    assert code == 130, text[-3000:]
    assert f"kvemu up: interrupted (SIGINT); partial report in {out}" in text, text[-3000:]
    _no_traceback(text)
    _partial_report(out)
    assert _gone(tag)


def test_a_second_ctrl_c_of_kvemu_up_kills_the_rest_but_keeps_the_report(tmp_path):
    """Issue #44: a second Ctrl-C while the load generator wrote its report killed it half way (no report.md) and
    printed kvemu up's traceback. Now the load generator finishes its report; the router and workers are killed."""
    out = tmp_path / "out"
    tag, env = tagged_env()
    scenario = small(tmp_path, ["run: {mode: live, seed: 4, duration_s: 30}\n"])
    with Terminal("up", str(scenario), *FAST, "-o", str(out), env=env) as term:
        term.wait_for(r"kvemu loadgen: running: [1-9]", 60)
        first = term.ctrl_c()
        term.wait_for(r"kvemu up: SIGINT: stopping", 10)
        term.ctrl_c()
        code = term.wait(60)
        took = time.monotonic() - first
        text = term.output
    assert code == 130, text[-3000:]
    assert "kvemu up: SIGINT again: killing now" in text and f"partial report in {out}" in text, text[-3000:]
    _no_traceback(text)
    _partial_report(out)
    assert took < 30, took
    assert _gone(tag)


def test_ctrl_c_of_kvemu_up_while_the_workload_is_made_says_nothing_ran(tmp_path):
    """The 0.2 s exit with no word: a Ctrl-C while the load generator made its workload (seconds for a big one)
    killed it with a traceback and kvemu up said nothing. Now both say that nothing ran and that there is no
    report."""
    out = tmp_path / "out"
    tag, env = tagged_env()
    scenario = small(tmp_path, [BIG, "run: {mode: live, seed: 4, duration_s: 60}\n"])
    with Terminal("up", str(scenario), *FAST, "-o", str(out), env=env) as term:
        code, text = term.interrupt_when(r"kvemu loadgen: generating the workload: \d")
    assert code == 130, text[-3000:]
    assert "kvemu loadgen: interrupted (SIGINT) while generating the workload: nothing ran; no report" in text
    assert "kvemu up: interrupted (SIGINT) before the run started: nothing ran; no report" in text, text[-3000:]
    _no_traceback(text)
    assert not (out / "summary.json").exists()
    assert _gone(tag)


def test_ctrl_c_of_kvemu_loadgen_in_a_terminal_leaves_a_partial_report(tmp_path):
    """``kvemu loadgen`` on its own, against a router and a worker in another session (as ``kvemu fleet`` or a
    user's terminal would run them): Ctrl-C, then a second one while it writes, keeps its whole report."""
    from harness.procs.up import Children
    from tests.end_to_end.test_processes import router_and_worker

    out = tmp_path / "out"
    scenario = small(tmp_path, ["run: {mode: live, seed: 4, duration_s: 30}\n"])
    kids = Children()
    try:
        router = router_and_worker(kids, scenario, 0, *FAST, router_args=tuple(FAST))
        with Terminal("loadgen", "--router", router["listen"], "--expect-workers", "1", "-o", str(out),
                      str(scenario), *FAST) as term:
            code, text = term.interrupt_when(r"kvemu loadgen: running: [1-9]", times=2)
    finally:
        kids.stop_all(grace_s=5)
    assert code == 130, text[-3000:]
    assert f"(PARTIAL: SIGINT); report in {out}/report.md" in text, text[-3000:]
    _no_traceback(text)
    _partial_report(out)


@pytest.mark.parametrize("mode", ["virtual", "live"])
def test_ctrl_c_of_kvemu_run_in_a_terminal_leaves_a_partial_report(tmp_path, mode):
    """``kvemu run`` (virtual time and live): Ctrl-C while it runs, and a second one while it writes the report,
    leave the whole partial report, its line, and no traceback."""
    out = tmp_path / "out"
    scenario = small(tmp_path, [f"run: {{mode: {mode}, seed: 4, duration_s: 600}}\n"])
    with Terminal("run", str(scenario), *FAST, "-o", str(out)) as term:
        term.wait_for(r"running: [1-9]", 60)
        term.ctrl_c()
        code, text = term.interrupt_when(r"kvemu: SIGINT: writing the partial report in ")  # a second, meanwhile
    assert code == 130, text[-3000:]
    assert f"(PARTIAL: SIGINT); report in {out}/report.md" in text, text[-3000:]
    _no_traceback(text)
    _partial_report(out)


def test_ctrl_c_of_kvemu_run_while_the_workload_is_made_says_nothing_ran(tmp_path):
    """Issue #44 defect 8: a Ctrl-C while the workload was made wrote a 0/0 "partial report". Now: nothing ran,
    no report, exit 130."""
    out = tmp_path / "out"
    scenario = small(tmp_path, [BIG, "run: {mode: virtual, seed: 4, duration_s: 60}\n"])
    with Terminal("run", str(scenario), "-o", str(out)) as term:
        code, text = term.interrupt_when(r"generating the workload: [1-9][\d,]* requests so far \(of ~24,000\)")
    assert code == 130, text[-3000:]
    assert "kvemu run: interrupted (SIGINT) while generating the workload: nothing ran; no report" in text, \
        text[-3000:]
    _no_traceback(text)
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize("how", ["ctrl_c", "sigterm"])
def test_kvemu_loadgen_over_http_stopped_in_a_terminal_leaves_a_partial_report(tmp_path, how):
    """``kvemu loadgen --http`` against a router's OpenAI front door: Ctrl-C twice (the second while it writes) or
    SIGTERM (which killed it, no report) leave the whole partial report, with the signal as its stop reason."""
    import os
    import signal

    from harness.procs.up import Children
    from tests.end_to_end.test_processes import router_and_worker

    out = tmp_path / "out"
    scenario = small(tmp_path, ["run: {mode: live, seed: 4, duration_s: 30}\n"])
    kids = Children()
    try:
        router = router_and_worker(kids, scenario, 0, *FAST, router_args=(*FAST, "--http", "127.0.0.1:0"))
        with Terminal("loadgen", "--http", router["http"], "-o", str(out), str(scenario), *FAST) as term:
            if how == "ctrl_c":
                code, text = term.interrupt_when(r"kvemu loadgen: running: [1-9]", times=2)
            else:
                term.wait_for(r"kvemu loadgen: running: [1-9]", 60)
                os.kill(term.proc.pid, signal.SIGTERM)
                code, text = term.wait(60), term.output
    finally:
        kids.stop_all(grace_s=5)
    reason = "SIGINT" if how == "ctrl_c" else "SIGTERM"
    assert code == 130, text[-3000:]
    assert f"(PARTIAL: {reason}); report in {out}/report.md" in text, text[-3000:]
    _no_traceback(text)
    _partial_report(out, reason)


def _bench_routers(tmp_path, out, env):
    """``kvemu bench-router`` of a short live run through kvemu's own router, then a round-robin proxy given as a
    ``cmd:`` router, on a terminal."""
    import sys
    from pathlib import Path

    scenario = small(tmp_path, ["run: {mode: live, seed: 4, duration_s: 8}\n"])
    proxy = Path(__file__).parents[2] / "examples" / "my_router.py"
    return Terminal("bench-router", str(scenario), *FAST, "--router", "kvemu", "--router",
                    f"cmd:{sys.executable} {proxy} {{port}} {{workers}}", "-o", str(out), env=env)


SECOND_ROUTER_RUNNING = r"cmd:my_router.py: replaying through [^\n]*\n[\s\S]*kvemu loadgen: running: [1-9]"
"""bench-router's first router (kvemu) is done and requests go through the second (the proxy)."""


def _routers_so_far(out, reason="SIGINT") -> list[dict]:
    """The rows of a bench-router stopped during its second router: the first whole, the second partial, its run
    matched to the engines' truth (the fleet was still there when it was asked), and the table says so."""
    table = json.loads((out / "routers.json").read_text())
    rows = table["routers"]
    assert [r["router"] for r in rows] == ["kvemu:kv", "cmd:my_router.py"], rows
    assert table["about"]["interrupted"] == {"signal": reason, "router": "cmd:my_router.py"}, table["about"]
    first, second = rows
    assert first["error"] is None and first.get("partial") is None and first["completed"] > 0, first
    assert second["partial"] == reason and second["completed"] > 0, second
    whole = json.loads((out / "kvemu-kv" / "summary.json").read_text())
    assert not whole["partial"] and whole["completed_requests"] == whole["num_requests"] == first["completed"]
    cut = _partial_report(out / "cmd-my_router.py", reason)
    # every request answered is matched to what the engine did (one cancelled before a worker had it is not)
    assert cut["kvemu"]["hook_counts"]["engine_truth_matched"] >= cut["completed_requests"], cut["kvemu"]["hook_counts"]
    md = (out / "routers.md").read_text()
    assert f"interrupted ({reason}) during cmd:my_router.py" in md, md
    assert f"| cmd:my_router.py (PARTIAL: {reason}) |" in md, md
    return rows


@pytest.mark.parametrize("how", ["ctrl_c", "sigterm"])
def test_ctrl_c_of_kvemu_bench_router_keeps_the_routers_benchmarked_and_the_table_so_far(tmp_path, how):
    """Issue #44: a Ctrl-C in a terminal during bench-router's second router reached its fleet and router too, so
    the load generator found no engine to ask for its truth, and no table (routers.md) was written: only "the
    routers' reports so far are in their folders". Now the children are out of the terminal's process group: the
    second router's partial run is whole, the table holds both rows (the second marked partial), one line says
    where, and nothing is left running. SIGTERM (to bench-router alone) does the same, with exit 143."""
    import os
    import signal

    out = tmp_path / "out"
    tag, env = tagged_env()
    with _bench_routers(tmp_path, out, env) as term:
        if how == "ctrl_c":
            code, text = term.interrupt_when(SECOND_ROUTER_RUNNING, timeout_s=90)
        else:
            term.wait_for(SECOND_ROUTER_RUNNING, 90)
            os.kill(term.proc.pid, signal.SIGTERM)
            code, text = term.wait(60), term.output
    reason = "SIGINT" if how == "ctrl_c" else "SIGTERM"
    assert code == (130 if how == "ctrl_c" else 143), text[-3000:]
    assert (f"kvemu bench-router: interrupted ({reason}) during cmd:my_router.py: 1 router benchmarked, 1 stopped "
            f"part way; the table so far (partial) in {out}/routers.md") in text, text[-3000:]
    _no_traceback(text)
    _routers_so_far(out, reason)
    assert _gone(tag)


def test_a_second_ctrl_c_of_kvemu_bench_router_keeps_the_report_and_the_table(tmp_path):
    """A second Ctrl-C while bench-router writes the stopped router's partial report: the report and the table are
    written all the same, the router and fleet stopped, no traceback."""
    out = tmp_path / "out"
    tag, env = tagged_env()
    with _bench_routers(tmp_path, out, env) as term:
        term.wait_for(SECOND_ROUTER_RUNNING, 90)
        first = term.ctrl_c()
        code, text = term.interrupt_when(r"kvemu: SIGINT: writing the partial report in ")
        took = time.monotonic() - first
    assert code == 130, text[-3000:]
    assert "SIGINT: the partial report is being written; kvemu stops once it is" in text, text[-3000:]
    assert f"the table so far (partial) in {out}/routers.md" in text, text[-3000:]
    _no_traceback(text)
    _routers_so_far(out)
    assert took < 30, took
    assert _gone(tag)


SWEEP = "axes:\n  run.duration_s: [4, 60, 70]\n"
"""Three points, short, then two a little longer (one process: in that order)."""


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_of_kvemu_sweep_in_a_terminal_keeps_the_finished_runs_and_the_same_command_resumes(tmp_path, presses):
    """``kvemu sweep`` on a terminal, Ctrl-C once its first run finished and while the second runs (and, with two
    presses, again while it writes its outputs): the finished run is kept, sweep.csv, sweep.json and sweep.md are
    written, one line says where and how to resume, nothing is left running (pool workers, fork server), and the
    same command runs only the two runs left. A second Ctrl-C used to cut sweep.md short with a traceback."""
    import subprocess
    import sys

    sweep, out = tmp_path / "s.yaml", tmp_path / "out"
    sweep.write_text(SWEEP)
    tag, env = tagged_env()
    with Terminal("sweep", str(sweep), "--jobs", "1", "-o", str(out), env=env) as term:
        if presses == 1:
            code, text = term.interrupt_when(r" 1/3 ")
        else:
            term.wait_for(r" 1/3 ", 60)
            term.ctrl_c()
            code, text = term.interrupt_when(r"kvemu sweep: SIGINT: writing sweep.csv, sweep.json and sweep.md in ")
    assert code == 130, text[-3000:]
    assert f"kvemu sweep: interrupted (SIGINT): 1 of 3 runs finished, kept in {out}/sweep.md; run the same " \
           "command again to resume" in text, text[-3000:]
    _no_traceback(text)
    assert _gone(tag)
    rows = (out / "sweep.csv").read_text().splitlines()[1:]
    assert [r.split(",")[3] for r in rows] == ["ok", "pending", "pending"], rows
    assert "Interrupted (SIGINT): 2 runs did not finish" in (out / "sweep.md").read_text()
    again = subprocess.run([sys.executable, "-m", "harness.cli", "sweep", str(sweep), "--jobs", "1", "-o", str(out),
                            "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert again.returncode == 0, again.stderr
    assert "(2 to run, 1 finished before)" in again.stderr and "3 ok (2 ran now, 1 reused)" in again.stderr
