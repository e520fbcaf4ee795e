"""Router replicas as processes (``router.replicas`` under kvemu up): every replica a router process, every worker
registered with each, the load generator spreading requests over them, replica sync between them over ZeroMQ."""

import json

import pytest

import zmq

from kvemu.messages import ClientRequest, encode

from harness.chaos import SyncPeers
from harness.procs.protocol import CLIENT, RecordReply, Stats, StatsQuery, reply_decoder, send_control
from harness.procs.up import Children
from tests.end_to_end.test_processes import FAST, _gone, kvemu, small
from tests.process_output import json_events, tagged_env

pytestmark = pytest.mark.process_supervision

REPLICAS = "router: {policy: kv, heartbeat_timeout_s: 1.5, replicas: 2, replica_front: random, " \
           "replica_sync: {enabled: true}}\n"


def _scenario(tmp_path, extra: str = ""):
    path = small(tmp_path)
    text = path.read_text().replace(
        "router: {policy: kv, affinity: {enabled: true, ttl_secs: 30}, heartbeat_timeout_s: 1.5}\n", REPLICAS)
    assert "replicas: 2" in text
    path.write_text(text + extra)
    return path


def test_up_with_two_router_replicas_spreads_requests_and_syncs_their_bookings(tmp_path):
    out = tmp_path / "out"
    tag, env = tagged_env()
    res = kvemu("up", str(_scenario(tmp_path)), *FAST, "-o", str(out), "--http", "127.0.0.1:0", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json_events(res.stdout, "started")[0]["routers"][1]  # the load generator's: both router replicas
    assert "kvemu up: OpenAI API at http://127.0.0.1:" in res.stderr  # kvemu front, before both replicas
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_requests"] > 0 and summary["completed_requests"] == summary["num_requests"]
    rep = summary["kvemu"]["replicas"]
    assert rep["count"] == 2 and rep["front"] == "random" and rep["sync"]["enabled"]
    per = rep["per_replica"]
    assert all(row["requests"] > 0 for row in per)  # both replicas served requests
    assert sum(row["requests"] for row in per) == summary["num_requests"]
    assert all(row["workers_registered"] == 2 for row in per)  # each worker registered with both routers
    assert all(row["kv_events"]["batches"] > 0 for row in per)  # and each router subscribed to its KV events
    for me, peer in ((per[0], per[1]), (per[1], per[0])):
        sync = me["sync"]
        assert sync["batches_applied"] > 0 and sync["applied"] > 0  # sync batches applied by both
        assert sync["applied"] <= peer["sync"]["announced"]  # (only what the peer announced)
        assert sync["dropped_foreign"] == sync["dropped_malformed"] == sync["dropped_oversize"] == 0
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [sum(r["router_replica"] == i for r in rows) for i in (0, 1)] == [row["requests"] for row in per]
    assert _gone(tag)  # every router replica, worker and the load generator exited


def test_restart_router_chaos_restarts_the_replica_it_names(tmp_path):
    """Chaos naming a replica reaches that router process: a restart, and faults on its own KV feed (the next
    batches lost on the way and recovered by replay; a lag), while the other replica's feed is left alone."""
    out = tmp_path / "out"
    path = _scenario(tmp_path, "chaos:\n  - {at_s: 0.5, action: drop_kv_events, replica: 0, count: 2}\n"
                               "  - {at_s: 0.7, action: delay_kv_events, replica: 0, lag_ms: 20}\n"
                               "  - {at_s: 1.0, action: restart_router, replica: 1}\n")
    res = kvemu("up", str(path), *FAST, "-o", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert [(e["action"], e["ok"]) for e in json_events(res.stderr, "chaos")] == [
        ("drop_kv_events", True), ("delay_kv_events", True), ("restart_router", True)]
    summary = json.loads((out / "summary.json").read_text())
    per = summary["kvemu"]["replicas"]["per_replica"]
    assert [row["restarts"] for row in per] == [0, 1]
    assert [row["kv_feed_dropped_batches"] for row in per] == [2, 0]
    assert per[0]["kv_events"]["gaps"] >= 1 and per[0]["kv_events"]["lost_batches"] == 0
    k = summary["kvemu"]
    assert k["unfinished_requests"] == 0 and k["hook_counts"]["router_restarts"] == 1
    assert summary["completed_requests"] + k["failed_requests"] == summary["num_requests"] > 0


def _ask(router: str, msg, kind):
    """Send one client message to a router process and return its answer of type ``kind``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(router)
        sock.send_multipart([CLIENT, encode(msg)])
        assert sock.poll(20_000), f"no answer from {router}"
        reply = reply_decoder.decode(sock.recv_multipart()[1])
        assert type(reply) is kind, reply
        return reply
    finally:
        sock.close(linger=0)


def _stats(router: str) -> Stats:
    return _ask(router, StatsQuery(), Stats)


def test_a_worker_with_two_router_flags_registers_with_both(tmp_path):
    import time

    path = _scenario(tmp_path)
    kids = Children()
    try:
        r0 = kids.start("r0", ["router", "--listen", "tcp://127.0.0.1:0", "--replica", "0", "--config", str(path)])
        r1 = kids.start("r1", ["router", "--listen", "tcp://127.0.0.1:0", "--replica", "1", "--config", str(path),
                               "--sync-peer", f"0={r0['sync']}"])
        w = kids.start("w", ["worker", "--router", r0["listen"], "--router", r1["listen"], "--worker-id", "7",
                             "--config", str(path)])
        assert w["routers"] == [r0["listen"], r1["listen"]]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            views = [_stats(r0["listen"]), _stats(r1["listen"])]
            if all(v.workers == [7] for v in views):
                break
            time.sleep(0.1)
        assert [(v.replica, v.workers) for v in views] == [(0, [7]), (1, [7])]
        # replica 1 subscribed to replica 0 by its --sync-peer flag: a request replica 0 runs reaches its view
        reply = _ask(r0["listen"], ClientRequest(request_id="q", tokens=list(range(64)), max_tokens=2), RecordReply)
        assert reply.record.failure is None and reply.record.worker_id == 7
        deadline = time.monotonic() + 10
        while _stats(r1["listen"]).sync["applied"] < 3 and time.monotonic() < deadline:  # booked, prefilled, freed
            time.sleep(0.05)
        sync = _stats(r1["listen"]).sync
        assert sync["applied"] == _stats(r0["listen"]).sync["announced"] == 3 and sync["batches_applied"] >= 1
        # these routers take no control messages (no token): where peers publish is not taken from anyone
        refused = send_control(r0["listen"], "", SyncPeers(token="", peers={1: r1["sync"]}))
        assert not refused.ok and "takes no control messages" in refused.detail
    finally:
        kids.stop_all()


def test_replica_flags_that_do_not_fit_the_scenario_are_refused(tmp_path):
    path = _scenario(tmp_path)
    res = kvemu("router", "--replica", "2", "--config", str(path), check=False)
    assert res.returncode == 2 and "--replica 2" in res.stderr and "router.replicas is 2" in res.stderr
    res = kvemu("router", "--replica", "1", "--sync-peer", "1=tcp://127.0.0.1:9", "--config", str(path), check=False)
    assert res.returncode == 2 and "--sync-peer 1=tcp://127.0.0.1:9" in res.stderr
    res = kvemu("loadgen", "--router", "tcp://127.0.0.1:9", str(path), check=False)
    assert res.returncode == 2 and "1 --router flags for router.replicas 2" in res.stderr


def test_the_load_generator_spreads_over_replicas_it_did_not_start_and_carries_their_chaos(tmp_path):
    """As in docker-compose: router replicas and workers started by hand, the load generator given every replica
    (--router per replica) applies the timeline itself; restart_router reaches the replica it names."""
    import subprocess

    from harness.chaos import CONTROL_TOKEN_ENV
    from harness.procs.up import cli_command, cli_env

    path = _scenario(tmp_path, "chaos:\n  - {at_s: 1.0, action: restart_router, replica: 1}\n")
    out = tmp_path / "out"
    kids = Children()
    env = {CONTROL_TOKEN_ENV: "tok"}
    try:
        routers = [kids.start(f"r{i}", ["router", "--listen", "tcp://127.0.0.1:0", "--replica", str(i),
                                        "--config", str(path), *FAST], env=env) for i in (0, 1)]
        for i, r in enumerate(routers):
            assert send_control(r["listen"], "tok", SyncPeers(token="tok", peers={1 - i: routers[1 - i]["sync"]})).ok
        for w in (0, 1):
            kids.start(f"w{w}", ["worker", "--router", routers[0]["listen"], "--router", routers[1]["listen"],
                                 "--worker-id", str(w), "--config", str(path), *FAST])
        res = subprocess.run(cli_command("loadgen", "--router", routers[0]["listen"], "--router", routers[1]["listen"],
                                         "--chaos", "apply", "--expect-workers", "2", "-o", str(out), str(path),
                                         *FAST), env={**cli_env(), **env}, capture_output=True, text=True, timeout=120)
    finally:
        kids.stop_all()
    assert res.returncode == 0, res.stderr[-3000:]
    assert [(e["action"], e["ok"]) for e in json_events(res.stderr, "chaos")] == [("restart_router", True)]
    summary = json.loads((out / "summary.json").read_text())
    per = summary["kvemu"]["replicas"]["per_replica"]
    assert [row["restarts"] for row in per] == [0, 1] and all(row["requests"] > 0 for row in per)
    assert summary["kvemu"]["hook_counts"]["router_restarts"] == 1
    assert all(row["sync"]["batches_applied"] > 0 for row in per)
