"""Router replicas in one cluster (``router.replicas``): what they lose, what brings it back, and the faults of one.

The workload shares prefixes (16 system prompts) and continues conversations (4 turns), on 8 idle-enough workers
that one router seldom trades locality away (its regret is near zero). Replicas without KV events (approximate indexes
each built from their own decisions, as SGLang's gateway and vllm-router's cache-aware policy keep) scatter a
conversation's turns when the front sprays them at random; a session-hash front or replica sync with shared
predictions brings the reuse back. With KV events every replica's index is the engines' view, and a replica whose
feed lags routes worse only while it lags.
"""

import json

import pytest

from kvemu.runtime.router import RouterSettings

from harness.report.files import write_requests
from harness.report.summary import summarize
from harness.run.runner import run_scenario
from harness.scenario import ScenarioError, parse_scenario

BASE = """
name: replicas
cluster:
  workers: 8
  engine: {block_size: 16, num_gpu_blocks: 2048}
router: {policy: kv, use_kv_events: %(kv_events)s, replicas: %(replicas)d, replica_front: %(front)s,
         replica_sync: {enabled: %(sync)s, predictions: %(predictions)s}}
workload: {kind: synthetic, rate_rps: 0.2, turns: 4, think_time_s: 1.0, system_prefix_tokens: 2048,
           num_prefix_groups: 16, isl: {kind: normal, mean: 512, std: 32, low: 16, high: 4096},
           osl: {kind: normal, mean: 64, std: 16, low: 8, high: 512}}
run: {mode: virtual, seed: 3, duration_s: 180}
"""


def scenario(replicas=1, front="random", sync=False, predictions=False, kv_events=False, chaos=""):
    text = BASE % {"replicas": replicas, "front": front, "sync": str(sync).lower(),
                   "predictions": str(predictions).lower(), "kv_events": str(kv_events).lower()}
    return parse_scenario(text + (f"chaos:\n{chaos}" if chaos else ""))


def run(**kw):
    out = run_scenario(scenario(**kw))
    summary = summarize(out.data).to_builtins()
    records = out.data.records
    assert records and all(r.done for r in records), "every request completes"
    return out, summary


def figures(summary):
    return summary["prefix_cache_reused_ratio"], summary["kvemu"]["routing"]["regret_ratio"]


@pytest.fixture(scope="module")
def approx():
    """The approximate-index runs, once for the module: one router, and four replicas four ways."""
    return {name: run(**kw) for name, kw in {
        "one": {"replicas": 1},
        "random": {"replicas": 4},
        "session": {"replicas": 4, "front": "session"},
        "sync": {"replicas": 4, "sync": True, "predictions": True},
        "sync_bookings_only": {"replicas": 4, "sync": True},
    }.items()}


def test_one_router_loses_nothing_on_this_workload(approx):
    _, s = approx["one"]
    reuse, regret = figures(s)
    assert regret < 0.05  # (a few requests traded locality for load, by the selector's cost)
    assert reuse > 0.7


def test_four_replicas_sprayed_at_random_lose_reuse_and_show_it_as_regret(approx):
    reuse1, _ = figures(approx["one"][1])
    out, s = approx["random"]
    reuse, regret = figures(s)
    assert reuse < reuse1 - 0.1
    assert regret > 0.3
    rows = s["kvemu"]["replicas"]["per_replica"]
    assert [r["replica"] for r in rows] == [0, 1, 2, 3]
    assert sum(r["requests"] for r in rows) == s["num_requests"]
    assert all(r["requests"] > 0 and r["regret_ratio"] > 0.1 for r in rows)
    lost = s["kvemu"]["routing"]["regret"]["lost_blocks"]
    assert sum(r["regret"]["lost_blocks"] for r in rows) == lost > 0


@pytest.mark.parametrize("name", ["session", "sync"])
def test_a_session_hash_front_or_sync_recovers_most_of_it(approx, name):
    reuse1, _ = figures(approx["one"][1])
    reuse_random, regret_random = figures(approx["random"][1])
    reuse, regret = figures(approx[name][1])
    assert reuse - reuse_random > 0.75 * (reuse1 - reuse_random), "recovers most of the lost reuse"
    assert regret < regret_random / 2


def test_a_session_hash_front_keeps_every_session_on_one_replica(approx):
    out, _ = approx["session"]
    of = out.data.replicas.replica_of
    by_session = {}
    for r in out.data.records:
        by_session.setdefault(r.session_id, set()).add(of[r.request_id])
    assert all(len(v) == 1 for v in by_session.values())
    assert len({next(iter(v)) for v in by_session.values()}) == 4


def test_sync_of_bookings_alone_does_not_share_an_approximate_index(approx):
    """As Dynamo's sync: bookings reach the peers' load views, not their prefix indexes (``predictions`` does)."""
    out, s = approx["sync_bookings_only"]
    rows = s["kvemu"]["replicas"]["per_replica"]
    assert all(r["sync"]["applied"] > 0 and r["sync"]["announced"] > 0 for r in rows)
    applied = sum(r["sync"]["applied"] for r in rows)
    announced = sum(r["sync"]["announced"] for r in rows)
    assert announced == 3 * s["num_requests"], "each request: booked, prefill done, freed"
    # every event reaches the three others (the run may end before the last batch, 1 ms late, lands)
    assert 0 <= 3 * announced - applied <= 3
    assert all(r["sync"]["ignored"] == r["sync"]["refused"] == 0 for r in rows)
    _, regret_random = figures(approx["random"][1])
    assert figures(s)[1] > 0.8 * regret_random


def test_replica_runs_are_deterministic(tmp_path, approx):
    out, s = approx["sync"]
    again, s2 = run(replicas=4, sync=True, predictions=True)
    same = {k: v for k, v in s.items() if k != "wall_time_ms"}
    assert same == {k: v for k, v in s2.items() if k != "wall_time_ms"}
    of = out.data.replicas.replica_of
    write_requests(out.data.records, tmp_path / "a.jsonl", replica_of=of)
    write_requests(again.data.records, tmp_path / "b.jsonl", replica_of=again.data.replicas.replica_of)
    a = (tmp_path / "a.jsonl").read_bytes()
    assert a == (tmp_path / "b.jsonl").read_bytes()
    first = json.loads(a.splitlines()[0])
    assert first["router_replica"] == of[first["request_id"]]


def lost_by_replica(out):
    """(replica, seconds since the first arrival) of every request routed with a loss, and how many blocks."""
    of = out.data.replicas.replica_of
    t0 = min(r.arrival_ns for r in out.data.records)
    return [(of[r.request_id], (r.routed_ns - t0) / 1e9, r.truth_best_overlap_blocks - r.truth_overlap_blocks)
            for r in out.data.records if r.truth_best_overlap_blocks > r.truth_overlap_blocks]


def test_with_kv_events_a_lagging_feed_costs_regret_in_its_window_only():
    """Two system prompts, each cached on several ranks: a replica that has not heard where a conversation went
    picks among them by load. Its feed lags 20 s from 30 s to 90 s (what was held back lands by 110 s)."""
    lag = """
  - {at_s: 30, action: delay_kv_events, replica: 1, lag_ms: 20000}
  - {at_s: 90, action: delay_kv_events, replica: 1, lag_ms: 0}
"""
    text = BASE.replace("num_prefix_groups: 16", "num_prefix_groups: 2")
    params = {"replicas": 4, "front": "random", "sync": "false", "predictions": "false", "kv_events": "true"}
    faulted = run_scenario(parse_scenario(text % params + "chaos:" + lag))
    quiet = run_scenario(parse_scenario(text % params))
    mine = [(t, n) for i, t, n in lost_by_replica(faulted) if i == 1]
    assert sum(n for _, n in mine) > 50, "the lagging replica routed worse"
    assert all(30 <= t <= 110 for t, _ in mine), "only while it lagged"
    assert not [x for x in lost_by_replica(quiet) if x[0] == 1], "and not at all without the lag"
    early = [x for x in lost_by_replica(faulted) if x[1] < 30]
    assert early == [x for x in lost_by_replica(quiet) if x[1] < 30], "before the fault both runs are one run"


def test_a_dropped_feed_batch_is_recovered_by_that_replica_alone():
    out, s = run(replicas=4, kv_events=True, chaos="  - {at_s: 30, action: drop_kv_events, replica: 2, count: 3}\n")
    rows = s["kvemu"]["replicas"]["per_replica"]
    assert [r["kv_feed_dropped_batches"] for r in rows] == [0, 0, 3, 0]
    assert rows[2]["kv_events"]["gaps"] >= 1 and rows[2]["kv_events"]["replays"] >= 1
    assert rows[2]["kv_events"]["lost_batches"] == 0
    assert all(r["kv_events"]["gaps"] == 0 for i, r in enumerate(rows) if i != 2)


def test_restarting_one_replica_leaves_the_others_serving():
    scen = scenario(replicas=2, kv_events=True, chaos="  - {at_s: 30, action: restart_router, replica: 1}\n")
    out = run_scenario(scen)
    s = summarize(out.data).to_builtins()
    rows = s["kvemu"]["replicas"]["per_replica"]
    assert [r["restarts"] for r in rows] == [0, 1]
    of = out.data.replicas.replica_of
    records = out.data.records
    assert all(r.done or r.failure for r in records), "every request ends with a reason"
    failed = [r for r in records if r.failure]
    assert all(of[r.request_id] == 1 and r.failure.startswith("router_restart") for r in failed)
    after = [r for r in records if of[r.request_id] == 1 and r.arrival_ns - records[0].arrival_ns > 35e9]
    assert after and all(r.done for r in after), "the restarted replica serves again"
    assert all(r["workers_registered"] == 8 for r in rows)


@pytest.mark.parametrize("text, field", [
    ("cluster: {prefill: {workers: 1}, decode: {workers: 1}}\nrouter: {replicas: 2}\n", "router.replicas"),
    ("router: {replicas: 2}\nchaos: [{at_s: 1, action: restart_router, replica: 2}]\n", "chaos[0].replica"),
    ("router: {replicas: 2}\nchaos: [{at_s: 1, action: remove_worker, replica: 1}]\n", "chaos[0].replica"),
    ("router: {replicas: 2, replica_sync: {enabled: true, predictions: true}}\n", "replica_sync.predictions"),
    ("router: {replicas: 65}\n", "replicas"),
    ("router: {replica_front: sticky}\n", "replica_front"),
])
def test_bad_replica_settings_name_the_field(text, field):
    with pytest.raises(ScenarioError) as err:
        parse_scenario("name: bad\n" + text)
    assert field in str(err.value)


def test_live_replicas_over_zeromq_serve_every_request():
    """Live, in one process: two replicas on 127.0.0.1, each subscribing to the workers' KV publishers itself,
    booking sync on, a fault on each replica's feed; every request completes and both replicas routed by what the
    engines published."""
    scen = parse_scenario("""
name: live-replicas
cluster: {workers: 2, engine: {block_size: 16, num_gpu_blocks: 512, speedup_ratio: 20, decode_speedup_ratio: 20}}
router: {policy: kv, replicas: 2, replica_front: round_robin, replica_sync: {enabled: true}}
workload: {kind: synthetic, rate_rps: 8, turns: 2, think_time_s: 0.2, system_prefix_tokens: 64,
           isl: {kind: constant, mean: 64}, osl: {kind: constant, mean: 4}}
run: {mode: live, seed: 1, duration_s: 1.5}
chaos:
  - {at_s: 0.3, action: drop_kv_events, replica: 1, count: 2}
  - {at_s: 0.6, action: delay_kv_events, replica: 0, lag_ms: 50}
""")
    out = run_scenario(scen)
    s = summarize(out.data).to_builtins()
    records = out.data.records
    assert records and all(r.done for r in records)
    rows = s["kvemu"]["replicas"]["per_replica"]
    assert [r["requests"] > 0 for r in rows] == [True, True]
    assert all(r["kv_events"]["batches"] > 0 and r["workers_registered"] == 2 for r in rows)
    assert all(r["sync"]["applied"] > 0 for r in rows)
    # replica 1's own subscriber lost two live batches on the way and got them back by replay; replica 0's lagged
    assert [r["kv_feed_dropped_batches"] for r in rows] == [0, 2]
    assert rows[1]["kv_events"]["gaps"] >= 1 and rows[1]["kv_events"]["lost_batches"] == 0
    assert rows[0]["kv_events"]["gaps"] == 0


@pytest.mark.parametrize("graceful", [True, False])
def test_a_worker_leaving_leaves_every_replica(graceful):
    out = run_scenario(scenario(replicas=3, kv_events=True, chaos=f"""
  - {{at_s: 40, action: remove_worker, worker: 2, graceful: {str(graceful).lower()}}}
"""))
    s = summarize(out.data).to_builtins()
    records = out.data.records
    if graceful:  # drained first: nothing fails
        assert all(r.done for r in records)
    else:  # what it held fails with worker_lost (or ran again elsewhere), each with its reason
        assert all(r.done or r.failure.startswith("worker_lost") for r in records)
    assert all(r["workers_registered"] == 7 for r in s["kvemu"]["replicas"]["per_replica"])
    t0 = min(r.arrival_ns for r in records)
    fenced = 40e9 + RouterSettings().heartbeat_timeout_s * 1e9 * 1.5  # (abruptly: noticed by its silence)
    assert not [r for r in records if r.worker_id == 2 and r.routed_ns - t0 > fenced], \
        "no replica routes to a worker that left"


def test_the_load_generator_and_the_front_door_process_pick_replicas_as_one_process_does():
    """``replica_front`` is the one picker of a scenario's replicas (its rule, seed and prefix length): the load
    generator's ``ReplicaClients`` picks by it from the whole request (a prefix front hashes the prompt, not round
    robin), as ``ReplicaFrontDoor`` does in one process."""
    import anyio

    from kvemu.messages import ClientRequest
    from kvemu.replica_front import ReplicaFrontDoor

    from harness.run.factories import replica_front
    from harness.procs.replica_clients import ReplicaClients
    from harness.scenario import parse_scenario

    scenario = parse_scenario("name: t\nrouter: {replicas: 3, replica_front: prefix, replica_prefix_tokens: 4}\n")
    front = replica_front(scenario)
    assert (front.replicas, front.mode, front.prefix_tokens) == (3, "prefix", 4)

    class Client:
        def __init__(self) -> None:
            self.got: list[str] = []

        async def submit(self, req: ClientRequest) -> None:
            self.got.append(req.request_id)

    clients = [Client() for _ in range(3)]
    spread = ReplicaClients(clients, replica_front(scenario))
    in_process = ReplicaFrontDoor([object()] * 3, replica_front(scenario))  # type: ignore[list-item]  # (picks only)
    reqs = [ClientRequest(request_id=f"r{i}", tokens=[i % 5, 7, 7, 7, i], max_tokens=1) for i in range(30)]

    async def send() -> None:
        for req in reqs:
            await spread.submit(req)

    anyio.run(send)
    expect = [in_process.front.pick_request(req) for req in reqs]
    assert [spread.replica_of[r.request_id] for r in reqs] == expect
    for head in range(5):  # the same first 4 tokens (the 5th differs): one replica
        assert len({spread.replica_of[r.request_id] for r in reqs if r.tokens[0] == head}) == 1
    assert len(set(expect)) > 1
