"""Ctrl-C and SIGTERM stop `kvemu run` cleanly and still write a report, marked partial with the signal."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# ``kvemu run`` as the console script runs it, with one observer more: it creates a marker file once a request
# completed, so the test signals a run whose traffic flows (no fixed wait: a slow machine only takes longer)
RUN_MARKING_TRAFFIC = """
import sys
from pathlib import Path

import harness.run.runner as runner
from harness.cli import main

marker = Path(sys.argv[1])
run_scenario = runner.run_scenario


def marking(*args, observers=(), **kw):
    def mark(ev):
        if ev.kind == "completed" and not marker.exists():
            marker.touch()

    return run_scenario(*args, observers=[*observers, mark], **kw)


runner.run_scenario = marking
sys.exit(main(sys.argv[2:]))
"""


def _wait_for(condition, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll ``condition`` until it holds; fail if ``proc`` exits first or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"kvemu run exited ({proc.returncode}) before: {proc.stderr.read()[-1000:]}"
        assert time.monotonic() < deadline, f"no request completed within {timeout_s:g} s"
        time.sleep(0.05)


@pytest.mark.process_supervision
@pytest.mark.parametrize(("sig", "code", "reason"), [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_ctrl_c_and_sigterm_write_a_partial_report(tmp_path, sig, code, reason):
    out = tmp_path / "out"
    marker = tmp_path / "traffic"
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN_MARKING_TRAFFIC, str(marker),
         "run", "--set", "run.mode=live", "--set", "run.duration_s=60",
         "--set", "cluster.workers=2", "--set", "cluster.engine.speedup_ratio=4", "-o", str(out), "--quiet"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )
    try:
        _wait_for(marker.exists, proc, 60)  # until traffic is flowing
    except BaseException:
        proc.kill()
        raise
    proc.send_signal(sig)
    assert proc.wait(60) == code, proc.stderr.read()[-1000:]
    err = proc.stderr.read()
    assert f"PARTIAL: {reason}" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["partial"] is True and summary["kvemu"]["partial"] is True
    assert summary["kvemu"]["stop_reason"] == reason
    assert 0 < summary["num_requests"]
    assert f"PARTIAL RUN — this report covers only what finished before the run was interrupted ({reason})" in (
        out / "report.md").read_text()
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == summary["num_requests"]
