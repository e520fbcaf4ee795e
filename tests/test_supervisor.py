"""kvemu up's supervisor and the load generator under faults it did not ask for (issue #27): a worker process
killed from outside, a router stopped (SIGSTOP) but alive, a report directory that becomes unwritable, and the
one-line messages of a refused or unauthenticated worker (real processes on 127.0.0.1, each bounded in time)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from process_output import json_events, tagged, tagged_env

ROOT = Path(__file__).resolve().parents[1]
ENGINE = "{num_gpu_blocks: 2048, block_size: 16, speedup_ratio: 20, decode_speedup_ratio: 20}"
WORKLOAD = """workload: {kind: synthetic, rate_rps: 15, turns: 2, think_time_s: 0.2, system_prefix_tokens: 64,
           isl: {kind: constant, mean: 96}, osl: {kind: constant, mean: 8}}
"""
AGGREGATED = f"cluster: {{workers: 2, dp_size: 2, engine: {ENGINE}}}\n"
DISAGGREGATED = f"""cluster:
  prefill: {{workers: 1, engine: {ENGINE}}}
  decode: {{workers: 2, engine: {ENGINE}}}
"""


def scenario(tmp_path: Path, cluster: str = AGGREGATED, run: str = "", duration_s: float = 4.0) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(f"name: sup\n{cluster}router: {{policy: kv, heartbeat_timeout_s: 1.5}}\n{WORKLOAD}"
                    f"run: {{mode: live, seed: 4, duration_s: {duration_s}{run}}}\n")
    return path


def up(path: Path, out: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """``kvemu up`` of ``path``, its children tagged; returns it once its load generator runs, and the tag."""
    tag, env = tagged_env()
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "up", str(path), "-o", str(out), *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while not any(" loadgen " in c for c in tagged(tag).values()):
        assert time.monotonic() < deadline and proc.poll() is None, "the load generator did not start"
        time.sleep(0.1)
    return proc, tag


def child(tag: str, marker: str) -> int:
    """The pid of the one tagged child process whose command line holds ``marker``."""
    (pid,) = [p for p, c in tagged(tag).items() if marker in c and " up " not in c]
    return pid


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def summary_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def accounted(s: dict) -> bool:
    k = s["kvemu"]
    return s["completed_requests"] + k["failed_requests"] + k["unfinished_requests"] == s["num_requests"] > 0


# ------------------------------------------------------------------ a worker process killed from outside


def _kill_worker_1(tmp_path: Path, cluster: str, run: str = "") -> tuple[int, str, Path]:
    out = tmp_path / "out"
    proc, tag = up(scenario(tmp_path, cluster, run), out)
    time.sleep(1.0)
    os.kill(child(tag, "--worker-id 1 "), signal.SIGKILL)
    code, err = finish(proc)
    return code, err, out


def test_a_worker_killed_from_outside_is_a_fault_the_run_carries_on_through(tmp_path):
    """Disaggregated (worker 1 is a decode worker): the run goes on, the router fences the dead worker, what it
    held fails with worker_lost, and the report has every request."""
    code, err, out = _kill_worker_1(tmp_path, DISAGGREGATED)
    assert code == 0, err[-3000:]
    assert "worker-1 exited (signal SIGKILL); the cluster carries on without it" in err
    assert json_events(err, "worker_exited") == [{"event": "worker_exited", "worker_id": 1, "how": "signal SIGKILL"}]
    s = summary_of(out)
    assert not s["partial"] and accounted(s) and s["kvemu"]["unfinished_requests"] == 0
    assert set(s["kvemu"]["failed_requests_by_reason"]) <= {"worker_lost"}
    assert s["kvemu"]["worker_events"].get("worker_fenced", 0) >= 1  # the router noticed the silence
    assert s["completed_requests"] > 0.8 * s["num_requests"]  # the rest of the cluster served the run


def test_an_aggregated_worker_killed_from_outside_is_a_fault_too(tmp_path):
    code, err, out = _kill_worker_1(tmp_path, AGGREGATED)
    assert code == 0, err[-3000:]
    s = summary_of(out)
    assert not s["partial"] and accounted(s)
    assert set(s["kvemu"]["failed_requests_by_reason"]) <= {"worker_lost"}


def test_a_scenario_may_ask_to_stop_when_a_worker_exits(tmp_path):
    code, err, _ = _kill_worker_1(tmp_path, AGGREGATED, ", stop_on_worker_exit: true")
    assert code == 1 and "kvemu up: worker-1 exited (signal SIGKILL); stopping" in err, err[-3000:]


def test_stop_on_worker_exit_is_validated(tmp_path):
    res = subprocess.run([sys.executable, "-m", "harness.cli", "validate",
                          str(scenario(tmp_path, run=", stop_on_worker_exit: maybe"))], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "stop_on_worker_exit" in res.stderr and "Traceback" not in res.stderr


# ------------------------------------------------------------------ a router stopped, not gone


def test_a_stopped_router_is_waited_for_not_declared_lost(tmp_path):
    """SIGSTOP of the router for 7 s (beyond the 5 s silence rule): kvemu up's load generator knows its process
    is alive and waits; once it runs again the run completes, and no worker is fenced for the router's own
    stall (their heartbeats were waiting in its socket)."""
    out = tmp_path / "out"
    proc, tag = up(scenario(tmp_path, duration_s=5.0), out)
    router = child(tag, " router ")
    time.sleep(1.0)
    os.kill(router, signal.SIGSTOP)
    try:
        time.sleep(7.0)
    finally:
        os.kill(router, signal.SIGCONT)
    code, err = finish(proc)
    assert code == 0, err[-3000:]
    assert json_events(err, "router_silent") and not json_events(err, "router_lost")
    s = summary_of(out)
    k = s["kvemu"]
    assert not s["partial"] and accounted(s) and k["failed_requests"] == 0 and k["unfinished_requests"] == 0, k
    assert "worker_fenced" not in k["worker_events"], k["worker_events"]


def test_a_silent_router_is_still_lost_after_the_configured_bound(tmp_path):
    """run.router_stall_s bounds the wait for a living but silent router; the run then ends as router_lost."""
    out = tmp_path / "out"
    proc, tag = up(scenario(tmp_path, run=", router_silence_s: 1, router_stall_s: 2", duration_s=30.0), out)
    router = child(tag, " router ")
    time.sleep(1.0)
    os.kill(router, signal.SIGSTOP)
    started = time.monotonic()
    try:
        code, err = finish(proc, timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # kvemu up stopped it
            os.kill(router, signal.SIGCONT)
    assert time.monotonic() - started < 20
    assert code == 130, err[-3000:]
    assert json_events(err, "router_silent") and json_events(err, "router_lost")
    s = summary_of(out)
    assert s["partial"] and s["kvemu"]["stop_reason"] == "router_lost" and accounted(s)
