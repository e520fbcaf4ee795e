"""Disaggregated serving: every request runs a prefill leg on a prefill pool, then a decode leg on a decode pool.

Each pool is a ``Router`` of its own (its index, load, affinity table and queue), so a session is bound once
per pool and a binding in one pool never names a worker of the other. ``DisaggRouter`` composes them, as
the reference does:

1. On arrival the prefill pool selects a rank and runs the prompt there with one output token
   (``kv_hold``): the rank computes the prompt, reports the leg finished and keeps the KV.
2. When the prefill leg finished, the decode pool selects a rank and runs the request there with its KV
   coming from the prefill rank (``kv_transfer``, with the prefill rank's link model). The decode rank
   reserves room, waits the transfer, says so (``KvPulled``) and streams every output token.
3. On ``KvPulled`` the prefill rank is told to free its copy (``ReleaseKv``).

Failures: a leg that cannot be placed or is refused is retried inside its pool, as any request is. A decode
leg whose KV source is lost before it pulled the KV (the prefill rank went away), or whose decode rank is
lost after the pull but before a token, runs again from the prefill leg, up to ``retry_limit`` times;
after a token was streamed a lost decode rank fails the request (``worker_lost``), as in an aggregated
cluster. Whatever ends a request, the KV the prefill rank holds for it is released: nothing leaks.

The object is sans-IO like the routers' lifecycles: it is told the legs' ends and the pool events, and sends
through the routers. Request-level hooks (``request_arrived``, ``routed`` with ``pool``, ``first_token``,
``tokens``, ``completed``, ``failed``) go to ``hooks``; each pool's other hooks pass through tagged with
their pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from kvemu.clock import Clock
from kvemu.records import EngineFacts, RequestRecord, router_record
from kvemu.hooks import HookEvent, HookKind, Hooks, Reason, Restart
from kvemu.messages import Abort, ClientRequest, KvPulled, ReleaseKv
from kvemu.transfer import KvTransfer, transfer_refusal

__all__ = ["DisaggRouter", "PREFILL", "DECODE"]

PREFILL = "prefill"
"""The prefill pool's name, as ``Router(pool=...)`` takes it and pool-tagged hooks carry it."""
DECODE = "decode"
"""The decode pool's name."""

_FORWARDED = {HookKind.REQUEST_ARRIVED, HookKind.FIRST_TOKEN, HookKind.TOKENS, HookKind.COMPLETED, HookKind.FAILED}
"""Leg-level hooks the coordinator replaces with its own request-level ones."""


class _Request:
    __slots__ = ("req", "record", "on_end", "restarts", "leg", "source", "pulled", "streamed", "ended")

    def __init__(self, req: ClientRequest, record: RequestRecord, on_end: Callable[[RequestRecord], None]) -> None:
        self.req = req
        self.record = record
        self.on_end = on_end
        self.restarts = 0
        self.leg = PREFILL
        self.source: KvTransfer | None = None
        """Where the request's KV is held (set when the prefill leg finished; None once released)."""
        self.pulled = False
        self.streamed = False
        self.ended = False


class DisaggRouter:
    """Routes requests through a prefill pool and then a decode pool (see the module doc)."""

    def __init__(self, prefill: Any, decode: Any, *, clock: Clock, hooks: Hooks | None = None,
                 retry_limit: int = 3) -> None:
        self.prefill = prefill
        self.decode = decode
        self.clock = clock
        self.hooks = hooks or Hooks()
        self.retry_limit = retry_limit
        self.requests: dict[str, _Request] = {}
        prefill.hooks.subscribe(lambda ev: self._pool_event(PREFILL, ev))
        decode.hooks.subscribe(lambda ev: self._pool_event(DECODE, ev))

    # ------------------------------------------------------------------ inputs

    def submit(self, req: ClientRequest, on_end: Callable[[RequestRecord], None]) -> RequestRecord:
        """Start a request; ``on_end`` gets its record (both legs merged) when it ends."""
        now = self.clock.now_ns()
        record = router_record(req.request_id, session_id=req.session_id, parent_session_id=req.parent_session_id,
                               arrival_ns=now, isl=len(req.tokens), max_tokens=req.max_tokens)
        hooks = self.hooks
        reason = None
        if req.request_id in self.requests:
            reason = "duplicate_request_id"
        elif req.kv_hold or req.kv_transfer is not None:
            reason = "invalid_request: kv_hold and kv_transfer are set by the router, not by clients"
        elif req.worker_id is not None and req.decode_worker_id is not None and req.worker_id != req.decode_worker_id:
            reason = "invalid_request: worker_id and decode_worker_id pin the decode leg to different workers"
        hooks.note(HookKind.REQUEST_ARRIVED, now, req.request_id, record=record)
        if reason is not None:
            record.failure = reason
            hooks.note(HookKind.FAILED, now, req.request_id, record=record)
            on_end(record)
            return record
        r = self.requests[req.request_id] = _Request(req, record, on_end)
        self._start_prefill(r)
        return record

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """End an open request now: its current leg is cancelled and held KV released. Whether it was open."""
        r = self.requests.get(request_id)
        if r is None or r.ended:
            return False
        r.record.failure = reason
        router = self.prefill if r.leg == PREFILL else self.decode
        if not router.cancel(request_id, reason):  # between legs (cannot happen: legs chain at once); end it here
            self._end(r, reason)
        return True

    def on_kv_pulled(self, worker_id: int, msg: KvPulled) -> None:
        """A decode rank has the KV (the decode router checked it came from the leg's worker): free the source."""
        r = self.requests.get(msg.request_id)
        if r is None or r.leg != DECODE or r.pulled:
            return
        r.pulled = True
        r.record.kv_reserved_ns, r.record.kv_activated_ns = msg.reserved_ns, msg.activated_ns
        self._release(r)

    def prefill_worker_lost(self, worker_id: int, dp_rank: int | None = None) -> None:
        """A prefill worker (or one rank of it) is gone: decode legs still waiting for its KV cannot get it."""
        for r in list(self.requests.values()):
            src = r.source
            if (r.leg == DECODE and not r.pulled and src is not None and src.source_worker_id == worker_id
                    and (dp_rank is None or src.source_dp_rank == dp_rank)):
                r.source = None  # nothing left to release
                self.decode.cancel(r.req.request_id, "kv_source_lost")

    # ------------------------------------------------------------------ legs

    def _start_prefill(self, r: _Request) -> None:
        req = r.req
        r.leg, r.source, r.pulled = PREFILL, None, False
        leg = msgspec.structs.replace(
            req, max_tokens=1, worker_id=req.prefill_worker_id, dp_rank=req.prefill_dp_rank, kv_hold=True,
            expected_output_tokens=None, output_token_ids=None)
        self.prefill.submit(leg, lambda rec: self._prefill_ended(r, rec),
                            on_finished=lambda msg: setattr(r, "source", msg.kv_transfer))

    def _prefill_ended(self, r: _Request, leg: RequestRecord) -> None:
        if r.ended:
            return
        record = r.record
        if leg.routed_ns is not None:  # the prefill leg's routing: the leg whose engine finds the prefix
            record.prefill_worker_id, record.prefill_dp_rank = leg.worker_id, leg.dp_rank
            record.predicted_overlap_blocks = leg.predicted_overlap_blocks
            record.best_overlap_blocks = leg.best_overlap_blocks
            record.truth_overlap_blocks = leg.truth_overlap_blocks
            record.truth_best_overlap_blocks = leg.truth_best_overlap_blocks
            record.regret_source = leg.regret_source
        _latest_leg_times(record, leg)
        if leg.failure is not None:
            if leg.worker_id is not None:  # whatever the leg left on its worker (running, or its KV held) goes
                self.prefill.tell(leg.worker_id, Abort(request_id=r.req.request_id, reason=leg.failure))
            self._end(r, self._pool_named(PREFILL, leg.failure))
            return
        record.prefill_done_ns = leg.completion_ns
        facts = leg.engine  # the request's own copy (the decode leg adds to it); host-tier hits are not carried over
        record.engine = EngineFacts(admitted_ns=facts.admitted_ns, cached_tokens=facts.cached_tokens,
                                    reused_tokens=facts.reused_tokens, preemptions=facts.preemptions)
        src = r.source
        if src is None:  # a worker that did not say where the KV is: on the rank that computed it
            src = KvTransfer(source_worker_id=leg.worker_id or 0, source_dp_rank=leg.dp_rank or 0)
        elif (src.source_worker_id, src.source_dp_rank) != (leg.worker_id or 0, leg.dp_rank or 0):
            # the KV is where the leg ran, whatever its worker says (no worker names another's KV to free)
            src = msgspec.structs.replace(src, source_worker_id=leg.worker_id or 0, source_dp_rank=leg.dp_rank or 0)
        r.source = src
        if (why := transfer_refusal(src, len(r.req.tokens))) is not None:  # never forwarded to a decode rank
            self._end(r, f"kv_transfer_failed: the prefill worker's link model: {why}")
            return
        r.leg = DECODE
        req = r.req
        pin = req.decode_worker_id if req.decode_worker_id is not None else req.worker_id
        rank = req.decode_dp_rank if req.decode_dp_rank is not None else req.dp_rank
        dleg = msgspec.structs.replace(req, worker_id=pin, dp_rank=rank, kv_transfer=r.source)
        self.decode.submit(dleg, lambda rec: self._decode_ended(r, rec), can_retry=lambda: not r.pulled)

    def _decode_ended(self, r: _Request, leg: RequestRecord) -> None:
        if r.ended:
            return
        record = r.record
        record.worker_id, record.dp_rank = leg.worker_id, leg.dp_rank
        if leg.routed_ns is not None:  # the decode leg's routing is the request's
            record.routed_ns, record.attempts, record.routing_reason = leg.routed_ns, leg.attempts, leg.routing_reason
        _latest_leg_times(record, leg)
        if leg.first_token_ns is not None:  # what it streamed, also when it failed after
            record.first_token_ns, record.token_times_ns = leg.first_token_ns, leg.token_times_ns
        facts, more = record.engine, leg.engine
        facts.preemptions += more.preemptions
        if more.preemptions:  # the decode rank recomputed it: what that re-admission reused counts too
            facts.reused_tokens = (facts.reused_tokens or 0) + (more.reused_tokens or 0)
        failure = leg.failure and self._pool_named(DECODE, leg.failure)
        if failure is None:
            record.completion_ns, record.output_tokens = leg.completion_ns, leg.output_tokens
            self._end(r, None)  # (which releases the held KV)
            return
        self._release(r)
        restartable = failure.startswith(("worker_lost", "kv_source_lost")) and not r.streamed
        if restartable and r.restarts < self.retry_limit:
            r.restarts += 1
            self.hooks.note(HookKind.RETRIED, self.clock.now_ns(), r.req.request_id,
                            details=Restart(failure, r.restarts), record=r.record)
            self._start_prefill(r)  # the KV is gone: compute the prompt again
            return
        self._end(r, failure if not restartable or failure.startswith("worker_lost") else
                  f"kv_transfer_failed: {failure}")

    def _pool_named(self, pool: str, failure: str) -> str:
        """A ``pool`` leg's ``failure``, an empty pool named: "no prefill workers are registered (4 decode workers
        are)", not the router's "no workers are registered" while the other pool has some."""
        other = DECODE if pool == PREFILL else PREFILL
        n = len((self.decode if pool == PREFILL else self.prefill).workers)
        return failure.replace("no workers are registered",
                               f"no {pool} workers are registered ({n} {other} worker{'s are' if n != 1 else ' is'})",
                               1)

    def _release(self, r: _Request) -> None:
        """Tell the prefill rank holding the request's KV to free it (once)."""
        src, r.source = r.source, None
        if src is not None:
            self.prefill.tell(src.source_worker_id, ReleaseKv(request_id=r.req.request_id))

    def _end(self, r: _Request, failure: str | None) -> None:
        if r.ended:
            return
        r.ended = True
        self._release(r)
        record = r.record
        now = self.clock.now_ns()
        rid = r.req.request_id
        record.failure = failure
        if failure is None:
            self.hooks.note(HookKind.COMPLETED, now, rid, record.worker_id, record.dp_rank, record=record)
        else:
            record.completion_ns = None
            self.hooks.note(HookKind.FAILED, now, rid, record.worker_id, record.dp_rank, record=record)
        del self.requests[rid]
        r.on_end(record)

    # ------------------------------------------------------------------ hooks

    def _pool_event(self, pool: str, ev: HookEvent) -> None:
        kind = ev.kind
        rid = ev.request_id
        if pool == PREFILL and rid is None:
            if kind == HookKind.WORKER_REMOVED:
                self.prefill_worker_lost(ev.worker_id)  # type: ignore[arg-type]
            elif kind == HookKind.WORKER_FENCED and ev.details == Reason("rank_down"):
                self.prefill_worker_lost(ev.worker_id, ev.dp_rank)  # type: ignore[arg-type]
        if rid is not None and kind in _FORWARDED:
            r = self.requests.get(rid)
            if r is None or pool != DECODE or kind not in (HookKind.FIRST_TOKEN, HookKind.TOKENS):
                return
            r.streamed = True
            self.hooks.note(kind, ev.time_ns, rid, ev.worker_id, ev.dp_rank, ev.details, r.record)
            return
        if not self.hooks.wants(kind):
            self.hooks.tally(kind)
            return
        self.hooks.note(kind, ev.time_ns, rid, ev.worker_id, ev.dp_rank, ev.details, ev.record, pool)


def _latest_leg_times(record: RequestRecord, leg: RequestRecord) -> None:
    """When the request last queued and was last accepted: its latest leg's times where that leg has them."""
    if leg.queued_ns is not None:
        record.queued_ns = leg.queued_ns
    if leg.dispatch_ns is not None:
        record.dispatch_ns = leg.dispatch_ns
