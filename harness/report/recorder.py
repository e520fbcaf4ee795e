"""Keeps each request's record (the router's own ``kvemu.RequestRecord``, carried by its hooks) and counters.

The report writer reads only what this recorder collected, so reports, traces and external hosts all
consume kvemu through the same hook API.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from kvemu.hooks import Duplicate, HookEvent, Hooks
from kvemu.records import RequestRecord

__all__ = ["Recorder"]


class Recorder:
    """A hook observer keeping ``RequestRecord``s, counters by kind, failures by reason and worker events."""

    def __init__(self, hooks: Hooks) -> None:
        self.records: dict[str, RequestRecord] = {}
        """Each request's record by id, from its arrival (complete once it ended); a reused id keeps the first."""
        self.counters: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.worker_events: list[dict[str, Any]] = []
        self.kv_events: list[dict[str, Any]] = []
        hooks.subscribe(self._on_event)

    def _on_event(self, ev: HookEvent) -> None:
        kind = ev.kind
        self.counters[kind] += 1
        rid = ev.request_id
        if rid is None:
            if kind.startswith("worker_"):
                self.worker_events.append({"kind": kind, "time_ns": ev.time_ns, "worker_id": ev.worker_id,
                                           **_fields(ev)})
            elif kind.startswith("kv_"):
                self.kv_events.append({"kind": kind, "time_ns": ev.time_ns, "worker_id": ev.worker_id,
                                       "dp_rank": ev.dp_rank, **_fields(ev)})
            return
        if kind == "request_arrived":
            if rid not in self.records and ev.record is not None:
                self.records[rid] = ev.record
        elif kind == "failed":
            if isinstance(ev.details, Duplicate):  # a copy refused under the id of an open request
                self.failures["duplicate_request_id"] += 1
            elif ev.record is not None and self.records.get(rid) is ev.record:
                self.failures[(ev.record.failure or "unknown").split(":")[0]] += 1


def _fields(ev: HookEvent) -> dict[str, Any]:
    """An event's details as a report row's fields (KV ranges as ``from``/``to``), then its pool if any."""
    fields: dict[str, Any] = msgspec.to_builtins(ev.details) or {}
    if ev.pool is not None:
        fields["pool"] = ev.pool
    return fields
