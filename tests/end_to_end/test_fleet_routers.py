"""A kvemu fleet with real routers in front (vllm-router, sglang-router from PyPI), on 127.0.0.1: the workload
replayed over HTTP and judged by what the engines really did (``kvemu fleet``, ``kvemu loadgen --http``,
``kvemu bench-router``).

A test that needs a router skips, saying so, when the router is not installed (``pip install 'kvemu[routers]'``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.external_routers import parse_router
from harness.procs.fleet import FleetInfo
from harness.procs.http_loadgen import http_loadgen_report
from harness.procs.up import Children
from harness.router_bench import bench_routers
from harness.scenario import load_scenario

from tests.conftest import reference_unavailable

SCENARIO = """
name: routers-e2e
cluster:
  workers: 2
  dp_size: 2
  engine: {block_size: 16, num_gpu_blocks: 4096, speedup_ratio: 20, decode_speedup_ratio: 2}
router: {policy: kv}
workload:
  kind: synthetic
  rate_rps: 6
  turns: 3
  think_time_s: 0.3
  system_prefix_tokens: 256
  num_prefix_groups: 2
  isl: {kind: constant, mean: 96}
  osl: {kind: constant, mean: 8}
run: {mode: virtual, duration_s: 2, seed: 1, drain_timeout_s: 60}
"""


def _scenario(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO + extra)
    return path


def _need(name: str) -> None:
    """Skip without the router (fail under ``KVEMU_REQUIRE_REFERENCE=1``, as in CI, where the dev extras have it)."""
    if shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])) is None:
        reference_unavailable(f"{name} is not installed (pip install 'kvemu[routers]'): this test runs the real router")


def _requests(where: Path) -> list[dict]:
    return [json.loads(line) for line in (where / "requests.jsonl").read_text().splitlines()]


def _metric_total(url: str, name: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        total += sum(s.value for s in fam.samples if s.name == name)
    return total


@pytest.mark.process_supervision
def test_the_engine_truth_of_a_fleet_is_every_request_and_agrees_with_the_workers_metrics(tmp_path):
    """No router: the workload straight to one worker of a 2-worker fleet. Every request ends, each is matched
    to its engine record by id, and the engines' totals are what that worker's /metrics count."""
    path = _scenario(tmp_path)
    kids = Children()
    try:
        fleet = msgspec.convert(kids.start("fleet", ["fleet", str(path)], timeout_s=60), FleetInfo)
        assert [(w.worker_id, w.dp_size, w.block_size, len(w.kv_events)) for w in fleet.workers] == \
            [(0, 2, 16, 2), (1, 2, 16, 2)]
        target = fleet.workers[0]
        summary, where = http_loadgen_report(load_scenario(path), target.url, tmp_path / "out", fleet=fleet)
        assert where is not None
        recs = _requests(where)
        n = summary.num_requests
        assert n >= 10 and summary.completed_requests == n == len(recs)
        assert summary.kvemu.hook_counts["engine_truth_matched"] == n
        assert {r["worker_id"] for r in recs} == {0} and {r["dp_rank"] for r in recs} == {0, 1}  # round robin
        cached = sum(r["engine_cached_tokens"] for r in recs)
        assert cached > 0  # the sessions' later turns find their prefix
        assert _metric_total(target.url, "vllm:request_success_total") == n
        assert _metric_total(target.url, "vllm:prefix_cache_hits_total") == cached
        assert _metric_total(target.url, "vllm:prompt_tokens_total") == sum(r["isl"] for r in recs)
        assert _metric_total(fleet.workers[1].url, "vllm:request_success_total") == 0
    finally:
        kids.stop_all()


@pytest.mark.third_party_routers
def test_vllm_router_kv_aware_finds_more_cached_tokens_than_round_robin_and_sglang_router_runs_it_too(tmp_path):
    """The same shared-prefix workload through three routers, each in front of a fresh fleet: vllm-router's
    kv_aware (it reads the workers' KV events) finds more prompt tokens cached at the engines than its
    round_robin, every request of every run ends, and the per-request truth names the rank that served it."""
    _need("vllm-router")
    _need("sglang-router")
    path = _scenario(tmp_path)
    routers = [parse_router(r) for r in ("vllm-router:kv_aware", "vllm-router:round_robin", "sglang-router")]
    rows, table = bench_routers(str(path), [], routers, tmp_path / "bench")
    by = {r["router"]: r for r in rows}
    assert set(by) == {"vllm-router:kv_aware", "vllm-router:round_robin", "sglang-router:cache_aware"}, table
    for row in rows:
        assert row["error"] is None and row["failed"] == 0 and row["completed"] >= 10, row
        assert row["engine_truth_matched"] == row["completed"], row
    assert by["vllm-router:kv_aware"]["prefix_reuse"] > by["vllm-router:round_robin"]["prefix_reuse"], table
    recs = _requests(tmp_path / "bench" / "vllm-router-kv_aware")
    assert all(r["worker_id"] in (0, 1) and r["dp_rank"] in (0, 1) for r in recs)  # the rank that served each
    spread = _requests(tmp_path / "bench" / "vllm-router-round_robin")
    assert {(r["worker_id"], r["dp_rank"]) for r in spread} == {(0, 0), (0, 1), (1, 0), (1, 1)}  # every rank
    report = json.loads((tmp_path / "bench" / "routers.json").read_text())
    assert [r["router"] for r in report["routers"]] == [r["router"] for r in rows]
    assert (tmp_path / "bench" / "routers.md").read_text().count("| vllm-router:") == 2
    assert (tmp_path / "bench" / "routers.png").stat().st_size > 1000


@pytest.mark.third_party_routers
def test_a_worker_removed_behind_vllm_router_ends_every_request_with_a_reason(tmp_path):
    """The fleet removes worker 0 (killed) 1 s after the first request: nothing hangs, every request ends, and
    what failed says why (the router's or the connection's words)."""
    _need("vllm-router")
    path = _scenario(tmp_path, "chaos:\n  - {at_s: 1.0, action: remove_worker, worker: 0, graceful: false}\n")
    routers = [parse_router("vllm-router:round_robin")]
    rows, _ = bench_routers(str(path), [], routers, tmp_path / "bench")
    row = rows[0]
    recs = _requests(tmp_path / "bench" / "vllm-router-round_robin")
    assert row["error"] is None and len(recs) == row["completed"] + row["failed"] >= 10
    assert all(r["failure"] is None or len(r["failure"]) > 5 for r in recs)
    assert all(r["worker_id"] == 1 for r in recs if r["arrival_ns"] > 3 * 10**9 and r["failure"] is None)


LIVE_TIMER_SLACK_NS = 10_000_000
PD_CLUSTER = """
cluster:
  prefill:
    workers: 1
    dp_size: 2
    engine: {block_size: 16, num_gpu_blocks: 4096, speedup_ratio: 20, decode_speedup_ratio: 2,
             kv_transfer_bandwidth: 25.0, kv_transfer_bytes_per_token: 131072}
  decode:
    workers: 2
    engine: {block_size: 16, num_gpu_blocks: 4096, speedup_ratio: 20, decode_speedup_ratio: 2}
"""


@pytest.mark.third_party_routers
def test_a_disaggregated_fleet_serves_both_routers_pd_modes_with_the_kv_handed_over(tmp_path):
    """vllm-router's PD mode (prefill leg, then the decode leg with the prefill's kv_transfer_params) and
    sglang-router's (both legs at once, one bootstrap room) in front of one prefill and two decode workers:
    every request ends, its prefill leg ran on the prefill worker and its decode leg on a decode worker (matched
    by the id the answer carried where vllm-router replaced the client's), and later turns find their prompt
    cached where it was computed."""
    _need("vllm-router")
    _need("sglang-router")
    path = tmp_path / "pd.yaml"
    path.write_text(SCENARIO.replace("cluster:\n  workers: 2\n  dp_size: 2\n  engine: {block_size: 16, "
                                     "num_gpu_blocks: 4096, speedup_ratio: 20, decode_speedup_ratio: 2}\n",
                                     PD_CLUSTER.lstrip()))
    assert load_scenario(path).cluster.disaggregated
    routers = [parse_router(r) for r in ("vllm-router:round_robin", "sglang-router:round_robin")]
    rows, table = bench_routers(str(path), [], routers, tmp_path / "bench")
    for row in rows:
        assert row["error"] is None and row["failed"] == 0 and row["completed"] >= 10, table
        assert row["engine_truth_matched"] == row["completed"], table
    for name in ("vllm-router-round_robin", "sglang-router-round_robin"):
        recs = _requests(tmp_path / "bench" / name)
        assert all(r["prefill_worker_id"] == 0 and r["worker_id"] in (1, 2) for r in recs), name
        # the KV moved from the prefill to the decode rank before the first token; a live engine hands a pass's
        # results over after sleeping its duration, which the event loop's millisecond timers may end before the
        # pass's stamped end (0.17 ms seen), so the decode rank may reserve a little before the prefill's stamp
        assert all(r["prefill_done_ns"] - LIVE_TIMER_SLACK_NS <= r["kv_reserved_ns"] <= r["kv_activated_ns"]
                   <= r["first_token_ns"] for r in recs), name
        assert sum(r["engine_cached_tokens"] for r in recs) > 0, name


@pytest.mark.process_supervision
def test_bench_router_runs_kvemus_own_router_and_any_router_given_as_a_command(tmp_path):
    """``kvemu`` (kvemu serve --in-process, whose front door serves its engines' truth) and ``cmd:`` with a
    trivial round-robin proxy, for which bench-router fills in its port and the fleet's workers; kvemu's
    router takes token-id prompts, the proxy text (``--prompt auto``)."""
    path = _scenario(tmp_path)
    proxy = Path(__file__).parents[2] / "examples" / "my_router.py"
    command = f"cmd:{sys.executable} {proxy} {{port}} {{workers}}"
    specs = [parse_router("kvemu"), parse_router(command), parse_router(command)]  # the same proxy twice
    rows, table = bench_routers(str(path), [], specs, tmp_path / "bench")
    assert [(r["router"], r["prompt"]) for r in rows] == [("kvemu:kv", "tokens"), ("cmd:my_router.py", "text"),
                                                         ("cmd:my_router.py-2", "text")]
    for row in rows:
        assert row["error"] is None and row["failed"] == 0 and row["completed"] >= 10, table
        assert row["engine_truth_matched"] == row["completed"], table
    kvemu = _requests(tmp_path / "bench" / "kvemu-kv")
    assert sum(r["engine_cached_tokens"] for r in kvemu) > 0 and {r["dp_rank"] for r in kvemu} == {0, 1}
    for folder in ("cmd-my_router.py", "cmd-my_router.py-2"):  # each its own report: neither overwrote the other
        assert len(_requests(tmp_path / "bench" / folder)) == rows[1]["completed"]
        assert not (tmp_path / "bench" / folder / "router-metrics.prom").exists()  # it was given no metrics port


@pytest.mark.process_supervision
def test_a_fleet_of_processes_says_where_each_worker_is_and_serves_its_truth(tmp_path):
    """``kvemu fleet --processes``: one ``kvemu worker`` process per worker, no router; the start line names
    them, and a request sent to one is in that worker's /kvemu/requests, served by the rank it was pinned to."""
    path = _scenario(tmp_path)
    kids = Children()
    try:
        fleet = msgspec.convert(kids.start("fleet", ["fleet", str(path), "--processes"], timeout_s=60), FleetInfo)
        assert fleet.processes and [w.worker_id for w in fleet.workers] == [0, 1]
        w = fleet.workers[1]
        assert httpx.get(f"{w.url}/server_info", timeout=10).json()["dp_size"] == 2
        r = httpx.post(f"{w.url}/v1/completions", json={"model": "kvemu", "prompt": "hello there", "max_tokens": 3},
                       headers={"X-Request-Id": "one", "X-data-parallel-rank": "1"}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        recs = httpx.get(f"{w.url}/kvemu/requests", timeout=10).json()["records"]
        assert [(x["request_id"], x["worker_id"], x["dp_rank"], x["output_tokens"]) for x in recs] == \
            [("one", 1, 1, 3)]
        assert httpx.get(f"{fleet.workers[0].url}/kvemu/requests", timeout=10).json()["records"] == []
    finally:
        kids.stop_all()
