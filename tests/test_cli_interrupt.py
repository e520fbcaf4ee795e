"""Ctrl-C stops `kvemu run` cleanly and still writes a report, marked partial."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ctrl_c_writes_a_partial_report(tmp_path):
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
    proc.send_signal(signal.SIGINT)
    code = proc.wait(60)
    err = proc.stderr.read()
    assert code == 130, err[-1000:]
    assert "PARTIAL" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["partial"] is True and summary["kvemu"]["partial"] is True
    assert 0 < summary["num_requests"]
    assert "PARTIAL RUN" in (out / "report.md").read_text()
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == summary["num_requests"]
