"""Routers and engines built from a scenario: the policy, an engine's configuration, a pool's router (its seed
per replica, its block size and settings), the replicas' front picker, and ``check_buildable`` (what
``kvemu validate`` builds without starting). The in-process cluster, the router process and the load
generators build with these."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec
import xxhash

from kvemu.affinity import SessionAffinity
from kvemu.clock import Clock, ManualClock
from kvemu.policy import CustomPolicy, random_policy, round_robin_policy
from kvemu.routing_core import RoutingCore
from kvemu.hooks import Hooks
from kvemu.messages import EngineSettings
from kvemu.replica_front import ReplicaFront
from kvemu.runtime.transport import MemoryNetwork, RouterEnd
from kvemu.wire.stream import Replay
from kvemu.runtime.router import Router
from workers.config import EngineConfig
from workers.mock_worker import MockWorker

from harness.plugins import import_callable
from harness.run.pools import AGGREGATED
from harness.scenario import ClusterSpec, RouterSpec, Scenario, ScenarioError

log = logging.getLogger(__name__)

__all__ = ["make_policy", "engine_config", "POOL_CONFIG", "build_router", "replica_seed", "replica_front", "pool_router",
           "pool_ranks", "check_buildable"]


def make_policy(name: str) -> CustomPolicy | None:
    """The router's selection policy from its scenario name (``None`` = Dynamo's default selector).

    A ``module:callable`` that cannot be imported or does not return a ``CustomPolicy`` is a
    ``ScenarioError`` naming ``router.policy`` (``kvemu validate`` calls this too).
    """
    if name == "kv":
        return None
    if name == "round_robin":
        return round_robin_policy()
    if name == "random":
        return random_policy()
    policy = import_callable(name, "router.policy")()
    if not isinstance(policy, CustomPolicy):
        raise ScenarioError(f"router.policy: {name!r} returned {type(policy).__name__}, not a CustomPolicy")
    return policy


def engine_config(spec: ClusterSpec, pool: str = "aggregated") -> EngineConfig:
    """The engine configuration of every rank (of one pool of a disaggregated cluster)."""
    _, dp_size, engine = spec.pools()[pool]
    return engine.config(dp_size)


POOL_CONFIG: dict[str, dict[str, Any]] = {
    "prefill": {"router_track_active_blocks": False},
    "decode": {"overlap_score_credit": 0.0, "router_assume_kv_reuse": False, "router_track_prefill_tokens": False},
}
"""What a disaggregated cluster's pool routers change in ``router`` (as the reference's replay does): the
prefill pool weighs prompt tokens only; the decode pool weighs its active blocks only, without prefix credit
(its KV comes by transfer)."""


def build_router(spec: RouterSpec, *, block_size: int, clock: Clock, seed: int, end: RouterEnd, hooks: Hooks,
                 kv_replay: Callable[[int, int], Replay | None] | None = None, zmq_kv_events: bool = False,
                 on_worker_removed: Callable[[int], None] | None = None, pool: str | None = None,
                 engine: EngineSettings | None = None, guarded: bool = True, reaper: bool = True,
                 watchdog: bool = True) -> Router:
    """A router actor configured from its scenario section (one pool's, for a disaggregated cluster).
    ``guarded``, ``reaper``, ``watchdog``: as the composer's wiring says (``Router``'s live bounds and heartbeat
    watch, the affinity table's reaper; default: a router among processes, on wall time)."""
    config = spec.config()
    if pool is not None:
        config = msgspec.structs.replace(config, **POOL_CONFIG[pool])
    core = RoutingCore(block_size=block_size, config=config, clock=clock,
                       seed=spec.seed if spec.seed is not None else seed, policy=make_policy(spec.policy))
    affinity = None
    if spec.affinity.enabled:
        affinity = SessionAffinity(clock, ttl_secs=spec.affinity.ttl_secs, mode=spec.affinity.mode, reaper=reaper)
    return Router(core=core, end=end, clock=clock, hooks=hooks, settings=spec.settings(), affinity=affinity,
                  queue=core.policy_queue(),
                  kv_replay=kv_replay, zmq_kv_events=zmq_kv_events, on_worker_removed=on_worker_removed, pool=pool,
                  engine=engine, guarded=guarded, watchdog=watchdog)


def replica_seed(seed: int, replica: int) -> int:
    """The tie-breaking seed of router replica ``replica``: the first keeps ``seed``; the others get their own, as
    separate router processes' generators are (the same seed everywhere would make them all break ties alike)."""
    return seed if replica == 0 else xxhash.xxh3_64_intdigest(f"kvemu-replica:{seed}:{replica}".encode()) >> 1


def replica_front(scenario: Scenario) -> ReplicaFront:
    """The picker before the scenario's router replicas (``router.replica_front``, its prefix length, the run's
    seed): the same in one process, in the load generator and in ``kvemu front``."""
    rspec = scenario.router
    return ReplicaFront(rspec.replicas, rspec.replica_front, scenario.run.seed, rspec.replica_prefix_tokens)


def pool_router(scenario: Scenario, pool: str, *, clock: Clock, end: RouterEnd, hooks: Hooks, replica: int = 0,
                kv_replay: Callable[[int, int], Replay | None] | None = None, zmq_kv_events: bool = False,
                on_worker_removed: Callable[[int], None] | None = None, guarded: bool = True,
                reaper: bool = True, watchdog: bool = True) -> Router:
    """The router of one pool of the scenario's cluster (``aggregated``, ``prefill`` or ``decode``): its engine's
    block size and its pool's settings; a disaggregated cluster's pool routers get hooks of their own (their
    ``DisaggRouter`` passes their events on to ``hooks``). ``replica``: which router replica (its seed).
    ``kv_replay``, ``zmq_kv_events``, ``on_worker_removed``: how it gets KV events; ``guarded``, ``reaper``,
    ``watchdog``: what its wiring says (``build_router``)."""
    spec, rspec = scenario.cluster, scenario.router
    seed = replica_seed(rspec.seed if rspec.seed is not None else scenario.run.seed, replica)
    router = build_router(msgspec.structs.replace(rspec, seed=seed), block_size=spec.pools()[pool][2].block_size,
                          clock=clock, seed=seed, end=end, hooks=Hooks() if spec.disaggregated else hooks,
                          pool=None if pool == AGGREGATED else pool,
                          engine=engine_config(spec, pool).settings(),  # a worker of other settings is refused
                          kv_replay=kv_replay, zmq_kv_events=zmq_kv_events, on_worker_removed=on_worker_removed,
                          guarded=guarded, reaper=reaper, watchdog=watchdog)
    fit, need = router.kv.streams_left(), pool_ranks(scenario, pool)
    if fit is not None and fit < need:  # only a cluster that does not fit hears of the open-file limit
        log.warning("the open-file limit allows KV streams for %d ranks, but this cluster's %s pool can reach %d: "
                    "registrations beyond are refused (raise the hard limit, ulimit -Hn, to take more)", fit, pool,
                    need)
    return router


def pool_ranks(scenario: Scenario, pool: str) -> int:
    """Most DP ranks ``pool`` can hold during the run: its workers, or its autoscaler's ``max_workers``, plus the
    workers the chaos timeline adds (to the last pool)."""
    pools = scenario.cluster.pools()
    workers, dp, _ = pools[pool]
    autoscaler = scenario.autoscaler
    if autoscaler is not None and autoscaler.managed_pool(scenario.cluster) == pool:
        workers = max(workers, autoscaler.max_workers)
    if pool == list(pools)[-1]:
        workers += sum(ev.action == "add_worker" for ev in scenario.chaos)
    return workers * dp


def check_buildable(scenario: Scenario) -> None:
    """Build the scenario's router (routing core, policy, affinity, queue) and one worker's engines without
    starting anything: ``kvemu validate`` rejects what ``run`` would fail to build, with the same errors."""
    spec = scenario.cluster
    for pool in spec.pools():
        pool_router(scenario, pool, clock=ManualClock(), end=MemoryNetwork().router_end(), hooks=Hooks())
        MockWorker(engine_config(spec, pool), worker_id=0)
