"""docker-compose: router, three scaled workers and a load generator in containers on host networking; with
the ``disagg`` profile, a router hosting both pools, ``prefill`` and ``decode`` workers and their load generator.

The tests marked ``compose`` need a Docker engine (``../shared/tools/docker-up.sh`` provides one here) and
run after the unit tests in ``.ci/run``; the others read the compose file only.
"""

import json
import shlex
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from tests.process_output import json_events

from harness.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]

compose = pytest.mark.compose
DOCS_LIVE_COMMAND = "docker-compose up --build --scale worker=3"
"""docs/live.md's compose line (tests/test_docs.py holds the two equal); run as written, plus the flags that end
the stack when its load generator exits."""
UP = [*shlex.split(DOCS_LIVE_COMMAND)[1:], "--abort-on-container-exit", "--exit-code-from", "loadgen"]
UP_DISAGG = ["--profile", "disagg", "up", "--build", "--scale", "prefill=1", "--scale", "decode=2",
             "--abort-on-container-exit", "--exit-code-from", "loadgen-disagg", "prefill", "decode", "loadgen-disagg"]
"""The command lines docker-compose.yml's comment gives."""
IMAGE_LABEL = "org.kvemu.image=kvemu"
"""The label the Dockerfile puts on kvemu's image."""


def compose_up(tmp_path, probe=None, up=UP, **env_extra: str) -> subprocess.CompletedProcess:
    """``docker-compose up`` (by default with three workers) until the load generator exits, then ``down``;
    ``probe(port)`` runs while the stack is up (against the router's front door)."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (run ../shared/tools/docker-up.sh)")
    port = _free_port()
    env = {"KVEMU_OUT": str(tmp_path), "KVEMU_WORKERS": "3", "KVEMU_HTTP_PORT": str(port),
           "PATH": "/usr/local/bin:/usr/bin:/bin", **env_extra}
    cmd = ["docker-compose", "-p", "kvemutest", *up]
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if probe is not None:
            probe(port)
        stdout, stderr = proc.communicate(timeout=600)
        res = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    finally:
        subprocess.run(["docker-compose", "-p", "kvemutest", "--profile", "disagg", "down", "--timeout", "5"],
                       cwd=ROOT, env=env, capture_output=True, timeout=120)
        # Each --build leaves the image it superseded dangling (~0.5 GB, several GB on vfs storage): prune
        # kvemu's own dangling images only, so repeated runs do not fill the disk.
        subprocess.run(["docker", "image", "prune", "--force", "--filter", f"label={IMAGE_LABEL}"],
                       env=env, capture_output=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def assert_no_superseded_image() -> None:
    """Every ``--build`` supersedes the last image; ``compose_up`` prunes it (repeated CI runs once filled the
    disk with them), and leaves kvemu:latest, which carries the Dockerfile's label."""
    def images(*filters: str) -> list[str]:
        args = [a for f in filters for a in ("--filter", f)]
        return subprocess.run(["docker", "images", "--quiet", *args], capture_output=True, text=True, timeout=60,
                              check=True).stdout.split()
    assert images("dangling=true", f"label={IMAGE_LABEL}") == []
    assert len(images(f"label={IMAGE_LABEL}")) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@compose
def test_compose_scales_workers_and_reports_requests_on_all_of_them(tmp_path):
    answers = []

    def probe(port: int) -> None:  # the published front door answers while the load generator runs
        deadline = time.monotonic() + 300
        body = json.dumps({"model": "kvemu", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                           "nvext": {"extra_fields": ["worker_id"]}}).encode()
        while time.monotonic() < deadline and not answers:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                             headers={"content-type": "application/json"})
                with urllib.request.urlopen(req, timeout=5) as resp:
                    answers.append(json.loads(resp.read()))
            except OSError:
                time.sleep(0.2)

    compose_up(tmp_path, probe)
    assert answers and answers[0]["usage"]["completion_tokens"] >= 1
    assert answers[0]["nvext"]["worker_id"]["decode_worker_id"] is not None
    summary = json.loads((tmp_path / "compose" / "summary.json").read_text())
    assert summary["num_requests"] > 0 and summary["completed_requests"] == summary["num_requests"]
    busy_workers = {r["worker_id"] for r in summary["kvemu"]["per_rank"] if r["requests"]}
    assert len(busy_workers) == 3
    assert len(summary["kvemu"]["per_rank"]) == 6  # 3 workers × 2 DP ranks, all visible
    assert sum(w["batches"] for w in summary["kvemu"]["kv_events"]["per_worker"]) > 0


@compose
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
    assert_no_superseded_image()


@compose
def test_compose_disagg_profile_serves_every_request_through_both_pools(tmp_path):
    compose_up(tmp_path, up=UP_DISAGG)
    summary = json.loads((tmp_path / "compose-disagg" / "summary.json").read_text())
    assert summary["num_requests"] > 0 and summary["completed_requests"] == summary["num_requests"]
    dis = summary["kvemu"]["disaggregated"]
    assert len(dis["requests_per_prefill_rank"]) == 2 and len(dis["requests_per_decode_rank"]) == 2
    assert_no_superseded_image()


def test_the_disagg_profile_starts_prefill_and_decode_workers_beside_the_default_stack():
    """Read without Docker: the default services are as before (no profile); the ``disagg`` profile's workers
    name their pools and its router, its load generator waits for every worker of its example scenario."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert [n for n, s in services.items() if "profiles" not in s] == ["router", "worker", "loadgen"]
    assert "--worker-type" not in services["worker"]["command"]
    disagg = {n: s for n, s in services.items() if s.get("profiles") == ["disagg"]}
    assert set(disagg) == {"router-disagg", "prefill", "decode", "loadgen-disagg"}
    listen = disagg["router-disagg"]["command"][2]
    for pool in ("prefill", "decode"):
        cmd = disagg[pool]["command"]
        assert cmd[:2] == ["worker", "--worker-type"] and cmd[2] == pool
        assert cmd[cmd.index("--router") + 1] == listen
    loadgen = disagg["loadgen-disagg"]["command"]
    assert loadgen[loadgen.index("--router") + 1] == listen
    scenario = load_scenario(ROOT / "examples" / "compose-disagg.yaml")
    workers = sum(n for n, _, _ in scenario.cluster.pools().values())
    assert loadgen[loadgen.index("--expect-workers") + 1] == f"${{KVEMU_WORKERS:-{workers}}}"
    assert scenario.cluster.disaggregated and scenario.run.mode == "live"
    assert UP_DISAGG[UP_DISAGG.index("prefill=1") - 1: UP_DISAGG.index("decode=2") + 1] == [
        "--scale", f"prefill={scenario.cluster.prefill.workers}", "--scale", f"decode={scenario.cluster.decode.workers}"]
