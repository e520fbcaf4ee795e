"""Builds per-request records (``kvemu.RequestRecord``) and counters from the router's lifecycle hooks only.

The report writer reads only what this recorder collected, so reports, traces and external hosts all
consume kvemu through the same hook API.
"""

from __future__ import annotations

from array import array
from collections import Counter
from typing import Any

from kvemu.records import RequestRecord
from kvemu.hooks import HookEvent, Hooks

__all__ = ["Recorder"]


class Recorder:
    """A hook observer collecting ``RequestRecord``s, counters and worker events."""

    def __init__(self, hooks: Hooks, *, block_size: int) -> None:
        self.block_size = block_size
        self.records: dict[str, RequestRecord] = {}
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
                                           **(ev.data or {})})
            elif kind.startswith("kv_"):
                self.kv_events.append({"kind": kind, "time_ns": ev.time_ns, "worker_id": ev.worker_id,
                                       "dp_rank": ev.dp_rank, **(ev.data or {})})
            return
        rec = self.records.get(rid)
        data = ev.data or {}
        if kind == "request_arrived":
            if rec is not None:
                return  # a duplicate id: the first record stays
            self.records[rid] = RequestRecord(
                request_id=rid, session_id=data.get("session_id"), parent_session_id=data.get("parent_session_id"),
                arrival_ns=ev.time_ns, isl=data.get("isl", 0), max_tokens=data.get("max_tokens", 0),
                # 8 bytes a token, not a 32-byte int object and a list slot; RequestRecord allows any int sequence in
                # process, but its field is declared as the list it decodes to (workers append and slice it as one)
                token_times_ns=array("q"),  # type: ignore[arg-type]
            )
            return
        if rec is None:
            return
        if kind == "routed" and data.get("pool") == "prefill":  # a disaggregated request's prefill leg: it
            rec.prefill_worker_id, rec.prefill_dp_rank = ev.worker_id, ev.dp_rank  # matches the prompt's prefix
            rec.predicted_overlap_blocks = data.get("overlap_blocks")
            rec.best_overlap_blocks = data.get("best_overlap_blocks")
        elif kind == "routed":
            rec.routed_ns = ev.time_ns
            rec.attempts = data.get("attempt", 0) + 1
            rec.worker_id, rec.dp_rank = ev.worker_id, ev.dp_rank
            rec.routing_reason = data.get("reason")
            if data.get("pool") != "decode":  # the decode leg's KV arrives by transfer: it predicts no prefix
                rec.predicted_overlap_blocks = data.get("overlap_blocks")
                rec.best_overlap_blocks = data.get("best_overlap_blocks")
        elif kind == "dispatch_accepted":
            rec.dispatch_ns = ev.time_ns
        elif kind == "queued":
            rec.queued_ns = ev.time_ns
        elif kind == "first_token":
            rec.first_token_ns = data.get("time_ns", ev.time_ns)
        elif kind == "tokens":
            rec.token_times_ns.extend(data.get("times_ns", ()))
        elif kind == "completed":
            rec.completion_ns = rec.token_times_ns[-1] if rec.token_times_ns else ev.time_ns
            rec.engine_cached_tokens = data.get("cached_tokens")
            reused = data.get("reused_tokens")
            rec.engine_reused_tokens = rec.engine_cached_tokens if reused is None else reused
            rec.engine_host_cached_tokens = data.get("host_cached_tokens")
            rec.output_tokens = data.get("output_tokens", len(rec.token_times_ns))
            rec.admitted_ns = data.get("admitted_ns")
            rec.preemptions = data.get("preemptions", 0)
            if "prefill_done_ns" in data:  # disaggregated
                rec.prefill_worker_id, rec.prefill_dp_rank = data["prefill_worker_id"], data["prefill_dp_rank"]
                rec.prefill_done_ns = data["prefill_done_ns"]
                rec.kv_reserved_ns, rec.kv_activated_ns = data["kv_reserved_ns"], data["kv_activated_ns"]
        elif kind == "failed":
            if data.get("duplicate"):  # a copy refused under the id of this open request: not this request's end
                self.failures["duplicate_request_id"] += 1
                return
            rec.failure = data.get("reason", "unknown")
            rec.completion_ns = None
            self.failures[rec.failure.split(":")[0]] += 1
