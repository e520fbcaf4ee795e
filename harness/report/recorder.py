"""Keeps each request's record (the router's own ``kvemu.RequestRecord``, carried by its hooks) and counters.

The report writer reads only what this recorder collected, so reports, traces and external hosts all
consume kvemu through the same hook API.
"""

from __future__ import annotations

from collections import Counter
import msgspec

from kvemu.hooks import Duplicate, HookEvent, HookKind, Hooks, KvRange, KvReplay, KvRestart, Ranks, Reason
from kvemu.limits import I64, Count, Name, Rank, Text, TimeNs, WorkerId
from kvemu.records import RequestRecord

__all__ = ["Recorder", "WorkerEvent", "KvEventRow"]


class WorkerEvent(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """A worker's ``worker_added``/``worker_removed``/``worker_fenced`` hook as the report keeps it (and a router
    process sends it in its ``Stats``): when, which worker, and the hook's data."""

    kind: Name
    """``worker_added``, ``worker_fenced`` or ``worker_removed``."""
    time_ns: TimeNs
    worker_id: WorkerId | None = None
    reason: Text | None = None
    """Why it was fenced or removed (``draining``, ``rank_down``, ``missed heartbeats``, ``process_exited (...)``)."""
    dp_size: Count | None = None
    """``worker_added``: its DP ranks."""
    dp_start: Rank | None = None
    """``worker_added``: its first DP rank."""

    @classmethod
    def of(cls, ev: HookEvent) -> WorkerEvent:
        """The row of a ``worker_*`` hook event."""
        d = ev.details
        ranks = d if isinstance(d, Ranks) else None
        return cls(kind=ev.kind, time_ns=ev.time_ns, worker_id=ev.worker_id,
                   reason=d.reason if isinstance(d, Reason) else None,
                   dp_size=None if ranks is None else ranks.dp_size, dp_start=None if ranks is None else ranks.dp_start)


class KvEventRow(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A rank's KV-event stream trouble (``kv_gap``, ``kv_replay``, ``kv_lost``, ``kv_restart`` hooks): the sequence
    numbers involved (``first``..``last``: the hook data's ``from``/``to``), what a replay recovered, or the
    sequence number a restart came with and the one expected."""

    kind: Name
    time_ns: TimeNs
    worker_id: WorkerId | None = None
    dp_rank: Rank | None = None
    first: I64 | None = None
    last: I64 | None = None
    recovered: Count | None = None
    seq: I64 | None = None
    expected: I64 | None = None

    @classmethod
    def of(cls, ev: HookEvent) -> KvEventRow:
        """The row of a ``kv_*`` hook event."""
        d = ev.details
        row = cls(kind=ev.kind, time_ns=ev.time_ns, worker_id=ev.worker_id, dp_rank=ev.dp_rank)
        if isinstance(d, KvRange | KvReplay):
            row = msgspec.structs.replace(row, first=d.start, last=d.until,
                                          recovered=d.recovered if isinstance(d, KvReplay) else None)
        elif isinstance(d, KvRestart):
            row = msgspec.structs.replace(row, seq=d.seq, expected=d.expected)
        return row


RECORDED_KINDS = (HookKind.REQUEST_ARRIVED, HookKind.FAILED,
                  *(k for k in HookKind if k.startswith(("worker_", "kv_"))))
"""The kinds whose events the recorder reads (it counts every kind through the hub)."""


class Recorder:
    """A hook observer keeping ``RequestRecord``s, counters by kind, failures by reason and worker events."""

    def __init__(self, hooks: Hooks) -> None:
        self.records: dict[str, RequestRecord] = {}
        """Each request's record by id, from its arrival (complete once it ended); a reused id keeps the first."""
        self.counters: Counter[str] = hooks.counts
        """Events by kind: the hub's own counts (it counts every kind without building the events nobody reads)."""
        self.failures: Counter[str] = Counter()
        self.worker_events: list[WorkerEvent] = []
        self.kv_events: list[KvEventRow] = []
        hooks.subscribe(self._on_event, *RECORDED_KINDS)

    def _on_event(self, ev: HookEvent) -> None:
        kind = ev.kind
        rid = ev.request_id
        if rid is None:
            if kind.startswith("worker_"):
                self.worker_events.append(WorkerEvent.of(ev))
            elif kind.startswith("kv_"):
                self.kv_events.append(KvEventRow.of(ev))
            return
        if kind == "request_arrived":
            if rid not in self.records and ev.record is not None:
                self.records[rid] = ev.record
        elif kind == "failed":
            if isinstance(ev.details, Duplicate):  # a copy refused under the id of an open request
                self.failures["duplicate_request_id"] += 1
            elif ev.record is not None and self.records.get(rid) is ev.record:
                self.failures[(ev.record.failure or "unknown").split(":")[0]] += 1

