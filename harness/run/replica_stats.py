"""What a run with router replicas keeps of each replica for its report (``RunData.replicas``, a
``harness.report.run_data.ReplicaRun``), of an in-process cluster (``harness.procs.replica_clients``: of router
processes)."""

from __future__ import annotations

from collections import Counter

from harness.run.cluster import Cluster
from harness.report.run_data import REPLICA_KV_COUNTERS, ReplicaCounters, ReplicaRun, ReplicaSync

__all__ = ["replica_stats"]


def replica_stats(c: Cluster) -> ReplicaRun | None:
    """Each replica's own counters (its KV feed as it saw it, sync, restarts) and where every request went; None
    with one router."""
    if len(c.replicas) < 2:
        return None
    rspec = c.scenario.router
    per = []
    for i, router in enumerate(c.replicas):
        kv: Counter[str] = Counter()
        for stats in router.kv_stats.values():
            kv.update(stats.as_dict())
        sync = None
        if c.sync is not None:
            inbox, outbox = c.sync.inboxes[i], c.sync.outboxes[i]
            sync = {"announced": outbox.sent, "applied": inbox.applied, "ignored": inbox.ignored,
                    "refused": inbox.refused, "expired": inbox.expired}
        per.append(ReplicaCounters(
            replica=i, restarts=c.restarts[i], kv_events={k: int(kv[k]) for k in REPLICA_KV_COUNTERS},
            kv_feed_dropped_batches=c.feeds[i].dropped if i < len(c.feeds) else 0,
            workers_registered=len(router.workers),
            affinity=dict(sorted(router.affinity.stats.as_dict().items())) if router.affinity is not None else None,
            sync=sync))
    return ReplicaRun(count=len(c.replicas), front=rspec.replica_front,
                      sync=ReplicaSync(enabled=c.sync is not None, delay_ms=rspec.replica_sync.delay_ms),
                      replica_of=dict(getattr(c.front, "replica_of", None) or {}), per_replica=per)
