"""``python -m bench.profile``: a profiled virtual replay of the first 40 Mooncake requests (a few seconds).

Runs on the Mooncake trace, or on its generated stand-in where the real one is absent (the ``mooncake_trace``
fixture).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_profile_splits_the_self_time_into_layers_and_counts_loop_iterations(mooncake_trace):
    proc = subprocess.run([sys.executable, "-m", "bench.profile", "--quick", "--requests", "40", "--top", "5",
                           "--trace", str(mooncake_trace)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(r"^requests completed: 40$", out, re.M), out
    assert re.search(r"^wall time: \d+\.\d\d s$", out, re.M), out
    assert re.search(r"^simulated requests: \d+ per s$", out, re.M), out
    layers = dict(re.findall(r"^self time (.+): (\d+\.\d) %$", out, re.M))
    assert {"event loop", "engine", "hashing", "routing policy", "builtins (C)", "other"} <= set(layers), out
    assert abs(sum(float(v) for v in layers.values()) - 100.0) <= 1.0, out
    shares = [float(v) for v in re.findall(r"^self time .+: (\d+\.\d) %$", out, re.M)]
    assert shares == sorted(shares, reverse=True), out  # largest first
    assert "# top 5 functions by self time" in out
    assert len(re.findall(r"^# \S.*  \d+\.\d{3} s  \d+ calls  \(.+\)$", out, re.M)) == 5, out
    assert re.search(r"^event loop iterations per request: \d+\.\d$", out, re.M), out
    assert re.search(r"^callbacks per request: (\d+\.\d|n/a)$", out, re.M), out


def test_a_missing_trace_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.profile", "--trace", str(tmp_path / "absent.jsonl")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "trace not found" in proc.stderr
    assert proc.stdout == ""
