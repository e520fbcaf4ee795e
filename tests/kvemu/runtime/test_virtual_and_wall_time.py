"""The same actors on virtual and on wall time: real workers, real engines, both transports."""

import anyio

from kvemu import ManualClock, WallClock
from kvemu.hooks import Hooks
from kvemu.runtime.loop import run_live, run_virtual
from kvemu.messages import ClientRequest

from harness.run.cluster import cluster
from harness.scenario import parse_scenario

SMALL = """
name: modes
cluster:
  workers: 2
  dp_size: 2
  engine: {block_size: 16, num_gpu_blocks: 512, speedup_ratio: 20, decode_speedup_ratio: 20}
router: {policy: kv, affinity: {enabled: true, ttl_secs: 30}}
run: {mode: MODE, seed: 11}
"""


def prompts():
    shared = list(range(1000, 1064))  # a 4-block system prefix
    return [shared + [i * 100 + j for j in range(16 * (1 + i % 3))] for i in range(8)]


def scripted_run(mode: str):
    """Send 8 requests one after another (waiting until each one's KV events are applied)."""
    scenario = parse_scenario(SMALL.replace("MODE", mode))
    hooks = Hooks()
    routed = []
    hooks.subscribe(lambda ev: routed.append((ev.request_id, ev.worker_id, ev.dp_rank, ev.details.overlap_blocks)),
                    "routed")
    clock = ManualClock() if mode == "virtual" else WallClock()

    async def main():
        results = []
        async with cluster(scenario, clock, hooks) as c:
            for i, tokens in enumerate(prompts()):
                res = await c.router.handle(ClientRequest(request_id=f"r{i}", tokens=tokens, max_tokens=8,
                                                          session_id=f"s{i % 2}" if i % 4 == 0 else None))
                results.append((res.request_id, res.worker_id, res.dp_rank, res.output_tokens, res.failure))
                # the engine announced this prompt's new blocks: wait until the router applied them
                with anyio.fail_after(10):
                    while sum(s.blocks_stored for s in c.router.kv_stats.values()) < _stored_so_far(i):
                        await anyio.sleep(0.001)
        return results

    results = run_virtual(main, clock) if mode == "virtual" else run_live(main)
    return results, routed


def _stored_so_far(i):
    """Distinct full blocks of prompts 0..i (the engines' caches are large enough to keep them all)."""
    blocks = set()
    for tokens in prompts()[: i + 1]:
        n = len(tokens) // 16
        for k in range(n):
            blocks.add(tuple(tokens[: (k + 1) * 16]))
    return len(blocks)


def test_same_decisions_and_token_counts_in_both_modes():
    virtual, routed_v = scripted_run("virtual")
    live, routed_l = scripted_run("live")
    assert all(r[4] is None for r in virtual + live)
    assert [r[3] for r in virtual] == [8] * 8
    assert virtual == live
    assert routed_v == routed_l
    assert any(r[3] > 0 for r in routed_v)  # the shared prefix was found cached


LIVE = """
cluster:
  workers: 2
  engine: {block_size: 16, num_gpu_blocks: 2048, speedup_ratio: 10, decode_speedup_ratio: 10}
router: {policy: kv}
workload: {kind: synthetic, rate_rps: 20, turns: 2, think_time_s: 0.2, system_prefix_tokens: 64,
           isl: {kind: constant, mean: 96}, osl: {kind: constant, mean: 8}}
run: {mode: live, seed: 3, duration_s: 2.5}
"""
"""A short live run of sessions on two workers (each test sets its name and DP size)."""


def test_live_mode_two_workers_two_ranks_on_loopback():
    from harness.run.runner import run_scenario

    out = run_scenario(parse_scenario(LIVE, overrides=["name=live-smoke", "cluster.dp_size=2",
                                                       "workload.num_prefix_groups=16"]))
    records = out.data.records
    assert records and all(r.failure is None and len(r.token_times_ns) == 8 for r in records)
    assert {(r.worker_id, r.dp_rank) for r in records} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    stats = out.data.kv_stats
    assert sum(s["batches"] for s in stats.values()) > 0
    assert sum(s["lost_batches"] + s["decode_errors"] for s in stats.values()) == 0
    assert any(r.engine.cached_tokens for r in records)  # prefix reuse through real KV events


def test_live_faults_drop_and_delay_kv_events_are_repaired():
    text = LIVE + """
chaos:
  - {at_s: 0.5, action: drop_kv_events, worker: 0, dp_rank: 0, count: 3}
  - {at_s: 0.5, action: drop_kv_events, worker: 1, dp_rank: 0, count: 3}
  - {at_s: 1.0, action: delay_kv_events, lag_ms: 50}
"""
    from harness.run.runner import run_scenario

    out = run_scenario(parse_scenario(text, overrides=["name=live-chaos", "cluster.dp_size=1"]))
    assert out.data.records and all(r.failure is None for r in out.data.records)
    stats = out.data.kv_stats
    assert sum(s["gaps"] for s in stats.values()) >= 1
    assert sum(s["replayed_batches"] for s in stats.values()) >= 3
    assert sum(s["lost_batches"] for s in stats.values()) == 0


def cancel_mid_stream(mode: str):
    """Cancel a long request after its first token: the engine drops it and every router table forgets it."""
    scenario = parse_scenario(SMALL.replace("MODE", mode))
    hooks = Hooks()
    clock = ManualClock() if mode == "virtual" else WallClock()

    async def main():
        async with cluster(scenario, clock, hooks) as c:
            first = anyio.Event()
            hooks.subscribe(lambda ev: first.set(), "first_token")
            ended = []
            rec = c.router.submit(ClientRequest(request_id="long", tokens=list(range(200)), max_tokens=5000,
                                                session_id="s"), ended.append)
            with anyio.fail_after(20):
                await first.wait()
            assert c.router.affinity.active_leases("s") == 1
            assert c.router.cancel("long")
            assert ended == [rec] and rec.failure == "cancelled"
            assert len(c.router.core.load) == 0 and c.router.affinity.active_leases("s") == 0
            worker = c.workers[rec.worker_id]
            core = worker.worker.core(rec.dp_rank)
            with anyio.fail_after(20):  # the Abort reaches the engine
                while core.num_unfinished:
                    await anyio.sleep(0.001)
            await anyio.sleep(0.05)  # a pass in flight ends; nothing more is produced for it
            core.check_invariants()
            return core.num_running, core.pool.free + len(core.pool.cached) == core.pool.num_blocks, rec.output_tokens

    return run_virtual(main, clock) if mode == "virtual" else run_live(main)


def test_a_cancelled_request_is_dropped_by_the_engine_in_both_modes():
    for mode in ("virtual", "live"):
        running, all_free, out = cancel_mid_stream(mode)
        assert running == 0 and all_free, mode
        assert 1 <= out < 5000, mode
