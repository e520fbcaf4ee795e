"""The load generator in front of router replicas (``router.replicas`` as processes): one client per replica's
process, seen as one client (``ReplicaClients``), and what the report keeps of each replica (``replica_report``).

Each request goes to the replica ``ReplicaFront`` picks (the same rule and seed as in one process) and its cancel
to the same one; the records come back from whichever replica ran it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import anyio

from kvemu.messages import ClientRequest
from kvemu.records import RequestRecord
from kvemu.replica_front import ReplicaFront

from harness.run.cluster import REQUEST_KINDS
from harness.procs.protocol import Stats
from harness.report.run_data import REPLICA_KV_COUNTERS, ReplicaCounters, ReplicaRun, ReplicaSync
from harness.scenario import Scenario

__all__ = ["ReplicaClients", "replica_report", "merged_counters", "merged_affinity"]


class _Client(Protocol):
    records: dict[str, RequestRecord]
    lost: str | None
    router_now: Callable[[], int]

    async def listen(self) -> None: ...

    async def submit(self, req: ClientRequest) -> RequestRecord | None: ...

    async def cancel(self, request_id: str, reason: str) -> None: ...

    @property
    def awaiting(self) -> int: ...

    def open_records(self) -> list[RequestRecord]: ...

    def lose(self, reason: str = "router_lost") -> None: ...


class ReplicaClients:
    """Clients of every router replica (index = replica) behind one ``ReplicaFront``."""

    def __init__(self, clients: list[Any], front: ReplicaFront) -> None:
        self.clients: list[_Client] = clients
        self.front = front
        self.replica_of: dict[str, int] = {}
        """Each request id sent: the replica it went to."""

    async def listen(self) -> None:
        async with anyio.create_task_group() as tg:
            for c in self.clients:
                tg.start_soon(c.listen)

    async def submit(self, req: ClientRequest) -> RequestRecord | None:
        """Send ``req`` to its replica and await its record."""
        i = self.front.pick_request(req)
        self.replica_of[req.request_id] = i
        return await self.clients[i].submit(req)

    async def cancel(self, request_id: str, reason: str) -> None:
        """Cancel a request at the replica it went to."""
        i = self.replica_of.get(request_id)
        if i is not None:
            await self.clients[i].cancel(request_id, reason)

    @property
    def awaiting(self) -> int:
        return sum(c.awaiting for c in self.clients)

    @property
    def records(self) -> dict[str, RequestRecord]:
        return {rid: rec for c in self.clients for rid, rec in c.records.items()}

    def open_records(self) -> list[RequestRecord]:
        return [rec for c in self.clients for rec in c.open_records()]

    @property
    def lost(self) -> str | None:
        """Why a replica is considered gone (the run then stops), or None."""
        return next((c.lost for c in self.clients if c.lost is not None), None)

    def lose(self, reason: str = "router_lost") -> None:
        for c in self.clients:
            c.lose(reason)

    @property
    def router_now(self) -> Callable[[], int]:
        return self.clients[0].router_now

    @router_now.setter
    def router_now(self, now: Callable[[], int]) -> None:
        for c in self.clients:
            c.router_now = now


def merged_counters(counters: list[dict[str, int]]) -> dict[str, int]:
    """The run's counters from each replica's: the first replica's whole, the others' request steps and restarts
    only (each replica sees every worker come and go; a request runs on one), as one process's cluster counts
    them."""
    out = dict(counters[0])
    for more in counters[1:]:
        for k in (*REQUEST_KINDS, "router_restarts"):
            if more.get(k):
                out[k] = out.get(k, 0) + more[k]
    return out


def merged_affinity(views: list[dict[str, int] | None]) -> dict[str, int] | None:
    """The replicas' session-affinity counters summed (each binds its own sessions); None: affinity is off."""
    if all(v is None for v in views):
        return None
    out: dict[str, int] = {}
    for v in views:
        for k, n in (v or {}).items():
            out[k] = out.get(k, 0) + n
    return dict(sorted(out.items()))


def replica_report(scenario: Scenario, views: list[Stats], restarts: list[int],
                   kv_stats: list[dict[int, dict[str, int]]], replica_of: dict[str, int]) -> ReplicaRun:
    """``RunData.replicas`` of a run on router processes: where each request went and each replica's own counters
    from its last view (its KV events over every instance, workers registered, affinity, sync)."""
    rspec = scenario.router
    per = []
    for i, view in enumerate(views):
        kv = dict.fromkeys(REPLICA_KV_COUNTERS, 0)
        for counts in kv_stats[i].values():
            for k in REPLICA_KV_COUNTERS:
                kv[k] += counts.get(k, 0)
        per.append(ReplicaCounters(
            replica=i, restarts=restarts[i], kv_events=kv, kv_feed_dropped_batches=view.feed_dropped,
            workers_registered=len(view.workers),
            affinity=dict(sorted(view.affinity.items())) if view.affinity is not None else None,
            sync=dict(view.sync) if view.sync is not None else None))
    return ReplicaRun(count=len(views), front=rspec.replica_front,
                      sync=ReplicaSync(enabled=rspec.replica_sync.enabled, delay_ms=rspec.replica_sync.delay_ms),
                      replica_of=replica_of, per_replica=per)
