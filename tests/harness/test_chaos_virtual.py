"""Faults on virtual time with real workers: nothing vanishes, nothing points at a dead worker."""

import pytest

from harness.run.runner import run_scenario
from harness.scenario import parse_scenario
from harness.workload.build import build_sessions

BASE = """
name: chaos
cluster:
  workers: 3
  dp_size: 2
  engine: {block_size: 16, num_gpu_blocks: 1024, speedup_ratio: 2, decode_speedup_ratio: 2}
router: {policy: kv, affinity: {enabled: true, ttl_secs: 30}, heartbeat_timeout_s: 2}
workload: {kind: synthetic, rate_rps: 6, turns: 3, think_time_s: 0.5, system_prefix_tokens: 128, sub_agents: 1,
           isl: {kind: constant, mean: 160}, osl: {kind: constant, mean: 24}}
run: {mode: virtual, seed: 5, duration_s: 12}
"""


def run(chaos: str, overrides=()):
    scenario = parse_scenario(BASE + "chaos:\n" + chaos, overrides=list(overrides))
    expected = sum(len(s.turns) * 2 for s in build_sessions(scenario))  # each turn has one sub-agent
    out = run_scenario(scenario)
    return out, expected


def check_invariants(out, expected, removed=()):
    records = out.data.records
    assert len(records) == expected, "a request vanished or was recorded twice"
    assert len({r.request_id for r in records}) == len(records)
    for r in records:
        finished = r.completion_ns is not None and r.failure is None
        assert finished or r.failure, f"{r.request_id} neither completed nor failed with a reason"
        if finished:
            assert len(r.token_times_ns) == r.max_tokens
    for w in removed:
        late = [r for r in records if r.dispatch_ns and r.worker_id == w and r.failure is None
                and r.dispatch_ns > out.removed_at.get(w, 1 << 62)]
        assert not late, "requests were dispatched to a worker after its removal was detected"


@pytest.mark.parametrize("graceful", [True, False])
def test_remove_worker(graceful):
    out, expected = run(f"  - {{at_s: 4, action: remove_worker, worker: 1, graceful: {str(graceful).lower()}}}\n")
    events = out.data.worker_events
    removed = [e for e in events if e.kind == "worker_removed"]
    assert [e.worker_id for e in removed] == [1]
    out.removed_at = {1: removed[0].time_ns}
    check_invariants(out, expected, removed=[1])
    failures = out.data.failures
    assert set(failures) <= {"worker_lost"}
    if graceful:
        assert not failures  # drained before deregistering
        assert removed[0].reason is not None and removed[0].reason.startswith("deregistered")
    else:
        assert removed[0].reason == "missed heartbeats"
    # sessions that were bound to worker 1 re-bound elsewhere: later turns completed on live workers
    late = [r for r in out.data.records if r.arrival_ns > removed[0].time_ns and r.failure is None]
    assert late and all(r.worker_id != 1 for r in late)


def test_add_worker_takes_traffic():
    out, expected = run("  - {at_s: 3, action: add_worker}\n", ["router.policy=round_robin"])
    check_invariants(out, expected)
    assert any(r.worker_id == 3 for r in out.data.records)
    assert all(r.arrival_ns > 3 * 10**9 for r in out.data.records if r.worker_id == 3)
    assert (3, 0) in out.data.ranks and (3, 1) in out.data.ranks


def test_dropped_kv_events_are_repaired_by_replay():
    out, expected = run("  - {at_s: 2, action: drop_kv_events, worker: 0, dp_rank: 0, count: 3}\n"
                        "  - {at_s: 2, action: drop_kv_events, worker: 2, dp_rank: 1, count: 2}\n")
    check_invariants(out, expected)
    stats = out.data.kv_stats
    assert stats[0]["gaps"] >= 1 and stats[2]["gaps"] >= 1
    assert sum(s["lost_batches"] for s in stats.values()) == 0
    assert stats[0]["replayed_batches"] >= 3 and stats[2]["replayed_batches"] >= 2
    # the router's view stayed true: what it predicted is what the engines found
    routing = [(r.predicted_overlap_blocks or 0) * 16 for r in out.data.records if r.failure is None]
    assert sum(routing) > 0


def test_slow_worker_and_kv_lag_still_complete_everything():
    out, expected = run("  - {at_s: 1, action: slow_worker, worker: 0, factor: 3}\n"
                        "  - {at_s: 1, action: delay_kv_events, lag_ms: 200}\n", ["router.policy=round_robin"])
    check_invariants(out, expected)
    assert not out.data.failures
    base, _ = run("  []\n", ["router.policy=round_robin"])

    def mean_itl(o, worker):
        gaps = [b - a for r in o.data.records if r.worker_id == worker and r.arrival_ns > 2e9
                for a, b in zip(r.token_times_ns, r.token_times_ns[1:])]
        return sum(gaps) / len(gaps)

    assert mean_itl(out, 0) > 2.5 * mean_itl(base, 0)  # the slowed worker really is slower
    assert mean_itl(out, 1) < 1.2 * mean_itl(base, 1)  # the others are not


def test_kill_one_dp_rank():
    out, expected = run("  - {at_s: 3, action: kill_rank, worker: 1, dp_rank: 1}\n")
    check_invariants(out, expected)
    assert set(out.data.failures) <= {"rank_lost"}
    fenced = [e for e in out.data.worker_events if e.kind == "worker_fenced"]
    assert fenced and fenced[0].worker_id == 1 and fenced[0].reason == "rank_down"
    t = fenced[0].time_ns
    later = [r for r in out.data.records if r.routed_ns is not None and r.routed_ns > t]
    assert later and all((r.worker_id, r.dp_rank) != (1, 1) for r in later)
    assert any(r.worker_id == 1 and r.dp_rank == 0 for r in later)  # the other rank keeps serving


def test_router_restart_rebuilds_its_index_from_replay_and_keeps_serving():
    out, expected = run("  - {at_s: 4, action: restart_router}\n")
    check_invariants(out, expected)
    assert set(out.data.failures) <= {"router_restart"}
    records = out.data.records
    after = [r for r in records if r.arrival_ns > 4.5e9]
    assert after and all(r.failure is None for r in after)
    # the new router knew the workers' caches at once: it predicted cache hits the engines confirmed
    hits = [r for r in after if r.predicted_overlap_blocks]
    assert hits and sum(r.engine.cached_tokens or 0 for r in hits) > 0
    assert sum(s["replayed_batches"] for s in out.data.kv_stats.values()) > 0


def test_a_worker_applies_each_fault_it_is_sent_to_itself():
    """What a worker process does with a ``Chaos`` message from the router (the in-process runner calls the
    same method); a rank it does not have, or a dead one, is refused and changes nothing."""
    from kvemu import ManualClock
    from kvemu.runtime.kv_bus import MemoryKvBus
    from kvemu.messages import Chaos
    from kvemu.runtime.transport import MemoryNetwork
    from workers.actor.actor import WorkerActor
    from workers.config import EngineConfig
    from workers.mock_worker import MockWorker

    from kvemu.runtime.loop import run_virtual

    clock = ManualClock()

    async def main():  # the worker sends RankDown when a rank dies: a loop must be running
        bus = MemoryKvBus()
        pubs = [bus.publisher(3, r) for r in range(2)]
        actor = WorkerActor(MockWorker(EngineConfig(dp_size=2), worker_id=3), MemoryNetwork().worker_end(3), clock,
                            pubs, mode="virtual")
        assert actor.apply_chaos(Chaos(action="drop_kv_events", dp_rank=1, count=4)) is None
        assert (pubs[0].drop_next, pubs[1].drop_next) == (0, 4)
        assert actor.apply_chaos(Chaos(action="delay_kv_events", lag_ms=7.5)) is None
        assert [p.lag_ns for p in pubs] == [7_500_000, 7_500_000]
        assert actor.apply_chaos(Chaos(action="slow_worker", factor=3.0)) is None
        assert all(core.timer.slowdown == 3.0 for core in actor.worker.cores)
        assert actor.apply_chaos(Chaos(action="kill_rank", dp_rank=0)) is None
        assert actor.dead_ranks == {0}
        assert "no live rank 0" in actor.apply_chaos(Chaos(action="kill_rank", dp_rank=0))
        assert "no live rank 2" in actor.apply_chaos(Chaos(action="drop_kv_events", dp_rank=2))
        assert (pubs[0].drop_next, pubs[1].drop_next) == (0, 4)

    run_virtual(main, clock)
