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

import pytest

from tests.end_to_end.test_processes import _gone
from tests.process_output import json_events, tagged, tagged_env

pytestmark = pytest.mark.process_supervision

ROOT = Path(__file__).resolve().parents[2]
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


SLOW_REPLICAS = """name: replicas
cluster: {{workers: 2, dp_size: 1, engine: {{num_gpu_blocks: 4096, block_size: 16, speedup_ratio: 1,
          decode_speedup_ratio: 1}}}}
router: {{policy: kv, heartbeat_timeout_s: 1.5, replicas: {n}, replica_front: session}}
workload: {{kind: synthetic, rate_rps: 15, turns: 2, think_time_s: 0.2, system_prefix_tokens: 64,
           isl: {{kind: constant, mean: 96}}, osl: {{kind: constant, mean: 8}}}}
run: {{mode: live, seed: 4, duration_s: 2}}
"""


def slow_replicas(tmp_path: Path, n: int) -> Path:
    """A cluster of ``n`` router replicas (behind ``kvemu front`` under ``kvemu serve``) on real-time engines: a
    stream of a few hundred tokens lasts seconds, long enough to stop or lose a process under it."""
    path = tmp_path / "replicas.yaml"
    path.write_text(SLOW_REPLICAS.format(n=n))
    return path


def serve(path: Path, env: dict[str, str], stderr, *, own_session: bool = False) -> subprocess.Popen:
    """``kvemu serve`` of ``path`` (its start line on stdout; ``own_session``: in a process group of its own,
    as a terminal's foreground job)."""
    return subprocess.Popen([sys.executable, "-m", "harness.cli", "serve", str(path), "--http", "127.0.0.1:0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                            start_new_session=own_session)


def up(path: Path, out: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """``kvemu up`` of ``path``, its children tagged; returns it once its load generator has started the run
    (its start line: it has seen every worker), and the tag."""
    tag, env = tagged_env()
    lines = path.with_suffix(".stdout")
    with lines.open("w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "up", str(path), "-o", str(out), *args],
                                cwd=ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 90
    while '"role": "loadgen"' not in lines.read_text():
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
    assert s["kvemu"]["worker_events"].get("worker_fenced", 0) >= 1
    assert s["kvemu"]["worker_exits"] == {"1": "signal SIGKILL"}  # fenced at once, on the supervisor's word
    assert "| worker_removed | 1 | process_exited (signal SIGKILL) |" in (out / "report.md").read_text()
    assert "the router fenced it" in err
    assert s["completed_requests"] > 0.8 * s["num_requests"]  # the rest of the cluster served the run


def test_an_aggregated_worker_killed_from_outside_is_a_fault_too(tmp_path):
    code, err, out = _kill_worker_1(tmp_path, AGGREGATED)
    assert code == 0, err[-3000:]
    s = summary_of(out)
    assert not s["partial"] and accounted(s)
    assert s["kvemu"]["worker_exits"] == {"1": "signal SIGKILL"}
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


# ------------------------------------------------------------------ a report directory that becomes unwritable


def _fallback(err: str) -> Path:
    """The directory the 'wrote it to ... instead' line names."""
    line = next(x for x in err.splitlines() if "; wrote it to " in x)
    return Path(line.split("; wrote it to ")[1].removesuffix(" instead"))


def _break_when_made(out: Path) -> None:
    """Once ``out`` exists, replace it by a file (as root, permission bits stop nothing: a file where the
    directory was stops everyone)."""
    deadline = time.monotonic() + 30
    while not out.is_dir():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    for f in out.iterdir():
        f.unlink()
    out.rmdir()
    out.write_text("not a directory any more\n")


def test_kvemu_run_writes_its_report_elsewhere_when_its_directory_becomes_unwritable(tmp_path):
    out = tmp_path / "out"
    path = scenario(tmp_path, duration_s=3.0)
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "run", str(path), "-o", str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _break_when_made(out)
    finally:
        code, err = finish(proc)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert f"kvemu: cannot write the report in {out} (part of the path is a file, not a directory)" in err
    where = _fallback(err)
    try:
        s = summary_of(where)
        assert s["num_requests"] > 0 and s["completed_requests"] == s["num_requests"]
        assert len((where / "requests.jsonl").read_text().splitlines()) == s["num_requests"]
        assert f"report in {where}/report.md" in err and (where / "report.md").is_file()
    finally:
        subprocess.run(["rm", "-rf", str(where)], check=False)


def test_kvemu_up_keeps_the_load_generators_report_when_its_directory_becomes_unwritable(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc, _ = up(scenario(tmp_path, duration_s=3.0), out)
    try:
        _break_when_made(out)
    finally:
        code, err = finish(proc)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    where = _fallback(err)
    try:
        s = summary_of(where)
        assert s["num_requests"] > 0 and s["completed_requests"] == s["num_requests"]
        assert f"kvemu loadgen: {s['num_requests']}/{s['num_requests']} requests completed; report in {where}" in err
        assert "kvemu up: done" in err and f"no report in {out}" in err
    finally:
        subprocess.run(["rm", "-rf", str(where)], check=False)


def test_a_report_that_can_be_written_nowhere_prints_its_summary(tmp_path, monkeypatch, capsys):
    import tempfile

    from harness.report.files import save_report
    from harness.run.runner import run_scenario
    from harness.scenario import parse_scenario

    data = run_scenario(parse_scenario(f"name: nowhere\n{AGGREGATED}{WORKLOAD}run: {{seed: 1, duration_s: 2}}\n")).data
    blocked = tmp_path / "file"
    blocked.write_text("")

    def no_temp(**_: object) -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", no_temp)
    summary, where = save_report(data, blocked / "out")
    err = capsys.readouterr().err
    assert where is None and summary.num_requests == len(data.records) > 0
    assert err.startswith(f"kvemu: cannot write the report in {blocked / 'out'} (part of the path is a file, not a "
                          "directory) nor in a temporary directory (Permission denied); its summary follows\n")
    assert json.loads(err.split("\n", 1)[1]) == summary.to_builtins()


# ------------------------------------------------------------------ one clear line for a refused worker


def _router(kids, path: Path, env: dict[str, str] | None = None) -> str:
    return kids.start("router", ["router", "--listen", "tcp://127.0.0.1:0", "--config", str(path)], env=env)["listen"]


def test_a_worker_refused_for_a_squatted_id_says_so_in_one_line(tmp_path):
    from harness.procs.up import Children

    from harness.procs.up import cli_env

    path = scenario(tmp_path)
    kids = Children()
    secret = {"KVEMU_SECRET": "s3cret"}  # (without one, each listener of the worker would say so first)
    try:
        router = _router(kids, path, env=secret)
        kids.start("w7", ["worker", "--router", router, "--worker-id", "7", "--config", str(path)], env=secret)
        dup = subprocess.run([sys.executable, "-m", "harness.cli", "worker", "--router", router, "--worker-id", "7",
                              "--config", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=30,
                             env={**cli_env(), **secret})
        assert kids.procs["w7"].poll() is None  # the first one is untouched
    finally:
        kids.stop_all()
    assert dup.returncode == 1
    assert dup.stderr.splitlines() == ["kvemu worker: worker 7: registration refused: worker id 7 is already "
                                       "registered"], dup.stderr


def test_a_worker_with_the_wrong_secret_says_so_within_seconds(tmp_path):
    from harness.procs.up import Children, cli_command, cli_env

    path = scenario(tmp_path)
    kids = Children()
    try:
        router = _router(kids, path, env={"KVEMU_SECRET": "the router's"})
        worker = subprocess.Popen(cli_command("worker", "--router", router, "--worker-id", "3", "--config", str(path)),
                                  env={**cli_env(), "KVEMU_SECRET": "another"}, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
        started = time.monotonic()
        try:
            line = worker.stderr.readline()  # its first word on stderr
            waited = time.monotonic() - started
        finally:
            worker.kill()
            worker.communicate(timeout=10)
    finally:
        kids.stop_all()
    assert waited < 10, waited
    assert line.startswith(f"kvemu worker: worker 3: no answer from the router at {router} after 5 s: is it running "
                           "there, and does it have the same KVEMU_SECRET as this worker?"), line


def test_kvemu_serve_carries_on_when_a_worker_process_is_killed(tmp_path):
    tag, env = tagged_env()
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "serve", str(scenario(tmp_path)), "--http",
                             "127.0.0.1:0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        serving = json.loads(proc.stdout.readline())
        assert serving["event"] == "serving", serving
        os.kill(child(tag, "--worker-id 1 "), signal.SIGKILL)
        time.sleep(1.5)
        assert proc.poll() is None  # still serving, with worker 0
    finally:
        proc.send_signal(signal.SIGTERM)
        code, err = finish(proc, timeout=60)
    assert code == 0, err[-3000:]
    assert "kvemu serve: worker-1 exited (signal SIGKILL); the cluster carries on without it" in err


# ------------------------------------------------------------------ stopping kvemu serve with streams open


def _until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@contextlib.contextmanager
def served(tmp_path: Path, replicas: int, *, own_session: bool = False):
    """``kvemu serve`` of ``slow_replicas`` with its stderr in a file: yields it, the file, its children's tag and
    the front door's URL once every replica has workers; killed at the end if it still runs."""
    import urllib.request

    tag, env = tagged_env()
    err_path = tmp_path / "serve.err"
    with err_path.open("w") as err:
        proc = serve(slow_replicas(tmp_path, replicas), env, err, own_session=own_session)
    try:
        base = json.loads(proc.stdout.readline())["http"]  # type: ignore[union-attr]

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
                    return resp.status == 200
            except OSError:
                return False

        _until(healthy, 30, "the stack never became healthy")
        yield proc, err_path, tag, base
    finally:
        if proc.poll() is None:
            proc.kill()


def test_kvemu_serve_stops_front_first_so_every_open_stream_ends_with_its_done_or_a_reason(tmp_path):
    """Issue #43: the supervisor SIGKILLed every child 5 s after SIGTERM while the front door drained for 10 s,
    cutting long streams silently. Now the front drains first (the routers and workers still serve it), a
    stream that outlasts the drain ends with an error event naming ``front_door_shutdown``, and only then do
    the routers and workers stop."""
    from harness.procs.up import DRAIN_S
    from tests.sse_client import open_streams

    with served(tmp_path, 2) as (proc, err_path, tag, base):
        (short, long), threads = open_streams(base, ["a", "b"], [150, 20_000])
        assert short.first_token.wait(30) and long.first_token.wait(30)
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(DRAIN_S + 30)
        code, _ = finish(proc, timeout=60)
        took = time.monotonic() - stopped_at
    text = err_path.read_text()
    assert code == 0, text[-3000:]
    assert short.completed and short.usage["completion_tokens"] == 150, short
    assert long.ended_with_reason and "front_door_shutdown" in (long.error or ""), long
    assert DRAIN_S - 1 < long.e2e_s and took < DRAIN_S + 15, (long, took)
    assert "Traceback" not in text
    assert _gone(tag)


def test_a_second_ctrl_c_while_kvemu_serve_stops_kills_its_children_now_without_a_traceback(tmp_path):
    """Issue #43: a second Ctrl-C during the stop raised KeyboardInterrupt in the supervisor's wait (a traceback,
    the stop abandoned). Sent as a terminal sends it (SIGINT to the foreground process group), the first now
    says how to kill at once, the second says it kills, and every child is gone."""
    from tests.sse_client import open_streams

    with served(tmp_path, 2, own_session=True) as (proc, err_path, tag, base):
        (stream,), _ = open_streams(base, ["a"], [20_000])
        assert stream.first_token.wait(30)
        os.killpg(proc.pid, signal.SIGINT)
        _until(lambda: "press Ctrl-C again to kill them now" in err_path.read_text(), 10, "no word of the stop")
        time.sleep(0.5)  # into the front door's drain
        assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGINT)
        killed_at = time.monotonic()
        code, _ = finish(proc, timeout=30)
        took = time.monotonic() - killed_at
    text = err_path.read_text()
    assert code == 0 and took < 5, (code, took, text[-3000:])
    assert text.count("kvemu serve: SIGINT again: killing now") == 1, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert _gone(tag)


def test_a_router_replica_that_keeps_exiting_is_started_again_after_growing_delays():
    """At once the first time; then 1, 2, 4 ... 30 s while it exits within a minute of each start; a replica that
    ran a minute is restarted at once again."""
    from harness.procs.up import RESTART_DELAYS_S, _Restarts

    r = _Restarts()
    now, delays = 100.0, []
    for _ in range(9):
        delays.append(r.exited(1, now))
        assert r.take(now + delays[-1] - 0.01) == []
        now += delays[-1]
        assert r.take(now) == [1] and r.due == {}
        now += 1.0  # it dies a second after it started
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0] and RESTART_DELAYS_S[-1] == 30.0
    assert r.exited(1, now + 61.0) == 0.0  # it ran a minute: a fresh start
    assert r.exited(2, now) == 0.0  # each replica counts its own
