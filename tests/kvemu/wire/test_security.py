"""Optional CURVE authentication keyed by one shared secret (``KVEMU_SECRET``): peers without it can neither
talk to a kvemu socket nor read from one; binding beyond loopback without it warns. 127.0.0.1 only."""

import json
import subprocess
import time

import pytest
import zmq

from kvemu.wire import security
from kvemu.kv_events import KVEventBatch
from kvemu.wire.publisher import KvEventPublisher
from kvemu.wire.subscriber import KvEventSubscriber, StreamSpec

from harness.procs.protocol import send_control
from harness.scenario import ChaosEvent
from harness.procs.up import Children, cli_command, cli_env

HOST = "tcp://127.0.0.1:0"


@pytest.mark.parametrize(("endpoint", "who"), [
    ("tcp://127.0.0.1:5555", "any local process"), ("tcp://127.3.4.5:0", "any local process"),
    ("tcp://localhost:1", "any local process"), ("tcp://[::1]:5", "any local process"),
    ("ipc:///tmp/kv", "any local process"), ("inproc://x", None),
    ("tcp://0.0.0.0:5555", "anyone who reaches it"), ("tcp://*:5555", "anyone who reaches it"),
    ("tcp://10.1.2.3:5555", "anyone who reaches it"), ("tcp://eth0:1", "anyone who reaches it"),
])
def test_the_line_of_a_listener_without_a_secret_says_who_can_use_it(endpoint, who):
    line = security.exposure_warning(endpoint)
    if who is None:
        assert line is None
    else:
        assert line.startswith(f"kvemu: listening on {endpoint} without a secret: {who} can register, submit and "
                               "read KV events") and "set KVEMU_SECRET" in line


def test_each_listener_without_a_secret_says_so_once_with_its_port_and_none_with_one(monkeypatch, caplog):
    """Port 0 binds: the line names the port really bound; a CURVE server (a secret set) prints nothing."""
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.ROUTER) for _ in range(4)]
    try:
        monkeypatch.delenv(security.SECRET_ENV, raising=False)
        open_ = [security.bind_securely(s, HOST) for s in socks[:2]]
        lines = [r.getMessage() for r in caplog.records if r.name == "kvemu.security"]
        assert lines == [f"kvemu: listening on {e} without a secret: any local process can register, submit and read "
                         "KV events (which carry prompt token ids); set KVEMU_SECRET to the same secret for every "
                         "kvemu process" for e in open_]
        assert all(not e.endswith(":0") for e in open_)
        caplog.clear()
        monkeypatch.setenv(security.SECRET_ENV, "s3cret")
        for s in socks[2:]:
            security.bind_securely(s, HOST)
            assert s.curve_server
        assert not [r for r in caplog.records if r.name == "kvemu.security"]
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.destroy(linger=0)


def test_ensure_secret_makes_one_only_when_none_is_set(monkeypatch):
    monkeypatch.setenv(security.SECRET_ENV, "mine")
    assert not security.ensure_secret() and security.secret() == "mine"
    monkeypatch.delenv(security.SECRET_ENV)
    assert security.ensure_secret()
    made = security.secret()
    assert made and len(made) >= 40 and not security.ensure_secret() and security.secret() == made
    monkeypatch.delenv(security.SECRET_ENV)  # (monkeypatch restores the variable as it was before the test)


def test_kv_events_reach_only_subscribers_with_the_secret(monkeypatch):
    monkeypatch.setenv(security.SECRET_ENV, "s3cret")
    ctx = zmq.Context()
    pub = KvEventPublisher(HOST, replay_endpoint=HOST, bind=True, context=ctx)
    got: dict[str, list] = {"right": [], "wrong": [], "none": []}
    subs = {}
    try:
        for name, secret in (("right", "s3cret"), ("wrong", "guess"), ("none", "")):
            monkeypatch.setenv(security.SECRET_ENV, secret)
            subs[name] = KvEventSubscriber(got[name].append, block_size=4, context=ctx, replay_timeout_s=0.3)
            subs[name].add(StreamSpec(1, 0, pub.endpoint, pub.replay_endpoint))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and subs["right"].expected_seq(1, 0) is None:
            pub.publish(KVEventBatch(ts=0.0, events=[]))
            for sub in subs.values():
                sub.poll(20)
        for _ in range(20):  # the others have had as long, and more
            for sub in subs.values():
                sub.poll(20)
        assert subs["right"].expected_seq(1, 0) is not None
        assert subs["wrong"].expected_seq(1, 0) is None and subs["none"].expected_seq(1, 0) is None
    finally:
        for sub in subs.values():
            sub.close()
        pub.close(drain_timeout_s=0)
        ctx.destroy(linger=0)


@pytest.mark.process_supervision
def test_a_cluster_with_a_secret_runs_and_answers_no_one_without_it(tmp_path, monkeypatch):
    path = tmp_path / "s.yaml"
    path.write_text("""
name: secret
cluster: {workers: 1, engine: {block_size: 16, speedup_ratio: 20, decode_speedup_ratio: 20}}
workload: {kind: synthetic, rate_rps: 10, isl: {kind: constant, mean: 64}, osl: {kind: constant, mean: 4}}
run: {mode: live, duration_s: 1}
""")
    env = {security.SECRET_ENV: "s3cret"}
    kids = Children()
    try:
        router = kids.start("router", ["router", "--listen", HOST, "--config", str(path)], env=env)["listen"]
        kids.start("w0", ["worker", "--router", router, "--worker-id", "0", "--config", str(path)], env=env)
        run = subprocess.run(cli_command("loadgen", "--router", router, "--expect-workers", "1", "-o",
                                         str(tmp_path / "out"), str(path)), env={**cli_env(), **env},
                             capture_output=True, text=True, timeout=120)
        monkeypatch.setenv(security.SECRET_ENV, "")  # an outsider: no answer at all
        outsider = send_control(router, "", ChaosEvent(at_s=0, action="restart_router"), timeout_s=2)
        monkeypatch.setenv(security.SECRET_ENV, "s3cret")  # with the secret: an answer (a refusal: no token)
        insider = send_control(router, "", ChaosEvent(at_s=0, action="restart_router"), timeout_s=10)
    finally:
        kids.stop_all()
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["completed_requests"] == summary["num_requests"] > 0
    assert not outsider.ok and outsider.detail == "no answer from the router within 2 s"
    assert not insider.ok and "takes no control messages" in insider.detail


def test_every_listener_defaults_to_loopback():
    """#43: nothing kvemu opens is reachable beyond this machine unless asked: every listening option of every
    command, and the KV publisher's default endpoint, is on 127.0.0.1 (the publisher's was tcp://*)."""
    import argparse
    import inspect

    from harness.cli.parser import build_parser

    listening = {"listen", "sync_listen", "kv_events", "kv_replay", "http"}
    seen = []
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command, parser in sub.choices.items():
        for action in parser._actions:
            if action.dest in listening and action.default not in (None, ""):
                seen.append((command, action.dest))
                assert action.default.removeprefix("tcp://").startswith("127.0.0.1:"), (command, action.dest,
                                                                                      action.default)
    assert ("router", "listen") in seen and ("worker", "kv_events") in seen and ("serve", "http") in seen
    default = inspect.signature(KvEventPublisher).parameters["endpoint"].default
    assert default.startswith("tcp://127.0.0.1:"), default
