"""docker-compose: router, three scaled workers and a load generator in containers on host networking.

Marked ``compose``: it needs a Docker engine (``../shared/tools/docker-up.sh`` provides one here) and
runs after the unit tests in ``.ci/run``.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.compose


def test_compose_scales_workers_and_reports_requests_on_all_of_them(tmp_path):
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (run ../shared/tools/docker-up.sh)")
    env = {"KVEMU_OUT": str(tmp_path), "KVEMU_WORKERS": "3", "PATH": "/usr/local/bin:/usr/bin:/bin"}
    cmd = ["docker-compose", "-p", "kvemutest", "up", "--build", "--scale", "worker=3", "--abort-on-container-exit",
           "--exit-code-from", "loadgen"]
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        subprocess.run(["docker-compose", "-p", "kvemutest", "down", "--timeout", "5"], cwd=ROOT, env=env,
                       capture_output=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((tmp_path / "compose" / "summary.json").read_text())
    assert summary["num_requests"] > 0 and summary["completed_requests"] == summary["num_requests"]
    busy_workers = {r["worker_id"] for r in summary["kvemu"]["per_rank"] if r["requests"]}
    assert len(busy_workers) == 3
    assert len(summary["kvemu"]["per_rank"]) == 6  # 3 workers × 2 DP ranks, all visible
    assert sum(w["batches"] for w in summary["kvemu"]["kv_events"]["per_worker"]) > 0
