"""docker-compose: router, three scaled workers and a load generator in containers on host networking.

Marked ``compose``: it needs a Docker engine (``../shared/tools/docker-up.sh`` provides one here) and
runs after the unit tests in ``.ci/run``.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from process_output import json_events

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.compose


def compose_up(tmp_path, **env_extra: str) -> subprocess.CompletedProcess:
    """``docker-compose up`` with three workers until the load generator exits, then ``down``."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (run ../shared/tools/docker-up.sh)")
    env = {"KVEMU_OUT": str(tmp_path), "KVEMU_WORKERS": "3", "PATH": "/usr/local/bin:/usr/bin:/bin", **env_extra}
    cmd = ["docker-compose", "-p", "kvemutest", "up", "--build", "--scale", "worker=3", "--abort-on-container-exit",
           "--exit-code-from", "loadgen"]
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        subprocess.run(["docker-compose", "-p", "kvemutest", "down", "--timeout", "5"], cwd=ROOT, env=env,
                       capture_output=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def test_compose_scales_workers_and_reports_requests_on_all_of_them(tmp_path):
    compose_up(tmp_path)
    summary = json.loads((tmp_path / "compose" / "summary.json").read_text())
    assert summary["num_requests"] > 0 and summary["completed_requests"] == summary["num_requests"]
    busy_workers = {r["worker_id"] for r in summary["kvemu"]["per_rank"] if r["requests"]}
    assert len(busy_workers) == 3
    assert len(summary["kvemu"]["per_rank"]) == 6  # 3 workers × 2 DP ranks, all visible
    assert sum(w["batches"] for w in summary["kvemu"]["kv_events"]["per_worker"]) > 0


def test_compose_runs_the_chaos_timeline_from_the_load_generator(tmp_path):
    """The load generator carries the timeline through the router's control channel: each action is applied
    in the containers (the router restarts itself), and every request ends completed or failed."""
    res = compose_up(tmp_path, KVEMU_SCENARIO="examples/compose-chaos.yaml", KVEMU_CONTROL_TOKEN="compose-test")
    out = res.stdout + res.stderr
    applied = [(a["action"], a["ok"]) for a in json_events(out, "chaos")]
    assert applied == [("drop_kv_events", True), ("delay_kv_events", True), ("slow_worker", True),
                       ("kill_rank", True), ("restart_router", True)], out[-3000:]
    assert len(json_events(out, "chaos_applied")) >= 6  # the workers applied them (delay: every worker)
    summary = json.loads((tmp_path / "compose" / "summary.json").read_text())
    k = summary["kvemu"]
    assert k["hook_counts"]["router_restarts"] == 1 and k["unfinished_requests"] == 0
    assert summary["completed_requests"] + k["failed_requests"] == summary["num_requests"] > 0
