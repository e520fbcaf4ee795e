"""How an in-process cluster's routers and workers are connected, chosen once where the cluster is composed:
in memory on virtual time (``MemoryWiring``: a network per router, a KV bus per pool) or over ZeroMQ sockets on
127.0.0.1 on wall time (``ZmqWiring``: the workers' KV events in vLLM's wire format). ``wiring_for`` is the one
place that asks which; the cluster only calls what the chosen wiring offers.

The wiring also decides whether workers heartbeat and routers watch for them (``heartbeat_interval_s``): always
on wall time; on virtual time only where something can observe a worker's silence (``liveness_observable``), as
a heartbeat that nothing can miss only costs ticks. Likewise each rank's KV replay buffer keeps vLLM's 10,000 batches
on wall time, and on virtual time only where a router can ask for a replay (``replay_observable``); elsewhere it
keeps one, as a buffer nobody reads only holds memory (half the one-hour trace's peak)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from kvemu.clock import NS_PER_MS
from kvemu.runtime.kv_bus import MemoryKvBus
from kvemu.runtime.router import Router, RouterSettings
from kvemu.runtime.transport import MemoryNetwork, RouterEnd, WorkerEnd, ZmqRouterEnd, ZmqWorkerEnd
from kvemu.wire.publisher import KvEventPublisher
from workers.actor.actor import KvPublisher, WorkerActor

from harness.chaos import REPLAYING, SILENCING
from harness.scenario import ClusterSpec, Scenario

__all__ = ["MemoryWiring", "Wiring", "ZmqWiring", "liveness_observable", "replay_observable", "wiring_for"]


class Wiring(Protocol):
    """What a cluster needs to connect its parts: ends for a pool's routers, a worker's end to each of them, its
    KV publishers, and what its workers' driver and the routers do about the wiring."""

    mode: Literal["virtual", "live"]
    """The workers' driver (``WorkerActor(mode=...)``)."""
    guarded: bool
    """Whether routers hold their workers to the live bounds (``Router(guarded=...)``): not the host's own
    engines on its own time."""
    affinity_reaper: bool
    """Whether affinity tables expire bindings on a timer (``SessionAffinity(reaper=...)``): time passes by itself."""
    heartbeat_interval_s: float | None
    """How often an otherwise silent worker says it is alive (``WorkerActor(heartbeat_interval_s=...)``), and
    whether routers watch for it (``Router(watchdog=...)``); None: workers never beat and no router watches."""

    def router_ends(self, pool: str, count: int) -> list[RouterEnd]:
        """``count`` router ends for ``pool`` (one per replica)."""
        ...

    def bus(self, pool: str) -> MemoryKvBus | None:
        """The pool's in-memory KV bus (None: KV events go over ZeroMQ)."""
        ...

    def worker_ends(self, pool: str, worker_id: int, routers: Sequence[Router]) -> list[WorkerEnd]:
        """The worker's end to each of ``routers`` (its pool's, or every replica)."""
        ...

    def publishers(self, pool: str, worker_id: int, dp_size: int) -> list[KvPublisher]:
        """One KV publisher per rank of the worker."""
        ...

    def endpoints(self, worker_id: int) -> tuple[list[str], list[str]]:
        """The worker's KV-event and replay endpoints, per rank (empty where no socket carries them)."""
        ...

    def before_select(self, router: Router, sync: Callable[[], None]) -> None:
        """Prepare a router to serve (in memory: bring the workers' deferred KV events in before deciding)."""
        ...

    def defers_kv_events(self, actor: WorkerActor) -> bool:
        """The worker's engines hold KV events back until synced (``Cluster.sync_workers``)."""
        ...

    def worker_gone(self, pool: str, worker_id: int, *, replicas: int) -> None:
        """A worker was removed from a cluster of ``replicas`` router replicas: drop what carried its KV events."""
        ...

    def close(self) -> None:
        """Close what the wiring opened."""
        ...


class MemoryWiring:
    """Virtual time: in-memory networks (``router.network_latency_ms`` each way) and one KV bus per pool."""

    mode: Literal["virtual", "live"] = "virtual"
    guarded = False
    affinity_reaper = False

    def __init__(self, scenario: Scenario) -> None:
        watched = self.guarded or liveness_observable(scenario)  # (a guarded router admits at a worker's next word)
        self.heartbeat_interval_s: float | None = scenario.cluster.heartbeat_interval_s if watched else None
        self.kv_buffer_steps = KV_BUFFER_STEPS if replay_observable(scenario) else 1
        """Batches each rank's in-memory KV publisher keeps for replay."""
        self._latency_ns = round(scenario.router.network_latency_ms * NS_PER_MS)
        self._spec = scenario.cluster
        self.nets: dict[str, list[MemoryNetwork]] = {}
        self.buses: dict[str, MemoryKvBus] = {}

    def router_ends(self, pool: str, count: int) -> list[RouterEnd]:
        nets = self.nets[pool] = [MemoryNetwork(latency_ns=self._latency_ns, wire_check=self._spec.kv_wire_check)
                                  for _ in range(count)]
        self.buses[pool] = MemoryKvBus(vllm_version=self._spec.kv_events_version, wire_check=self._spec.kv_wire_check,
                                       hash_form=self._spec.kv_events_hash_form, buffer_steps=self.kv_buffer_steps,
                                       block_hashes=self._spec.kv_events_block_hashes)
        return [net.router_end() for net in nets]

    def bus(self, pool: str) -> MemoryKvBus | None:
        return self.buses.get(pool)

    def worker_ends(self, pool: str, worker_id: int, routers: Sequence[Router]) -> list[WorkerEnd]:
        return [net.worker_end(worker_id) for net in self.nets[pool]]

    def publishers(self, pool: str, worker_id: int, dp_size: int) -> list[KvPublisher]:
        return [self.buses[pool].publisher(worker_id, r) for r in range(dp_size)]

    def endpoints(self, worker_id: int) -> tuple[list[str], list[str]]:
        return [], []

    def before_select(self, router: Router, sync: Callable[[], None]) -> None:
        router.sync_before_select(sync)

    def defers_kv_events(self, actor: WorkerActor) -> bool:
        return actor.defer_kv_events()

    def worker_gone(self, pool: str, worker_id: int, *, replicas: int) -> None:
        bus = self.buses.get(pool)
        if bus is not None and replicas > 1:  # (one replica forgets it as it drops it; the others still replay)
            bus.forget(worker_id)

    def close(self) -> None:
        pass


class ZmqWiring:
    """Wall time: each router on a ZeroMQ socket, each rank's KV events on its own publisher socket (127.0.0.1)."""

    mode: Literal["virtual", "live"] = "live"
    guarded = True
    affinity_reaper = True

    def __init__(self, scenario: Scenario) -> None:
        self.heartbeat_interval_s: float | None = scenario.cluster.heartbeat_interval_s  # live peers: always
        self._spec = scenario.cluster
        self._publishers: dict[int, list[KvEventPublisher]] = {}

    def router_ends(self, pool: str, count: int) -> list[RouterEnd]:
        return [ZmqRouterEnd("tcp://127.0.0.1:0") for _ in range(count)]

    def bus(self, pool: str) -> MemoryKvBus | None:
        return None

    def worker_ends(self, pool: str, worker_id: int, routers: Sequence[Router]) -> list[WorkerEnd]:
        ends: list[WorkerEnd] = []
        for router in routers:
            assert isinstance(router.end, ZmqRouterEnd)
            ends.append(ZmqWorkerEnd(router.end.endpoint, worker_id))
        return ends

    def publishers(self, pool: str, worker_id: int, dp_size: int) -> list[KvPublisher]:
        pubs = self._publishers[worker_id] = [
            KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", dp_rank=r, bind=True,
                             vllm_version=self._spec.kv_events_version, hash_form=self._spec.kv_events_hash_form,
                             block_hashes=self._spec.kv_events_block_hashes)
            for r in range(dp_size)]
        return list(pubs)

    def endpoints(self, worker_id: int) -> tuple[list[str], list[str]]:
        pubs = self._publishers[worker_id]
        return [p.endpoint for p in pubs], [p.replay_endpoint or "" for p in pubs]

    def before_select(self, router: Router, sync: Callable[[], None]) -> None:
        pass

    def defers_kv_events(self, actor: WorkerActor) -> bool:
        return False

    def worker_gone(self, pool: str, worker_id: int, *, replicas: int) -> None:
        for pub in self._publishers.pop(worker_id, []):
            pub.close(drain_timeout_s=0)

    def close(self) -> None:
        for wid in list(self._publishers):
            for pub in self._publishers.pop(wid):
                pub.close(drain_timeout_s=0)


def liveness_observable(scenario: Scenario) -> bool:
    """Whether a virtual run of ``scenario`` can observe its workers' heartbeats. In memory every worker is the
    host's own actor on the host's clock, so a heartbeat or the router's watchdog can matter only when the run makes
    a worker silent or has a router that must hear from idle workers: a chaos event that does
    (``harness.chaos.SILENCING``), an autoscaler that kills the workers it removes, or heartbeat knobs set away from
    their defaults (a scenario about liveness, or one whose timeout fences idle workers). Anywhere else, workers
    that beat and a watchdog that watches change nothing the run reports."""
    return (any(SILENCING[ev.action](ev) for ev in scenario.chaos)
            or (scenario.autoscaler is not None and not scenario.autoscaler.graceful)
            or scenario.cluster.heartbeat_interval_s != _DEFAULT_INTERVAL_S
            or scenario.router.heartbeat_timeout_s != _DEFAULT_TIMEOUT_S)


def replay_observable(scenario: Scenario) -> bool:
    """Whether a router of a virtual run of ``scenario`` can read a rank's KV replay buffer. In memory batches
    arrive in order and a lone router opens a rank's streams before the rank has work to publish, so only a chaos
    event that loses or reorders batches or restarts a router (``harness.chaos.REPLAYING``), or router replicas
    (one may register a worker after another sent it work), make a router ask for a replay; anywhere else a
    buffer of one batch reports the same bytes as vLLM's 10,000."""
    return scenario.router.replicas > 1 or any(REPLAYING[ev.action](ev) for ev in scenario.chaos)


KV_BUFFER_STEPS = 10_000
"""vLLM's replay buffer (``buffer_steps``): batches a rank keeps wherever a replay can be asked for."""

_DEFAULT_INTERVAL_S = ClusterSpec().heartbeat_interval_s
_DEFAULT_TIMEOUT_S = RouterSettings().heartbeat_timeout_s


def wiring_for(scenario: Scenario) -> Wiring:
    """The wiring of the scenario's ``run.mode``."""
    return MemoryWiring(scenario) if scenario.run.mode == "virtual" else ZmqWiring(scenario)
