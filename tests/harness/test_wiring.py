"""The in-process cluster connects its parts through one seam (``harness.run.wiring``), chosen once from the mode."""

from __future__ import annotations

from kvemu import ManualClock
from kvemu.hooks import Hooks
from kvemu.messages import ClientRequest
from kvemu.runtime.loop import run_virtual

from harness.run.cluster import cluster
from harness.scenario import parse_scenario
from harness.run.wiring import MemoryWiring, ZmqWiring, wiring_for

SCENARIO = """
name: wiring
cluster: {workers: 2, dp_size: 2}
workload: {kind: synthetic, rate_rps: 1.0, turns: 1}
run: {mode: %s, seed: 1, duration_s: 1}
"""


class Recording(MemoryWiring):
    """The memory wiring, noting what the cluster asked of it."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.asked: list[tuple] = []

    def router_ends(self, pool, count):
        self.asked.append(("router_ends", pool, count))
        return super().router_ends(pool, count)

    def worker_ends(self, pool, worker_id, routers):
        self.asked.append(("worker_ends", pool, worker_id, len(routers)))
        return super().worker_ends(pool, worker_id, routers)

    def publishers(self, pool, worker_id, dp_size):
        self.asked.append(("publishers", pool, worker_id, dp_size))
        return super().publishers(pool, worker_id, dp_size)

    def close(self):
        self.asked.append(("close",))


def test_each_mode_has_its_wiring() -> None:
    assert isinstance(wiring_for(parse_scenario(SCENARIO % "virtual")), MemoryWiring)
    assert isinstance(wiring_for(parse_scenario(SCENARIO % "live")), ZmqWiring)


def test_the_wiring_says_whether_routers_guard_their_workers_and_reap_bindings() -> None:
    """The mode is asked once, by the wiring: the cluster composes its routers as the wiring says."""
    scenario = parse_scenario(SCENARIO % "virtual" + "router: {affinity: {enabled: true}}\n")
    assert (MemoryWiring.guarded, MemoryWiring.affinity_reaper) == (False, False)
    assert (ZmqWiring.guarded, ZmqWiring.affinity_reaper) == (True, True)
    clock = ManualClock()

    class Live(Recording):
        guarded = affinity_reaper = True  # (a live wiring's facts, on memory ends)

    async def main(wiring):
        async with cluster(scenario, clock, Hooks(), wiring=wiring) as c:
            affinity = c.router.affinity
            assert affinity is not None
            return c.router.guarded, affinity.reaper_interval_ns

    assert run_virtual(lambda: main(Recording(scenario)), clock) == (False, None)
    assert run_virtual(lambda: main(Live(scenario)), clock) == (True, 30 * 10**9)


def test_a_cluster_connects_every_part_through_the_wiring_it_is_given() -> None:
    scenario = parse_scenario(SCENARIO % "virtual")
    wiring = Recording(scenario)
    clock = ManualClock()

    async def main():
        async with cluster(scenario, clock, Hooks(), wiring=wiring) as c:
            record = await c.handle(ClientRequest(request_id="r1", tokens=list(range(64)), max_tokens=4))
            return record, sorted(c.workers)

    record, workers = run_virtual(main, clock)
    assert record.failure is None and len(record.token_times_ns) == 4 and record.worker_id in workers
    assert wiring.asked == [("router_ends", "aggregated", 1),
                            ("worker_ends", "aggregated", 0, 1), ("publishers", "aggregated", 0, 2),
                            ("worker_ends", "aggregated", 1, 1), ("publishers", "aggregated", 1, 2),
                            ("close",)]
