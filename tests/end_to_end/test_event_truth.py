"""``run.event_truth`` under ``kvemu up``: the load generator follows the workers' KV events and the report has the
routing regret the engines of separate processes cannot give (``harness.procs.truth_oracle``)."""

import json

import pytest

from tests.end_to_end.test_processes import FAST, kvemu

pytestmark = pytest.mark.process_supervision

WORKLOAD = """
name: etruth
cluster: {workers: 2, dp_size: 2}
ROUTER
workload: {kind: synthetic, rate_rps: 15, turns: 3, think_time_s: 0.2, system_prefix_tokens: 64,
           isl: {kind: constant, mean: 96}, osl: {kind: constant, mean: 8}}
run: {mode: live, seed: 4, duration_s: 2, event_truth: true}
"""


def _up(tmp_path, name: str, router: str) -> tuple[dict, list[dict], str]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(WORKLOAD.replace("ROUTER", router))
    out = tmp_path / name
    res = kvemu("up", str(path), *FAST, "-o", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), rows, (out / "report.md").read_text()


def _consistent(summary: dict, rows: list[dict]) -> dict:
    """The regret figures agree with the rows' truth fields; returns ``kvemu.routing.regret``."""
    rg = summary["kvemu"]["routing"]["regret"]
    assert rg is not None and rg["truth"] == "kv_events"
    feed = rg["truth_feed"]  # the load generator's own KV feed: it heard the workers, and lost nothing
    assert feed["batches"] > 0 and feed["lost_batches"] == 0
    done = [r for r in rows if r["completion_ns"] is not None]
    assert done and all(r["truth_overlap_blocks"] is not None for r in done)  # every routed request judged
    judged = [r for r in rows if r["truth_best_overlap_blocks"] is not None]
    assert rg["requests_compared"] == len(judged)
    assert all(0 <= r["truth_overlap_blocks"] <= r["truth_best_overlap_blocks"] <= r["isl"] // 16 for r in judged)
    lost = sum(r["truth_best_overlap_blocks"] - r["truth_overlap_blocks"] for r in judged)
    assert rg["lost_blocks"] == lost == sum(rg["recoverable_prefill_blocks"].values())
    assert all((r["regret_source"] is None) == (r["truth_overlap_blocks"] == r["truth_best_overlap_blocks"])
               for r in judged)
    return rg


def test_one_router_on_a_quiet_workload_has_event_derived_regret_and_little_of_it(tmp_path):
    summary, rows, md = _up(tmp_path, "one", "router: {policy: kv, affinity: {enabled: true, ttl_secs: 30}, "
                                              "heartbeat_timeout_s: 1.5}")
    assert summary["completed_requests"] == summary["num_requests"] > 0
    rg = _consistent(summary, rows)
    assert rg["novel_blocks"] > 0 and rg["regret_ratio"] <= 0.05  # a KV-event router, affinity, no faults
    # the oracle saw the caches the engines found: a second turn's truth is its session's first turn's blocks
    assert any(r["truth_overlap_blocks"] > 4 for r in rows)  # (beyond the 4 blocks of the system prefix)
    section = md.split("### Routing regret", 1)[1]
    assert "from the workers' KV events" in section and "The load generator's KV feed:" in section


def test_two_replicas_on_approximate_indexes_and_a_random_front_regret_more_than_one_router(tmp_path):
    approx = "router: {policy: kv, heartbeat_timeout_s: 1.5, use_kv_events: false"
    one, one_rows, _ = _up(tmp_path, "one", approx + "}")
    two, two_rows, _ = _up(tmp_path, "two", approx + ", replicas: 2, replica_front: random}")
    assert one["num_requests"] == two["num_requests"] > 0  # the same workload
    single, both = _consistent(one, one_rows), _consistent(two, two_rows)
    per = two["kvemu"]["replicas"]["per_replica"]
    assert all(row["regret"] is not None and row["regret"]["truth"] == "kv_events" for row in per)
    assert sum(row["regret"]["lost_blocks"] for row in per) == both["lost_blocks"]
    assert sum(row["regret"]["requests_compared"] for row in per) == both["requests_compared"]
    # a turn that reaches the other replica is routed without what its first turn left: lost to its cache owner
    assert both["regret_ratio"] > single["regret_ratio"] + 0.05
    # (how many of those blocks each run loses to their cache owner depends on live timing: 36 with two replicas
    # and 44 with one router were seen; that the two-replica run loses some to their owner is what holds)
    assert both["recoverable_prefill_blocks"]["cache_owner"] > 0
