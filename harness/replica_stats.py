"""What a run with router replicas keeps of each replica for its report (``RunData.replicas``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from harness.cluster import Cluster

__all__ = ["replica_stats"]


def replica_stats(c: Cluster) -> dict[str, Any] | None:
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
        row: dict[str, Any] = {
            "replica": i,
            "restarts": c.restarts[i],
            "kv_events": {k: int(kv[k]) for k in ("batches", "gaps", "replays", "replayed_batches", "lost_batches")},
            "kv_feed_dropped_batches": c.feeds[i].dropped if i < len(c.feeds) else 0,
            "workers_registered": len(router.workers),
        }
        if router.affinity is not None:
            row["affinity"] = dict(sorted(router.affinity.stats.as_dict().items()))
        if c.sync is not None:
            inbox, outbox = c.sync.inboxes[i], c.sync.outboxes[i]
            row["sync"] = {"announced": outbox.sent, "applied": inbox.applied, "ignored": inbox.ignored,
                           "refused": inbox.refused, "expired": inbox.expired}
        per.append(row)
    front = c.front
    return {
        "count": len(c.replicas),
        "front": rspec.replica_front,
        "sync": {"enabled": c.sync is not None, "delay_ms": rspec.replica_sync.delay_ms},
        "replica_of": dict(getattr(front, "replica_of", None) or {}),
        "per_replica": per,
    }
