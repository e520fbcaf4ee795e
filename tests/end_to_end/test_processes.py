"""kvemu as processes: kvemu up end to end, kill -9 chaos, SIGTERM drain, no orphans, bad input."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu import ManualClock, RoutingCore
from kvemu.runtime.loop import run_virtual
from kvemu.messages import ClientRequest, decode_worker_message
from kvemu.runtime.router import Router
from kvemu.runtime.transport import MemoryNetwork, decode_or_log

from harness.procs.loadgen import _RouterClient
from harness.procs.protocol import CLIENT
from kvemu.messages import encode
from harness.procs.up import Children
from tests.process_output import json_events, tagged, tagged_env

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--set", "cluster.engine.speedup_ratio=20", "--set", "cluster.engine.decode_speedup_ratio=20",
        "--set", "cluster.engine.block_size=16", "--set", "cluster.engine.num_gpu_blocks=2048"]


def kvemu(*args, timeout=120, check=True, env=None):
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=check, env=env)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/status").read_text().count("State:\tZ")


def small(tmp_path, extra=()):
    scenario = tmp_path / "s.yaml"
    scenario.write_text("""
name: procs
cluster: {workers: 2, dp_size: 2}
router: {policy: kv, affinity: {enabled: true, ttl_secs: 30}, heartbeat_timeout_s: 1.5}
workload: {kind: synthetic, rate_rps: 15, turns: 2, think_time_s: 0.2, system_prefix_tokens: 64,
           isl: {kind: constant, mean: 96}, osl: {kind: constant, mean: 8}}
run: {mode: live, seed: 4, duration_s: 2}
""" + "".join(extra))
    return scenario


def router_and_worker(kids: Children, scenario: Path, worker_id: int, *worker_args: str,
                      router_args: tuple[str, ...] = ()) -> dict:
    """Start a router listening on a free port and worker ``worker_id`` (child ``w0``) registering with it, both
    reading ``scenario``; the router's announcement."""
    router = kids.start("router", ["router", "--listen", "tcp://127.0.0.1:0", "--config", str(scenario), *router_args])
    kids.start("w0", ["worker", "--router", router["listen"], "--worker-id", str(worker_id), "--config", str(scenario),
                      *worker_args])
    return router


def test_up_runs_the_stack_and_leaves_no_process_behind(tmp_path):
    out = tmp_path / "out"
    tag, env = tagged_env()
    res = kvemu("up", str(small(tmp_path)), *FAST, "-o", str(out), env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_requests"] > 0 and summary["completed_requests"] == summary["num_requests"]
    ranks = {(r["worker_id"], r["dp_rank"]) for r in summary["kvemu"]["per_rank"] if r["requests"]}
    assert {w for w, _ in ranks} == {0, 1}
    assert _gone(tag)  # router, workers and loadgen are all gone
    # it ends with its answer, titled after the command that ran (not "kvemu run"), the report's path last
    screen = res.stdout[res.stdout.index("kvemu up: procs (live time, seed 4)"):].splitlines()
    assert screen[1].split()[:2] == ["requests", f"{summary['num_requests']}/{summary['num_requests']}"]
    assert screen[-1].split() == ["report", str(out / "report.md")]
    assert (out / "report.md").read_text().startswith("# kvemu up: procs\n")


def _gone(tag: str, within_s: float = 5.0) -> bool:
    """Whether every process of this test (those carrying ``tag``) has exited, waiting up to ``within_s``: only
    this test's processes count, not those of other runs on the machine."""
    deadline = time.monotonic() + within_s
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not tagged(tag)


@pytest.mark.process_supervision
def test_kill_9_of_a_worker_loses_nothing_silently(tmp_path):
    out = tmp_path / "out"
    scenario = small(tmp_path, ["chaos:\n  - {at_s: 1.0, action: remove_worker, worker: 1, graceful: false}\n"])
    res = kvemu("up", str(scenario), *FAST, "--set", "run.duration_s=3", "-o", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert len(records) == summary["num_requests"] > 0
    for r in records:
        assert (r["completion_ns"] is not None and r["failure"] is None) or r["failure"], r
        assert r["failure"] in (None, "worker_lost"), r["failure"]
    assert summary["kvemu"]["worker_events"]  # the router noticed the silence
    late = [r for r in records if r["arrival_ns"] > 2.6e9 and r["failure"] is None]
    assert late and all(r["worker_id"] == 0 for r in late)  # sessions re-bound to the live worker


@pytest.mark.process_supervision
def test_sigterm_drains_a_worker_gracefully(tmp_path):
    scenario = small(tmp_path)
    kids = Children()
    try:
        router = kids.start("router", ["router", "--listen", "tcp://127.0.0.1:0", "--config", str(scenario), *FAST])
        worker = kids.start("w0", ["worker", "--router", router["listen"], "--worker-id", "0", "--config", str(scenario),
                                   *FAST])
        assert worker["role"] == "worker" and len(worker["kv_events"]) == 2 and worker["kv_replay"][0]
        kids.start("w1", ["worker", "--router", router["listen"], "--worker-id", "1", "--config", str(scenario), *FAST])
        out = tmp_path / "out"
        loadgen = subprocess.Popen([sys.executable, "-m", "harness.cli", "loadgen", "--router", router["listen"],
                                    "--expect-workers", "2", "-o", str(out), str(scenario), *FAST], cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started = threading.Event()

        def read_stdout() -> None:  # drained to the end: a full pipe would stall the load generator
            for line in loadgen.stdout:  # type: ignore[union-attr]
                if '"event": "started"' in line:
                    started.set()

        threading.Thread(target=read_stdout, daemon=True).start()
        # once the run has begun (a drain before it would leave the load generator waiting for 2 workers)
        assert started.wait(60), "the load generator did not start"
        time.sleep(1.0)
        kids.signal("w0", signal.SIGTERM)
        assert kids.procs["w0"].wait(15) == 0  # drained and deregistered
        assert loadgen.wait(60) == 0, loadgen.stderr.read()[-2000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["completed_requests"] == summary["num_requests"]  # nothing was dropped
    finally:
        kids.stop_all()
    for proc in kids.procs.values():
        assert proc.poll() is not None


def test_duplicate_worker_id_is_refused_and_changes_nothing(tmp_path):
    scenario = small(tmp_path)
    kids = Children()
    try:
        router = router_and_worker(kids, scenario, 7)
        dup = subprocess.run([sys.executable, "-m", "harness.cli", "worker", "--router", router["listen"],
                              "--worker-id", "7", "--config", str(scenario)], cwd=ROOT, capture_output=True,
                             text=True, timeout=30)
        assert dup.returncode != 0 and "worker id 7 is already registered" in dup.stderr
        assert kids.procs["w0"].poll() is None  # the first one is untouched
    finally:
        kids.stop_all()


def test_invalid_scenario_for_a_process_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster:\n  workers: -1\n")
    res = kvemu("router", "--config", str(bad), check=False)
    assert res.returncode == 2 and "cluster.workers (line 2)" in res.stderr


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=200),
                 st.builds(lambda o: msgspec.msgpack.encode(o),
                           st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=8),
                                        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                                        max_leaves=12)),
                 st.builds(lambda t, v: msgspec.msgpack.encode({"type": t, "worker_id": v, "request_id": v,
                                                                 "times_ns": v, "accepted": v}),
                           st.sampled_from(["Register", "Heartbeat", "DispatchAck", "TokenBatch", "Finished",
                                            "RequestFailed", "KvBatch", "Deregister", "Draining"]),
                           st.one_of(st.integers(-2**63, 2**64 - 1), st.text(max_size=4), st.none(),
                                     st.lists(st.integers(-2**63, 2**64 - 1), max_size=3)))))
def test_router_never_crashes_on_malformed_worker_messages(data):
    clock = ManualClock()
    net = MemoryNetwork()
    router = Router(guarded=False, core=RoutingCore(block_size=4, clock=clock), end=net.router_end(), clock=clock)
    msg = decode_or_log(decode_worker_message, data, "fuzz")  # what every transport does first
    if msg is not None:
        router.on_message(b"1", msg)  # must not raise
        router.on_message(b"not-a-worker", msg)
    assert router.workers == {} or all(isinstance(w, int) for w in router.workers)


def test_malformed_client_requests_fail_with_reasons_and_change_nothing():
    clock = ManualClock()
    net = MemoryNetwork()
    router = Router(guarded=False, core=RoutingCore(block_size=4, clock=clock), end=net.router_end(), clock=clock)

    async def main():
        cases = {
            "empty": ClientRequest(request_id="a", tokens=[], max_tokens=1),
            "neg": ClientRequest(request_id="b", tokens=[1, 2, 3, 4], max_tokens=-3),
            "pin": ClientRequest(request_id="c", tokens=[1, 2, 3, 4], worker_id=99),
            "long": ClientRequest(request_id="d", tokens=[1, 2, 3, 4], session_id="x" * 300),
            "token": ClientRequest(request_id="e", tokens=[1, -2, 3, 4]),
        }
        async with anyio.create_task_group() as tg:
            await tg.start(router.serve)
            out = {k: (await router.handle(v)).failure for k, v in cases.items()}
            tg.cancel_scope.cancel()
        return out

    failures = run_virtual(main, clock)
    assert failures["empty"].startswith("invalid_request: tokens: the prompt is empty")
    assert failures["neg"].startswith("invalid_request: max_tokens must be >= 1")
    assert failures["pin"].startswith("no_endpoints")
    assert failures["long"].startswith("invalid_request: session_id is longer than 256 bytes")
    assert failures["token"].startswith("invalid_request: tokens: every token id")
    assert len(router.core.load) == 0 and router.core.index.current_size == 0


async def registered(client: _RouterClient) -> None:
    """Wait (30 s at most) until the client's router has a worker registered."""
    with anyio.fail_after(30):
        while not (await client.stats(timeout_s=2)).workers:
            await anyio.sleep(0.1)


def test_clients_reusing_a_request_id_each_get_their_own_reply(tmp_path):
    """Replies are keyed by (client, request id): a second client's same id cannot steal the first's reply,
    and a client repeating its own id while it runs gets a refusal while the original completes."""
    scenario = small(tmp_path)
    kids = Children()
    try:
        router = router_and_worker(kids, scenario, 3, "--set", "cluster.engine.speedup_ratio=1", "--own-engine")

        async def main():
            a, b = _RouterClient(router["listen"]), _RouterClient(router["listen"])
            a.replies = []
            got = {}
            async with anyio.create_task_group() as tg:
                tg.start_soon(a.listen)
                tg.start_soon(b.listen)
                await registered(a)

                async def ask(name, client, n_tokens):  # about 300 decode passes: the first is still running
                    got[name] = await client.submit(ClientRequest(request_id="same", tokens=list(range(1, n_tokens + 1)),
                                                                  max_tokens=300))

                with anyio.fail_after(60):
                    async with anyio.create_task_group() as reqs:
                        reqs.start_soon(ask, "a", a, 40)
                        await anyio.sleep(0.05)
                        reqs.start_soon(ask, "b", b, 72)
                        await anyio.sleep(0.05)
                        await a.sock.send_multipart([CLIENT, encode(ClientRequest(request_id="same", tokens=[1] * 24,
                                                                                  max_tokens=4))])
                tg.cancel_scope.cancel()
            return got, a.replies

        got, replies = anyio.run(main)
    finally:
        kids.stop_all()
    assert got["b"].request_id == "same"
    assert (got["b"].failure, got["b"].isl) == (None, 72) and got["b"].completion_ns is not None
    assert [(r.request_id, r.isl, r.failure) for r in replies] == [("same", 24, "duplicate_request_id"),
                                                                    ("same", 40, None)]


@pytest.mark.process_supervision
def test_a_router_sigterm_fails_what_outlives_the_grace_with_router_shutdown(tmp_path):
    scenario = small(tmp_path)
    kids = Children()
    try:
        # a worker 20x slower than the model: minutes
        router = router_and_worker(kids, scenario, 1, "--set", "cluster.engine.speedup_ratio=0.05", "--own-engine",
                                   router_args=("--grace", "0.5"))

        async def main():
            client = _RouterClient(router["listen"])
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.listen)
                await registered(client)
                box = []

                async def ask():
                    box.append(await client.submit(ClientRequest(request_id="long", tokens=list(range(1, 65)),
                                                                 max_tokens=2000)))

                tg.start_soon(ask)
                await anyio.sleep(1.0)
                kids.signal("router", signal.SIGTERM)
                with anyio.fail_after(15):
                    while not box:
                        await anyio.sleep(0.05)
                tg.cancel_scope.cancel()
            return box[0]

        record = anyio.run(main)
        assert kids.procs["router"].wait(15) == 0
    finally:
        kids.stop_all()
    assert record.failure == "router_shutdown" and record.completion_ns is None


@pytest.mark.process_supervision
def test_a_killed_router_fails_the_open_requests_with_router_lost_and_the_report_is_written(tmp_path):
    out = tmp_path / "out"
    scenario = small(tmp_path, ["run: {mode: live, seed: 4, duration_s: 20}\n"])
    kids = Children()
    try:
        loadgen = _one_worker_stack(kids, scenario, out)
        time.sleep(2.0)
        kids.signal("router", signal.SIGKILL)
        started = time.monotonic()
        code = loadgen.wait(60)
        waited = time.monotonic() - started
        err = loadgen.stderr.read()
    finally:
        kids.stop_all()
    assert code == 130, err[-2000:]
    assert waited < 20  # a few heartbeat intervals, not the drain deadline
    summary = json.loads((out / "summary.json").read_text())
    k = summary["kvemu"]
    assert summary["partial"] is True and k["stop_reason"] == "router_lost"
    assert k["failed_requests_by_reason"].get("router_lost", 0) > 0
    assert summary["completed_requests"] > 0  # what finished before the kill is kept
    assert summary["completed_requests"] + k["failed_requests"] + k["unfinished_requests"] == summary["num_requests"]


@pytest.mark.process_supervision
def test_kvemu_up_counts_a_router_killed_by_a_signal_as_a_crash():
    kids = Children()
    kids.procs["router"] = subprocess.Popen(["sleep", "30"])
    kids.procs["gone-worker-1"] = subprocess.Popen(["sleep", "30"])
    try:
        assert kids.crashed() is None
        kids.procs["gone-worker-1"].kill()
        kids.procs["gone-worker-1"].wait(5)
        assert kids.crashed() is None  # a worker the chaos timeline removed
        kids.procs["router"].kill()
        kids.procs["router"].wait(5)
        assert kids.crashed() == "router exited (signal SIGKILL)"
    finally:
        kids.stop_all()


@pytest.mark.process_supervision
def test_a_stopped_load_generator_reports_what_ran_and_what_was_still_open(tmp_path):
    out = tmp_path / "out"
    scenario = small(tmp_path, ["run: {mode: live, seed: 4, duration_s: 30}\n"])
    kids = Children()
    try:
        loadgen = _one_worker_stack(kids, scenario, out, "--set", "cluster.engine.speedup_ratio=0.5", "--own-engine")
        time.sleep(3.0)
        loadgen.send_signal(signal.SIGTERM)
        code = loadgen.wait(30)
        err = loadgen.stderr.read()
    finally:
        kids.stop_all()
    assert code == 130, err[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    k = summary["kvemu"]
    assert summary["partial"] is True and k["stop_reason"] == "SIGTERM"
    assert summary["completed_requests"] > 0 and k["unfinished_requests"] > 0  # the open ones are reported too
    assert summary["completed_requests"] + k["failed_requests"] + k["unfinished_requests"] == summary["num_requests"]
    assert len((out / "requests.jsonl").read_text().splitlines()) == summary["num_requests"]


@pytest.mark.process_supervision
def test_ctrl_c_of_kvemu_up_still_leaves_the_load_generators_partial_report(tmp_path):
    out = tmp_path / "out"
    scenario = small(tmp_path, ["run: {mode: live, seed: 4, duration_s: 30}\n"])
    tag, env = tagged_env()
    up = subprocess.Popen([sys.executable, "-m", "harness.cli", "up", str(scenario), *FAST, "-o", str(out)], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(" loadgen " in p for p in tagged(tag).values()):
        time.sleep(0.2)
    time.sleep(2.0)  # traffic is flowing
    up.send_signal(signal.SIGINT)
    assert up.wait(60) == 130
    err = up.stderr.read()
    assert f"interrupted (SIGINT); partial report in {out}" in err, err[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["partial"] is True and summary["kvemu"]["stop_reason"] == "SIGINT"  # the user's signal, passed on
    assert summary["completed_requests"] > 0
    assert _gone(tag)


def _one_worker_stack(kids: Children, scenario: Path, out: Path, *worker_args: str) -> subprocess.Popen:
    """A router and worker 0 as children, and a load generator playing ``scenario`` against them."""
    router = router_and_worker(kids, scenario, 0, *worker_args)
    return subprocess.Popen([sys.executable, "-m", "harness.cli", "loadgen", "--router", router["listen"],
                             "--expect-workers", "1", "-o", str(out), str(scenario)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.process_supervision
def test_up_applies_every_chaos_action_to_the_processes(tmp_path):
    """One run of kvemu up with each chaos action once: each is applied (the router's control channel, or the
    supervisor), every request ends completed or failed with a reason, the report shows the faults, no
    process is left behind."""
    out = tmp_path / "out"
    scenario = small(tmp_path, ["""chaos:
  - {at_s: 0.4, action: drop_kv_events, worker: 0, dp_rank: 1, count: 2}
  - {at_s: 0.6, action: delay_kv_events, lag_ms: 5}
  - {at_s: 0.8, action: slow_worker, worker: 1, factor: 1.5}
  - {at_s: 1.0, action: kill_rank, worker: 1, dp_rank: 0}
  - {at_s: 1.2, action: add_worker}
  - {at_s: 1.6, action: restart_router}
  - {at_s: 2.2, action: remove_worker, worker: 0, graceful: false}
"""]).read_text().replace("duration_s: 2", "duration_s: 3.5")
    (tmp_path / "chaos.yaml").write_text(scenario)
    tag, env = tagged_env()
    res = kvemu("up", str(tmp_path / "chaos.yaml"), *FAST, "-o", str(out), check=False, timeout=180, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    applied = json_events(res.stderr, "chaos")
    assert [(a["action"], a["ok"]) for a in applied] == [
        ("drop_kv_events", True), ("delay_kv_events", True), ("slow_worker", True), ("kill_rank", True),
        ("restart_router", True)], applied
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_requests"] > 0
    assert summary["completed_requests"] + summary["kvemu"]["failed_requests"] == summary["num_requests"]
    assert summary["kvemu"]["unfinished_requests"] == 0
    assert summary["kvemu"]["hook_counts"]["router_restarts"] == 1
    events = summary["kvemu"]["worker_events"]
    assert events.get("worker_fenced", 0) >= 1 and events.get("worker_added", 0) >= 4  # 3 workers, again after
    lines = json_events(res.stderr, "chaos_applied")
    done = sorted({(a["worker_id"], a["action"], a["error"]) for a in lines})  # what the worker processes applied
    assert done == [(0, "delay_kv_events", None), (0, "drop_kv_events", None), (1, "delay_kv_events", None),
                    (1, "kill_rank", None), (1, "slow_worker", None), (2, "delay_kv_events", None)], done
    assert _gone(tag)


@pytest.mark.process_supervision
def test_the_front_door_metrics_of_a_run_agree_with_its_report(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    out = tmp_path / "out"
    res = kvemu("up", str(small(tmp_path)), *FAST, "-o", str(out), "--http", "127.0.0.1:0")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "OpenAI API at http://127.0.0.1:" in res.stderr
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    fams = {f.name: f for f in text_string_to_metric_families((out / "metrics.prom").read_text())}

    def total(name, **labels):
        return sum(s.value for s in fams[name].samples
                   if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()))

    assert total("kvemu_router_requests", outcome="completed") == summary["completed_requests"] > 0
    assert total("kvemu_router_requests") - total("kvemu_router_requests", outcome="completed") == \
        summary["kvemu"]["failed_requests"]
    assert total("kvemu_router_cached_tokens", source="engine") == sum(
        r["engine_cached_tokens"] or 0 for r in records if r["failure"] is None)
    kv = summary["kvemu"]["kv_events"]["totals"]
    # no replay after the report either: an idle worker stays registered (its heartbeats are never more than an
    # interval apart), so the router never re-reads its whole cache
    for counter in ("gaps", "lost_batches", "replays", "replayed_batches"):
        assert total("kvemu_kv_events", counter=counter) == kv[counter], counter
    # the report's snapshot is taken when the last request ends, with the KV batches already on the router's
    # sockets taken in (StatsQuery.settle); one still in flight may land before the metrics are read
    for counter in ("blocks_stored", "batches"):
        assert kv[counter] <= total("kvemu_kv_events", counter=counter) <= kv[counter] * 1.1 + 16, counter


def test_the_router_process_keeps_nothing_of_answered_http_requests(tmp_path):
    import httpx

    kids = Children()
    try:
        router = kids.start("router", ["router", "--listen", "tcp://127.0.0.1:0", "--http", "127.0.0.1:0",
                                       "--config", str(small(tmp_path)), *FAST])
        kids.start("worker", ["worker", "--router", router["listen"], "--worker-id", "1", "--config",
                              str(small(tmp_path)), *FAST])

        async def main():
            client = _RouterClient(router["listen"])
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.listen)
                await registered(client)
                async with httpx.AsyncClient(base_url=router["http"], timeout=30) as http:
                    for i in range(20):
                        r = await http.post("/v1/completions", json={"model": "kvemu", "prompt": f"question {i}",
                                                                     "max_tokens": 3, "stream": i % 2 == 0})
                        assert r.status_code == 200
                stats = await client.stats()
                tg.cancel_scope.cancel()
                return stats

        stats = anyio.run(main)
        assert stats.records_held == 0
    finally:
        kids.stop_all()


@pytest.mark.process_supervision
def test_a_router_sigterm_lets_http_requests_finish_within_the_grace_then_ends_the_rest_in_their_streams(tmp_path):
    import httpx

    scenario = small(tmp_path)
    kids = Children()
    try:
        router = router_and_worker(kids, scenario, 1, "--set", "cluster.engine.speedup_ratio=0.2", "--own-engine",
                                   router_args=("--grace", "1.5", "--http", "127.0.0.1:0"))

        async def main():
            client = _RouterClient(router["listen"])
            got = {}
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.listen)
                await registered(client)
                async with httpx.AsyncClient(base_url=router["http"], timeout=30) as http:
                    async def ask(name, max_tokens):
                        r = await http.post("/v1/completions", json={
                            "model": "kvemu", "prompt": f"{name} request", "max_tokens": max_tokens,
                            "ignore_eos": True, "stream": True})
                        got[name] = r.text

                    tg.start_soon(ask, "long", 20000)
                    tg.start_soon(ask, "short", 20)
                    await anyio.sleep(0.5)
                    kids.signal("router", signal.SIGTERM)
                    with anyio.fail_after(20):
                        while len(got) < 2:
                            await anyio.sleep(0.05)
                tg.cancel_scope.cancel()
            return got

        got = anyio.run(main)
        assert kids.procs["router"].wait(15) == 0
    finally:
        kids.stop_all()
    assert '"finish_reason":"length"' in got["short"] and got["short"].endswith("data: [DONE]\n\n")
    assert "router_shutdown" in got["long"] and got["long"].endswith("data: [DONE]\n\n")
