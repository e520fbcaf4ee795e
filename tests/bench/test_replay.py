"""``python -m bench.replay``: one child process per run, peak RSS figures, p99 TTFT among the targets.

The first test replays the first 60 requests of the Mooncake trace with round robin on both sides (about
2 s) and reads the figures off stdout; it needs the reference (``reference`` test) and runs on the trace or its generated stand-in. The
second breaks a run on purpose (a trace that is not JSON, kvemu only) and needs neither.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench_replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.replay", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.reference
def test_round_robin_slice_prints_peak_rss_and_counts_the_p99_target(dynamo_core, mooncake_trace):
    proc = bench_replay("--trace", str(mooncake_trace), "--max-requests", "60", "--policy", "round_robin")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for side in ("kvemu", "reference"):
        assert re.search(rf"^{side} round_robin peak rss: \d+\.\d MB$", out, re.M), out
        assert re.search(rf"^{side} round_robin wall time: \d+\.\d\d s$", out, re.M), out
        assert re.search(rf"^{side} round_robin p99 ttft: \d+\.\d\d ms$", out, re.M), out
    assert re.search(r"^round_robin wall time ratio vs reference: \d+\.\d\dx$", out, re.M), out
    assert re.search(r"^round_robin peak rss ratio vs reference: \d+\.\d\dx$", out, re.M), out
    # 6 figures within 5 % (mean/p50/p99 TTFT, mean E2E, mean ITL, reuse), goodput within 2 %, wall time and
    # peak RSS
    assert re.search(r"^fidelity targets met: \d of 9$", out, re.M), out
    assert re.search(r"^round_robin goodput requests ratio vs reference: \d+\.\d\dx$", out, re.M), out
    assert re.search(r"^# (met   |MISSED) round_robin p99 ttft within 5 % of the reference", proc.stderr, re.M)
    assert re.search(r"^# (met   |MISSED) round_robin peak rss no larger than the reference", proc.stderr, re.M)


def test_a_crashed_run_fails_the_bench_naming_the_run_with_its_stderr(tmp_path):
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n")
    proc = bench_replay("--trace", str(garbage), "--policy", "round_robin", "--no-reference")
    assert proc.returncode == 1, proc.stderr
    assert "bench.replay: FAILED: kvemu round_robin: its child process failed (exit status 1)" in proc.stderr
    assert "\n    Traceback (most recent call last):" in proc.stderr, proc.stderr  # the child's stderr, indented
    assert "peak rss" not in proc.stdout
