"""One chaos dispatch: every action maps onto one host capability, and each host answers as it did."""

from typing import get_args

import anyio
import msgspec
import pytest

from kvemu.messages import WORKER_CHAOS, Chaos

from harness.chaos import _APPLY, ChaosHost, Control, Outcome, RouterlessHost, apply_chaos
from harness.run.pools import AGGREGATED
from harness.procs.fleet import Fleet, _FleetChaos
from harness.procs.router import _RouterControl
from harness.scenario import CHAOS_TARGETS, ChaosAction, ChaosEvent, parse_scenario


class Recording(ChaosHost):
    """Says which capability an event reached, with what."""

    async def add_worker(self) -> Outcome:
        return Outcome(True, "add_worker()")

    async def remove_worker(self, worker: int | None, graceful: bool) -> Outcome:
        return Outcome(True, f"remove_worker({worker}, {graceful})")

    async def restart_router(self, replica: int) -> Outcome:
        return Outcome(True, f"restart_router({replica})")

    async def delay_kv_events(self, replica: int | None, lag_ms: float) -> Outcome:
        return Outcome(True, f"delay_kv_events({replica}, {lag_ms:g})")

    async def drop_kv_events(self, replica: int, count: int) -> Outcome:
        return Outcome(True, f"drop_kv_events({replica}, {count})")

    async def to_worker(self, worker: int | None, msg: Chaos) -> Outcome:
        return Outcome(True, f"to_worker({worker}, {msg.action}, rank {msg.dp_rank}, count {msg.count}, "
                             f"factor {msg.factor:g})")


def event(**fields) -> ChaosEvent:
    return msgspec.convert({"at_s": 1, **fields}, ChaosEvent)


def test_every_action_has_one_row_for_its_targets_and_one_for_its_host_capability():
    actions = set(get_args(ChaosAction))
    assert set(CHAOS_TARGETS) == actions
    assert set(_APPLY) == actions
    assert set(WORKER_CHAOS) <= actions  # a worker's own faults are chaos actions too


@pytest.mark.parametrize(("fields", "reached"), [
    ({"action": "add_worker"}, "add_worker()"),
    ({"action": "remove_worker", "worker": 2, "graceful": False}, "remove_worker(2, False)"),
    ({"action": "remove_worker"}, "remove_worker(None, True)"),
    ({"action": "restart_router"}, "restart_router(0)"),
    ({"action": "restart_router", "replica": 1}, "restart_router(1)"),
    ({"action": "delay_kv_events", "lag_ms": 250}, "delay_kv_events(None, 250)"),
    ({"action": "delay_kv_events", "replica": 1, "lag_ms": 5}, "delay_kv_events(1, 5)"),
    ({"action": "drop_kv_events", "replica": 1, "count": 3}, "drop_kv_events(1, 3)"),
    ({"action": "drop_kv_events", "worker": 1, "dp_rank": 1, "count": 3},
     "to_worker(1, drop_kv_events, rank 1, count 3, factor 1)"),
    ({"action": "kill_rank", "worker": 0, "dp_rank": 1}, "to_worker(0, kill_rank, rank 1, count 1, factor 1)"),
    ({"action": "slow_worker", "worker": 3, "factor": 2.5}, "to_worker(3, slow_worker, rank 0, count 1, factor 2.5)"),
])
def test_an_event_reaches_the_host_capability_that_applies_it(fields, reached):
    assert anyio.run(apply_chaos, Recording(), event(**fields)) == Outcome(True, reached)


def test_a_host_with_no_router_refuses_the_routers_faults_from_one_place():
    class Workers(RouterlessHost):  # it implements the workers' capabilities alone
        who = "these workers"
        add_worker = Recording.add_worker
        remove_worker = Recording.remove_worker
        to_worker = Recording.to_worker

        async def delay_workers(self, lag_ms: float) -> Outcome:
            return Outcome(True, f"delay_workers({lag_ms:g})")

    host = Workers()
    assert anyio.run(apply_chaos, host, event(action="restart_router")) == Outcome(
        False, "these workers has no router to restart")
    assert anyio.run(apply_chaos, host, event(action="drop_kv_events", replica=1)) == Outcome(
        False, "these workers has no router replica 1: its KV feed is the router's")
    # with no replica, a KV-event delay is every worker's
    assert anyio.run(apply_chaos, host, event(action="delay_kv_events", lag_ms=9)) == Outcome(True, "delay_workers(9)")


def test_a_fleet_delays_every_workers_kv_events_and_every_later_ones(tmp_path):
    """``kvemu fleet``'s ``delay_kv_events`` names no worker: it reaches all of them (it reached the first alone)."""
    scenario = parse_scenario("name: fleet-delay\ncluster: {workers: 3, dp_size: 2, engine: {block_size: 16}}\n"
                              "workload: {kind: synthetic, rate_rps: 1, turns: 1}\nrun: {mode: live, seed: 1}\n")
    fleet = Fleet(scenario)

    def lags() -> dict[int, list[int]]:
        return {wid: [p.lag_ns for p in m.pubs] for wid, m in sorted(fleet._members.items())}

    async def main() -> tuple[Outcome, dict[int, list[int]], dict[int, list[int]]]:
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(60):
                await tg.start(fleet.run)
                outcome = await apply_chaos(_FleetChaos(fleet), event(action="delay_kv_events", lag_ms=40))
                now = lags()
                await fleet.add_worker(AGGREGATED)
            tg.cancel_scope.cancel()
        return outcome, now, lags()

    outcome, now, later = anyio.run(main)
    assert outcome == Outcome(True, "KV events 40 ms late on 3 workers and every later one")
    assert now == {0: [40_000_000] * 2, 1: [40_000_000] * 2, 2: [40_000_000] * 2}
    assert later[3] == [40_000_000] * 2  # started after the delay: late too


@pytest.mark.parametrize(("fields", "detail"), [
    ({"action": "add_worker"}, "add_worker starts or stops a worker process: kvemu up applies it (with "
                               "docker-compose, scale the worker service)"),
    ({"action": "remove_worker", "worker": 0}, "remove_worker starts or stops a worker process: kvemu up applies "
                                               "it (with docker-compose, scale the worker service)"),
    ({"action": "drop_kv_events", "replica": 1}, "drop_kv_events on replica 1: this router is no replica "
                                                  "(router.replicas is 1)"),
    ({"action": "delay_kv_events", "replica": 0, "lag_ms": 5}, "delay_kv_events on replica 0: this router is no "
                                                               "replica (router.replicas is 1)"),
    ({"action": "restart_router"}, "restart_router: restarting the routers of a disaggregated cluster is not "
                                   "supported yet"),
    ({"action": "kill_rank", "worker": 4}, "worker 4 is not registered (registered: [])"),
    ({"action": "drop_kv_events"}, "drop_kv_events: no worker is registered"),
])
def test_a_router_process_refuses_what_it_cannot_apply_and_says_why(fields, detail):
    control = _RouterControl("secret")  # no routers of the aggregated pool, no worker, no replica feed
    reply = anyio.run(control.apply, {}, Control(token="secret", event=event(**fields)))
    assert (reply.ok, reply.detail) == (False, detail)


def test_a_router_process_delays_every_workers_kv_events_and_remembers_the_lag():
    control = _RouterControl("secret")
    reply = anyio.run(control.apply, {}, Control(token="secret", event=event(action="delay_kv_events", lag_ms=40)))
    assert (reply.ok, reply.detail) == (True, "KV events 40 ms late on 0 workers and every later one")
    assert control.lag_ms == 40
