"""A worker's own OpenAI server: requests go straight to its engine ranks, as to a vLLM server with DP ranks.

The rank comes from the ``X-data-parallel-rank`` header (as vLLM takes it), else round robin over the live
ranks. The router does not see these requests (as it would not see a client that bypasses it), but the
engine's KV events do, so a router that watches this worker learns what they cached.
"""

from __future__ import annotations

from kvemu.http.backend import OnEnd, OnTokens
from kvemu.records import RequestRecord
from kvemu.messages import ClientRequest, Finished, RequestFailed, TokenBatch
from workers.actor.actor import WorkerActor

from harness.procs.engine_truth import EngineTruth
from harness.procs.kv_handoff import KvHandoff

__all__ = ["WorkerBackend"]


class WorkerBackend:
    """Runs HTTP requests on one worker's ranks through its actor."""

    def __init__(self, actor: WorkerActor, truth: EngineTruth | None = None, handoff: KvHandoff | None = None) -> None:
        self.actor = actor
        self.truth = truth
        """Told when each request arrives (its first: a fleet's chaos timeline starts there)."""
        self.handoff = handoff
        """Told how each leg of another router's disaggregated serving ended (a prefill or decode worker)."""
        cfg = actor.worker.config
        self.max_model_len = cfg.capacity_tokens
        self.block_size = cfg.resolved_block_size
        self._next = 0

    def _rank(self) -> int | None:
        ranks = [r for r in self.actor.worker.dp_ranks if r not in self.actor.dead_ranks]
        if not ranks:
            return None
        self._next = (self._next + 1) % len(ranks)
        return ranks[self._next]

    def submit(self, req: ClientRequest, on_tokens: OnTokens, on_end: OnEnd) -> None:
        if self.truth is not None:
            self.truth.arrived(self.actor.clock.now_ns())
        rank = req.dp_rank if req.dp_rank is not None else self._rank()
        record = RequestRecord(request_id=req.request_id, arrival_ns=self.actor.clock.now_ns(), isl=len(req.tokens),
                               max_tokens=req.max_tokens, worker_id=self.actor.worker_id, dp_rank=rank)
        handoff = self.handoff
        why = None
        if req.worker_id is not None and req.worker_id != self.actor.worker_id:
            why = (f"pinned_worker_not_allowed: this is worker {self.actor.worker_id}, the request is pinned to worker "
                   f"{req.worker_id}")
        elif rank is None:
            why = "no_endpoints: every rank of this worker is down"
        if why is not None or rank is None:
            record.failure = why
            if handoff is not None:
                handoff.ended(record.request_id, why)
            on_end(record)
            return

        def reply(msg: TokenBatch | Finished | RequestFailed) -> None:
            t = type(msg)
            times = msg.times_ns if t is not RequestFailed else None  # type: ignore[union-attr]
            if times:
                if record.first_token_ns is None:
                    record.first_token_ns = times[0]
                record.output_tokens += len(times)
                on_tokens(len(times))
            if t is TokenBatch:
                return
            if t is Finished:
                if times:
                    record.completion_ns = times[-1]
                record.engine = msg.engine  # type: ignore[union-attr]
                if handoff is not None and msg.kv_transfer is not None:  # type: ignore[union-attr]
                    handoff.held(record.request_id, msg.kv_transfer)  # type: ignore[union-attr]
            else:
                record.failure = msg.reason  # type: ignore[union-attr]
            if handoff is not None:
                handoff.ended(record.request_id, record.failure)
            on_end(record)

        why = self.actor.submit_local(req, rank, reply)
        if why is not None:
            record.failure = why
            if handoff is not None:
                handoff.ended(record.request_id, why)
            on_end(record)

    def cancel(self, request_id: str, reason: str) -> None:
        self.actor.abort(request_id, reason)
        if self.handoff is not None:
            self.handoff.ended(request_id, reason)

    def unavailable(self) -> str | None:
        if self.actor.worker.shutting_down:
            return "this worker is shutting down"
        if len(self.actor.dead_ranks) == len(self.actor.worker.cores):
            return "every rank of this worker is down"
        return None
