"""The chaos timeline on real processes, beyond kvemu up: the router's control channel and its token, the load
generator carrying the timeline (as in docker-compose), and a router process replaced under a running load
generator (127.0.0.1 only, each test bounded in time)."""

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from harness.chaos import CONTROL_TOKEN_ENV
from harness.procs.protocol import send_control
from harness.scenario import ChaosEvent
from harness.workload.sessions import SessionPlayer
from harness.procs.up import Children, cli_command, cli_env
from tests.process_output import json_events

pytestmark = pytest.mark.process_supervision

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--set", "cluster.engine.speedup_ratio=20", "--set", "cluster.engine.decode_speedup_ratio=20"]


def scenario(tmp_path: Path, chaos: str = "", duration_s: float = 3.0) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(f"""
name: pchaos
cluster: {{workers: 2, dp_size: 2, engine: {{block_size: 16, num_gpu_blocks: 2048}}}}
router: {{policy: kv, heartbeat_timeout_s: 1.5}}
workload: {{kind: synthetic, rate_rps: 15, turns: 2, think_time_s: 0.2, system_prefix_tokens: 64,
           isl: {{kind: constant, mean: 96}}, osl: {{kind: constant, mean: 8}}}}
run: {{mode: live, seed: 4, duration_s: {duration_s}}}
""" + chaos)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_stack(kids: Children, path: Path, token: str | None, listen: str = "tcp://127.0.0.1:0",
                engine: list[str] = FAST) -> str:
    env = {CONTROL_TOKEN_ENV: token} if token else {}
    router = kids.start("router", ["router", "--listen", listen, "--config", str(path), *FAST], env=env)["listen"]
    for w in (0, 1):
        kids.start(f"w{w}", ["worker", "--router", router, "--worker-id", str(w), "--config", str(path), *engine])
    return router


def loadgen(router: str, path: Path, out: Path, *args: str, token: str | None = None) -> subprocess.Popen:
    env = {**cli_env(), **({CONTROL_TOKEN_ENV: token} if token else {})}
    env.pop(CONTROL_TOKEN_ENV, None) if token is None else None
    return subprocess.Popen(cli_command("loadgen", "--router", router, "--expect-workers", "2", "-o", str(out),
                                        str(path), *FAST, *args), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def test_the_control_channel_takes_only_the_right_token(tmp_path):
    kids = Children()
    try:
        router = start_stack(kids, scenario(tmp_path), "s3cret")
        slow = ChaosEvent(at_s=0, action="slow_worker", worker=1, factor=2.0)
        assert send_control(router, "wrong", slow).detail.startswith("wrong control token")
        assert not send_control(router, "x" * 10_000, slow).ok
        assert not send_control(router, "s3cret", ChaosEvent(at_s=0, action="add_worker")).ok
        reply = send_control(router, "s3cret", ChaosEvent(at_s=0, action="kill_rank", worker=7))
        assert not reply.ok and "worker 7 is not registered" in reply.detail
        assert send_control(router, "s3cret", slow).ok
    finally:
        kids.stop_all()
    kids = Children()
    try:  # a router started without a token takes no control at all
        router = start_stack(kids, scenario(tmp_path), None)
        reply = send_control(router, "", ChaosEvent(at_s=0, action="restart_router"))
        assert not reply.ok and "takes no control messages" in reply.detail
    finally:
        kids.stop_all()


def test_the_load_generator_carries_the_timeline_through_the_control_channel(tmp_path):
    """As in docker-compose: the load generator applies the router-side actions at their instants."""
    path = scenario(tmp_path, """chaos:
  - {at_s: 0.5, action: kill_rank, worker: 1, dp_rank: 1}
  - {at_s: 1.0, action: restart_router}
""")
    out = tmp_path / "out"
    kids = Children()
    try:
        router = start_stack(kids, path, "tok")
        proc = loadgen(router, path, out, "--chaos", "apply", token="tok")
        code = proc.wait(120)
        err = proc.stderr.read()
    finally:
        kids.stop_all()
    assert code == 0, err[-3000:]
    applied = json_events(err, "chaos")
    assert [(a["action"], a["ok"]) for a in applied] == [("kill_rank", True), ("restart_router", True)], applied
    summary = json.loads((out / "summary.json").read_text())
    k = summary["kvemu"]
    assert k["hook_counts"]["router_restarts"] == 1 and k["unfinished_requests"] == 0
    assert summary["completed_requests"] + k["failed_requests"] == summary["num_requests"] > 0


def test_the_load_generator_refuses_a_timeline_it_cannot_apply(tmp_path):
    def run(chaos: str, *args: str, token: str | None = "t") -> subprocess.CompletedProcess:
        env = {**cli_env(), CONTROL_TOKEN_ENV: token or ""}
        return subprocess.run(cli_command("loadgen", "--router", "tcp://127.0.0.1:9", str(scenario(tmp_path, chaos)),
                                          *args), env=env, capture_output=True, text=True, timeout=60)

    add = "chaos:\n  - {at_s: 1, action: add_worker}\n"
    res = run(add)
    assert res.returncode == 2 and "pass --chaos apply" in res.stderr and "--chaos skip" in res.stderr
    res = run(add, "--chaos", "apply")
    assert res.returncode == 2 and "chaos[0] add_worker at 1 s cannot be applied by the load generator" in res.stderr
    res = run("chaos:\n  - {at_s: 1, action: restart_router}\n", "--chaos", "apply", token=None)
    assert res.returncode == 2 and f"--chaos apply needs {CONTROL_TOKEN_ENV}" in res.stderr


def test_a_replaced_router_process_does_not_drop_the_requests_the_old_one_lost(tmp_path):
    """kill -9 of the router and a new router process on the same address: the load generator notices the new
    router, fails what the old one never answered with router_lost, counts the restart and carries on."""
    path = scenario(tmp_path, duration_s=6.0)
    out = tmp_path / "out"
    listen = f"tcp://127.0.0.1:{free_port()}"
    kids = Children()
    try:
        # slow engines (a request takes about half a second): several are running when the router dies
        router = start_stack(kids, path, None, listen, ["--set", "cluster.engine.speedup_ratio=0.2", "--own-engine"])
        proc = loadgen(router, path, out)
        time.sleep(2.0)
        kids.signal("router", signal.SIGKILL)
        kids.procs["router"].wait(10)
        kids.procs["old-router"] = kids.procs.pop("router")
        kids.start("router", ["router", "--listen", listen, "--config", str(path), *FAST])
        code = proc.wait(120)
        err = proc.stderr.read()
    finally:
        kids.stop_all()
    assert code == 0, err[-3000:]
    restarted = json_events(err, "router_restarted")
    assert len(restarted) == 1, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    k = summary["kvemu"]
    assert k["hook_counts"]["router_restarts"] == 1 and k["unfinished_requests"] == 0
    # those the old router held never end; those queued while no router listened reach the new one and run
    assert 1 <= k["failed_requests_by_reason"].get("router_lost", 0) <= restarted[0]["unanswered"]
    assert summary["completed_requests"] + k["failed_requests"] == summary["num_requests"]
    # the old process's counters (its last view) are kept: the two routers' completions add up to the records'
    assert 0.8 * summary["completed_requests"] <= k["hook_counts"]["completed"] <= summary["completed_requests"]


def test_kvemu_up_fails_the_open_requests_at_once_when_the_router_process_dies(tmp_path):
    """kvemu up tells the load generator (SIGUSR1) instead of letting it wait out five heartbeat intervals."""
    path = scenario(tmp_path, duration_s=20.0)
    out = tmp_path / "out"
    kids = Children()
    try:
        router = start_stack(kids, path, None, engine=["--set", "cluster.engine.speedup_ratio=0.2", "--own-engine"])
        proc = loadgen(router, path, out, "--set", "cluster.heartbeat_interval_s=4")  # would wait 20 s
        kids.procs["loadgen"] = proc
        time.sleep(2.0)
        kids.signal("router", signal.SIGKILL)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(60)
        waited = time.monotonic() - t0
        err = proc.stderr.read()
    finally:
        kids.stop_all()
    assert code == 130, err[-2000:]
    assert waited < 5.0, waited
    k = json.loads((out / "summary.json").read_text())["kvemu"]
    assert k["stop_reason"] == "router_lost" and k["failed_requests_by_reason"].get("router_lost", 0) >= 1


def test_the_load_generator_writes_a_partial_report_when_it_fails_itself(tmp_path, monkeypatch):
    """An unexpected exception in the load generator (here: its session player) still leaves a partial
    report of what ran, with the error as the stop reason; garbage from the router is skipped, not fatal."""
    import threading

    import anyio
    import msgspec
    import zmq

    import harness.procs.loadgen as processes
    from harness.scenario import parse_scenario

    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.bind("tcp://127.0.0.1:0")
    stop = threading.Event()

    def serve():  # answers stats queries, with one garbage message first
        garbage_sent = False
        while not stop.is_set():
            if fake.poll(20):
                peer, _, _ = fake.recv_multipart()
                if not garbage_sent:
                    fake.send_multipart([peer, processes.CLIENT, b"\xc1garbage"])
                    garbage_sent = True
                stats = processes.Stats(now_ns=time.monotonic_ns(), workers=[0], ranks=[(0, 0)], samples=[],
                                        kv_stats={})
                fake.send_multipart([peer, processes.CLIENT, msgspec.msgpack.encode(stats)])

    async def broken_run(self):
        await anyio.sleep(0.3)
        raise RuntimeError("boom")

    monkeypatch.setattr(SessionPlayer, "run", broken_run)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        sc = parse_scenario("name: broken\nrun: {mode: live, duration_s: 2}\n")
        summary = processes.loadgen_main(sc, fake.getsockopt_string(zmq.LAST_ENDPOINT), tmp_path / "out", 1)
    finally:
        stop.set()
        thread.join(5)
        ctx.destroy(linger=0)
    assert summary.partial is True
    assert summary.kvemu.stop_reason == "error: RuntimeError: boom"
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["partial"] is True


def test_an_unreachable_router_is_a_clear_error_not_a_traceback():
    import anyio

    from harness.procs.loadgen import RouterUnreachable, _await_router, _RouterClient

    async def main():
        client = _RouterClient(f"tcp://127.0.0.1:{free_port()}")  # nobody listens there
        await _await_router(client, "R", None, 1.0)  # nothing would come to listen for

    with pytest.raises(RouterUnreachable, match="no answer from the router at R within 1 s: is it running, and "
                                                "does it have the same KVEMU_SECRET"):
        anyio.run(main)


def test_kvemu_up_tells_the_load_generator_at_once_when_the_router_process_dies(tmp_path):
    """Killing the router child of kvemu up: the load generator fails what is open with router_lost and
    reports within seconds, not after five heartbeat intervals (20 s here)."""
    path = scenario(tmp_path, duration_s=30.0)
    out = tmp_path / "out"
    up = subprocess.Popen(cli_command("up", str(path), "-o", str(out), "--set", "cluster.heartbeat_interval_s=4",
                                      "--set", "cluster.engine.speedup_ratio=0.2"),
                          env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    errs: list[str] = []

    def read(stream, into):  # both pipes drained as they fill
        for line in stream:
            into.append(line)

    readers = [threading.Thread(target=read, args=(up.stdout, lines), daemon=True),
               threading.Thread(target=read, args=(up.stderr, errs), daemon=True)]
    for r in readers:
        r.start()
    try:
        deadline = time.monotonic() + 60
        while not any('"role": "loadgen"' in x for x in list(lines)) and time.monotonic() < deadline:
            time.sleep(0.1)
        kids = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(up.pid)], capture_output=True,
                              text=True).stdout.splitlines()
        router_pid = next((int(k.split()[0]) for k in kids if " router " in k), None)
        assert router_pid is not None, "kvemu up never started its router and load generator"
        time.sleep(3.0)  # the load is running
        os.kill(router_pid, signal.SIGKILL)
        t0 = time.monotonic()
        code = up.wait(60)
        waited = time.monotonic() - t0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    for r in readers:
        r.join(10)
    err = "".join(errs)
    assert code == 1 and "router exited (signal SIGKILL)" in err, err[-2000:]
    assert waited < 8.0, waited
    k = json.loads((out / "summary.json").read_text())["kvemu"]
    assert k["stop_reason"] == "router_lost" and k["failed_requests_by_reason"].get("router_lost", 0) >= 1


def test_a_load_generator_told_the_router_died_before_the_run_started_exits_cleanly(tmp_path):
    """SIGUSR1 (kvemu up: the router died) while still waiting for the router: a one-line error, no traceback,
    no report (nothing ran)."""
    proc = subprocess.Popen(cli_command("loadgen", "--router", f"tcp://127.0.0.1:{free_port()}", "-o",
                                        str(tmp_path / "out"), str(scenario(tmp_path))),
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not handles_sigusr1(proc.pid) and time.monotonic() < deadline:  # it is waiting for the router
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err[-2000:]
    assert "the router process exited before the run started" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "summary.json").exists()


def handles_sigusr1(pid: int) -> bool:
    """Whether the process catches SIGUSR1 yet (its bit in /proc/PID/status SigCgt)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(mask & (1 << (signal.SIGUSR1 - 1)))
