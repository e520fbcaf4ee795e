"""#43: the supervisors' per-run secret and the line a listener without one prints, with real processes on
127.0.0.1 (each test bounded in time)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
import zmq

from kvemu.messages import Register, RegisterAck, encode
from kvemu.wire import security

from harness.procs.protocol import send_control
from harness.procs.up import cli_command, cli_env
from harness.scenario import ChaosEvent

HOST = "tcp://127.0.0.1:0"
LINE = "without a secret: any local process can register, submit and read KV events"


def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text("""
name: secret
cluster: {workers: 1, engine: {block_size: 16, speedup_ratio: 50, decode_speedup_ratio: 50}}
workload: {kind: synthetic, rate_rps: 5, isl: {kind: constant, mean: 64}, osl: {kind: constant, mean: 4}}
run: {mode: live, duration_s: 1}
""")
    return path


class Proc:
    """A ``kvemu`` child whose standard output lines are collected and whose standard error goes to a file."""

    def __init__(self, args: list[str], stderr: Path, env: dict[str, str]) -> None:
        self.stderr_path = stderr
        self._err = stderr.open("w")
        self.proc = subprocess.Popen(cli_command(*args), env=env, stdout=subprocess.PIPE, stderr=self._err, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()  # type: ignore[arg-type]

    def line(self, event: str, timeout_s: float = 60.0) -> dict:
        """The first standard-output JSON line whose ``event`` is ``event``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for text in list(self.lines):
                if text.startswith("{") and json.loads(text).get("event") == event:
                    return json.loads(text)
            assert self.proc.poll() is None, self.stderr_path.read_text()[-3000:]
            time.sleep(0.05)
        raise AssertionError(f"no {event} line in {timeout_s} s: {self.stderr_path.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> str:
        """Stop it (bounded) and return its standard error."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()
        return self.stderr_path.read_text()


def no_secret_env() -> dict[str, str]:
    env = cli_env()
    env.pop(security.SECRET_ENV, None)
    return env


def register_answer(router: str, shared: str | None, wait_s: float) -> RegisterAck | None:
    """What the router answers a fake worker's registration (None: nothing within ``wait_s``)."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        security.connect_securely(sock, shared)
        sock.connect(router)
        sock.send(encode(Register(worker_id=4242, block_size=16)))
        if not sock.poll(round(wait_s * 1000)):
            return None
        return msgspec.msgpack.decode(sock.recv(), type=RegisterAck)
    finally:
        ctx.destroy(linger=0)


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return found


def kv_events_seen(endpoint: str, shared: str | None, http: str, wait_s: float) -> int:
    """How many KV-event messages a subscriber (with ``shared`` as its secret, or none) gets from ``endpoint``
    while prompts are sent through the front door at ``http``."""
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        security.connect_securely(sub, shared)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        seen = 0
        deadline = time.monotonic() + wait_s
        i = 0
        while time.monotonic() < deadline and not seen:
            body = json.dumps({"model": "kvemu", "prompt": f"tell me about {i} " * 40, "max_tokens": 2}).encode()
            req = urllib.request.Request(f"{http}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - our own 127.0.0.1 front door
                assert resp.status == 200
            i += 1
            while sub.poll(200):
                sub.recv_multipart()
                seen += 1
        return seen
    finally:
        ctx.destroy(linger=0)


@pytest.mark.process_supervision
def test_kvemu_serve_makes_a_secret_for_its_children_only_and_an_outsider_cannot_register_submit_or_read(
        tmp_path, monkeypatch):
    """Without ``KVEMU_SECRET``, ``kvemu serve``'s router took any local process's registration (2,000 fakes then
    failed every real request); now its children share a secret made for the run, passed in their environment
    (never on a command line: any local user reads those in /proc), and a process without it gets no answer."""
    monkeypatch.delenv(security.SECRET_ENV, raising=False)
    serve = Proc(["serve", str(scenario(tmp_path)), "--http", "127.0.0.1:0"], tmp_path / "serve.err", no_secret_env())
    try:
        info = serve.line("serving")
        router, http = info["router"], info["http"]
        kids = children(serve.proc.pid)
        environs = [dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
                    for pid in kids]
        made = {e.get(security.SECRET_ENV) for e in environs}
        assert len(kids) >= 2 and len(made) == 1 and None not in made, (kids, made)
        shared = made.pop()
        assert len(shared) >= 40
        for pid in [serve.proc.pid, *kids]:
            assert shared not in Path(f"/proc/{pid}/cmdline").read_text()

        assert register_answer(router, None, wait_s=3.0) is None  # an outsider: no handshake, no answer
        outsider = send_control(router, "", ChaosEvent(at_s=0, action="restart_router"), timeout_s=2)
        assert not outsider.ok and outsider.detail == "no answer from the router within 2 s"
        kv = info["worker_info"][0]["kv_events"][0]
        assert kv_events_seen(kv, None, http, wait_s=3.0) == 0
        # with the secret, the same calls are answered: what stopped the outsider is the secret alone
        assert kv_events_seen(kv, shared, http, wait_s=10.0) > 0
        insider = register_answer(router, shared, wait_s=10.0)
        assert insider is not None and insider.worker_id == 4242
    finally:
        err = serve.stop(signal.SIGINT)
    assert "kvemu serve: its ZeroMQ sockets take a secret made for this run" in err
    assert LINE not in err, err[-3000:]


@pytest.mark.process_supervision
def test_kvemu_up_runs_its_workload_with_its_own_secret(tmp_path, monkeypatch):
    """The load generator and the workers get the run's secret too: the workload completes, and no listener of the
    run is open without it."""
    monkeypatch.delenv(security.SECRET_ENV, raising=False)
    out = tmp_path / "out"
    run = subprocess.run(cli_command("up", str(scenario(tmp_path)), "-o", str(out)), env=no_secret_env(),
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed_requests"] == summary["num_requests"] > 0
    assert "kvemu up: its ZeroMQ sockets take a secret made for this run" in run.stderr
    assert LINE not in run.stderr, run.stderr[-3000:]


@pytest.mark.process_supervision
def test_every_listener_without_a_secret_says_so_once_and_none_with_one(tmp_path):
    """A router and a worker started by hand: one line per ZeroMQ listener (the router's socket, the worker's KV
    publisher and replay socket), naming the port bound; nothing when ``KVEMU_SECRET`` is set."""
    path = scenario(tmp_path)
    for shared in (None, "s3cret"):
        env = no_secret_env() if shared is None else {**cli_env(), security.SECRET_ENV: shared}
        tag = "open" if shared is None else "secret"
        router = Proc(["router", "--listen", HOST, "--config", str(path)], tmp_path / f"router-{tag}.err", env)
        worker = None
        try:
            listen = router.line("started")["listen"]
            worker = Proc(["worker", "--router", listen, "--worker-id", "0", "--config", str(path)],
                          tmp_path / f"worker-{tag}.err", env)
            started = worker.line("started")
        finally:
            errs = [p.stop() for p in (worker, router) if p is not None]
        lines = [line for err in errs for line in err.splitlines() if "without a secret" in line]
        if shared is None:
            endpoints = [*started["kv_events"], *started["kv_replay"], listen]
            assert sorted(lines) == sorted(f"kvemu: listening on {e} {LINE} (which carry prompt token ids); set "
                                           "KVEMU_SECRET to the same secret for every kvemu process" for e in endpoints)
        else:
            assert lines == []


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (Linux: its socket inodes in /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for row in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        cols = row.split()
        if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
            ports.add(int(cols[1].split(":")[1], 16))
    return ports


@pytest.mark.process_supervision
def test_kvemu_serve_in_process_answers_no_outsider_on_any_of_its_zeromq_ports(tmp_path, monkeypatch):
    """``kvemu serve --in-process`` keeps its router and KV sockets to itself: a registration sent to each port it
    listens on but its front door gets no answer (before, its router accepted it)."""
    monkeypatch.delenv(security.SECRET_ENV, raising=False)
    serve = Proc(["serve", str(scenario(tmp_path)), "--http", "127.0.0.1:0", "--in-process"], tmp_path / "serve.err",
                 no_secret_env())
    try:
        http = serve.line("serving")["http"]
        ports = listening_ports(serve.proc.pid) - {int(http.rsplit(":", 1)[1])}
        assert len(ports) >= 3, ports  # the router's socket, a KV publisher and its replay socket
        answers = {p: register_answer(f"tcp://127.0.0.1:{p}", None, wait_s=1.0) for p in sorted(ports)}
    finally:
        err = serve.stop(signal.SIGINT)
    assert all(a is None for a in answers.values()), answers
    assert "kvemu serve: its ZeroMQ sockets take a secret made for this run" in err
    assert LINE not in err, err[-3000:]


def test_a_live_run_in_one_process_keeps_its_sockets_to_itself(tmp_path, monkeypatch):
    """``kvemu run --mode live``: its router and KV sockets are its own; it opened one per rank and more without a
    secret (17 lines for the quickstart), now none."""
    monkeypatch.delenv(security.SECRET_ENV, raising=False)
    run = subprocess.run(cli_command("run", str(scenario(tmp_path)), "--quiet", "-o", str(tmp_path / "out")),
                         env=no_secret_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert LINE not in run.stderr, run.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["kvemu"]["mode"] == "live" and summary["completed_requests"] == summary["num_requests"] > 0


def test_a_run_whose_workers_serve_other_routers_makes_no_secret_and_says_why(monkeypatch, capsys):
    """``--worker-http`` puts the workers behind other routers (vllm-router, Dynamo's selection service), which read
    their KV events with plain ZeroMQ: a run secret would lock them out (as it would behind ``kvemu fleet``). Only
    the handoff between its workers takes a secret made for the run (in the environment its children inherit),
    and the line says what is and is not protected, without the secret."""
    from harness.procs.up import run_secret

    monkeypatch.setenv(security.SECRET_ENV, "")  # (none; and the secret run_secret makes is gone after the test)
    monkeypatch.setenv(security.HANDOFF_SECRET_ENV, "")
    run_secret("kvemu serve", ["127.0.0.1:0"])
    assert security.secret() is None
    handoff = security.secret(security.HANDOFF_SECRET_ENV)
    assert handoff is not None and len(handoff) >= 40
    err = capsys.readouterr().err
    assert "this run's ZeroMQ sockets take no secret: any local process can register, submit and read KV events" in err
    assert "only the KV handoff between prefill and decode workers takes a secret made for this run" in err
    assert handoff not in err
    run_secret("kvemu serve")
    assert security.secret() is not None
    assert "a secret made for this run" in capsys.readouterr().err
    made = security.secret()
    run_secret("kvemu up", ["127.0.0.1:0"])  # a secret already set (the user's, or this run's) is kept, silently
    assert security.secret() == made and capsys.readouterr().err == ""
