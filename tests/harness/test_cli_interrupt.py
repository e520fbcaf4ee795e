"""Ctrl-C and SIGTERM stop `kvemu run` cleanly and still write a report, marked partial with the signal."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.process_supervision
@pytest.mark.parametrize(("sig", "code", "reason"), [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_ctrl_c_and_sigterm_write_a_partial_report(tmp_path, sig, code, reason):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness.cli", "run", "--set", "run.mode=live", "--set", "run.duration_s=60",
         "--set", "cluster.workers=2", "--set", "cluster.engine.speedup_ratio=4", "-o", str(out), "--quiet"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:  # wait until traffic is flowing
        time.sleep(0.5)
        if time.monotonic() > deadline - 25:
            break
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
