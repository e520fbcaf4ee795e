"""What every flavour's engine core of one DP rank shares: time bookkeeping, request records and the two drivers.

A flavour (``workers.vllm.engine.VllmEngineCore`` for vLLM and TRT-LLM, ``workers.sglang.engine.SglangEngineCore``)
says how it queues a request, when its next pass starts, how it plans a pass and how a pass ends; this base runs
``step`` and ``advance_to`` over those with the same contract for all (see ``workers.vllm.engine``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mypy_extensions import mypyc_attr

from kvemu.clock import MAX_TIME_NS
from kvemu.errors import InvalidArgument
from kvemu.records import EngineRecord
from workers.admission import RejectReason, RequestRejected, check_request
from workers.config import EngineConfig
from workers.pass_events import PassEvents
from workers.results import AdvanceResult, StepResult
from workers.request import Request
from workers.sequence import SeqState
from workers.speculative import DraftSampler
from workers.timing import AnyTimingModel, PassTimer

__all__ = ["RankCore"]


@mypyc_attr(allow_interpreted_subclasses=True)  # subclassed outside the compiled build
class RankCore:
    """One DP rank's engine, told the time: never sleeps, never reads a clock."""

    _steady = False  # a flavour with a decode-run fast path sets it when the next passes only decode

    def __init__(self, config: EngineConfig, dp_rank: int, timing: AnyTimingModel | None, worker_id: int = 0) -> None:
        if not isinstance(dp_rank, int) or dp_rank < 0:
            raise InvalidArgument(f"dp_rank must be an integer >= 0, got {dp_rank!r}", field="dp_rank")
        self.config = config
        self.dp_rank = dp_rank
        self.timer = PassTimer(config, timing)
        spec = config.speculative
        self.spec: DraftSampler | None = DraftSampler(spec, worker_id, dp_rank) if spec is not None else None
        """Speculative decoding's draws and counts on this rank (None: off)."""
        self._spec_k = spec.num_speculative_tokens if spec is not None else 0
        self._record_times = config.record_token_times
        self._seqs: dict[str, Any] = {}
        self._order = 0
        self._now = 0
        self._free_at = 0
        self._inflight: Any = None
        self._aborting: list[Any] = []  # aborted while in the pass in flight: released at its end
        self._blocked = -1  # the cache version at which an idle engine last found nothing it could start
        self._group_blocks: Callable[[int], int] | None = None
        """With hybrid KV cache groups, the blocks a request of n KV tokens holds at once over every group (the
        admission gate; set by the flavour that has them)."""
        self.passes = 0
        """Forward passes completed so far."""

    # ------------------------------------------------------------------ flavour hooks

    def _next_start(self) -> int | None:
        raise NotImplementedError

    def _plan(self, start: int) -> Any:
        """Plan the pass starting at ``start`` (false when it would do nothing)."""
        raise NotImplementedError

    def _finish(self, p: Any, out: AdvanceResult | None, res: StepResult | None) -> None:
        raise NotImplementedError

    def _new_seq(self, req: Request, record: EngineRecord) -> SeqState:
        raise NotImplementedError

    def _enqueue(self, seq: Any) -> None:
        raise NotImplementedError

    def _cache_version(self) -> int:
        """Changes whenever something that may let a waiting request in changes."""
        raise NotImplementedError

    def _step_result(self, p: Any) -> StepResult:
        raise NotImplementedError

    def _decode_run(self, s: int, t_ns: int, out: AdvanceResult) -> int:
        return 0

    def _sample(self, sampled: list[SeqState], end: int) -> list[SeqState]:
        """Book the token each of ``sampled`` produced in the pass that ended at ``end`` (in batch order); returns
        those for which it was the first (the end of a prefill, or a decode leg's first pass)."""
        record_times = self._record_times
        first: list[SeqState] = []
        for seq in sampled:
            seq.n_out += 1
            seq.prefilling = False
            rec = seq.record
            rec.output_tokens += 1
            if record_times:
                rec.token_times_ns.append(end)
            if rec.first_token_ns is None:
                rec.first_token_ns = end
                first.append(seq)
        return first

    def _book_burst(self, seq: SeqState, extra: int, end: int) -> None:
        """Speculative decoding: book the ``extra`` accepted drafts a decode emitted before its last token (which
        ``_sample`` books), all stamped with the pass's end."""
        seq.n_out += extra
        rec = seq.record
        rec.output_tokens += extra
        if self._record_times:
            rec.token_times_ns.extend([end] * extra)

    @staticmethod
    def _report(start: int, end: int, out: AdvanceResult | None, res: StepResult | None, *, admitted: list[Any],
                preempted: list[Any], first: list[Any], completed: list[Any], sampled: list[Any],
                events: PassEvents | None, pulled: Sequence[Any] = ()) -> None:
        """Tell the driver what a pass that ran from ``start`` to ``end`` made visible."""
        if out is not None:
            out.passes += 1
            out.admitted += [(seq.rid, start) for seq in admitted]
            out.preempted += [(seq.rid, end) for seq in preempted]
            out.first_tokens += [(seq.rid, end) for seq in first]
            out.completed += [seq.record for seq in completed]
            out.pulled += [(seq.rid, seq.record.kv_reserved_ns, start) for seq in pulled]
            if events is not None:
                out.events.append(events)
        if res is not None:
            res.tokens = [s.rid for s in sampled]
            res.first_tokens = [s.rid for s in first]
            res.completed = [s.record for s in completed]
            res.admitted = [s.rid for s in admitted]
            res.preempted = [s.rid for s in preempted]
            res.pulled = [(s.rid, s.record.kv_reserved_ns, start) for s in pulled]
            res.events = events

    # ------------------------------------------------------------------ queries

    @property
    def now_ns(self) -> int:
        """The time the engine was last advanced or stepped to."""
        return self._now

    @property
    def busy_until_ns(self) -> int:
        """End of the last completed pass (or of the pass in flight)."""
        return self._inflight.end if self._inflight is not None else self._free_at

    @property
    def num_unfinished(self) -> int:
        """Accepted requests that have not completed."""
        return len(self._seqs)

    def unsettled(self, now_ns: int) -> int:
        """Requests this rank still works for at ``now_ns``: unfinished ones, and aborted ones the pass in flight
        still holds (a subclass adds KV held for a transfer or being offloaded). 0: the rank has settled."""
        return len(self._seqs) + len(self._aborting)

    def cached_prefix_blocks(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt (its full blocks' sequence hashes) this rank has cached now, as an
        admission here would find them; read-only (nothing becomes more recently used). The routing truth's probe."""
        raise NotImplementedError

    def has_request(self, request_id: str) -> bool:
        """Whether an unfinished request with this id is on this rank."""
        return request_id in self._seqs

    def record(self, request_id: str) -> EngineRecord:
        """The live record of an unfinished request."""
        try:
            return self._seqs[request_id].record
        except KeyError:
            raise InvalidArgument(
                f"request_id {request_id!r} is not an unfinished request on rank {self.dp_rank}",
                field="request_id", dp_rank=self.dp_rank,
            ) from None

    def next_pass_start_ns(self) -> int | None:
        """When the next pass would start given the requests known now (None: nothing to do)."""
        if self._inflight is not None:
            return self._inflight.end
        return self._next_start()

    # ------------------------------------------------------------------ admission

    def add_request(self, req: Request) -> EngineRecord:
        """Accept a request (it joins the first pass starting at or after its arrival); returns its live record.

        Raises ``RequestRejected`` (nothing changed) for malformed or duplicate requests.
        """
        if req.request_id in self._seqs:
            raise RequestRejected(RejectReason.DUPLICATE_REQUEST_ID,
                                  f"request_id: {req.request_id!r} is already on rank {self.dp_rank}", field="request_id")
        has_fast_path = req.seq_hashes is None and hasattr(req.token_ids, "local_block_hashes")
        check_request(req, self.config, now_ns=self._now, check_tokens=req.seq_hashes is not None or has_fast_path,
                      group_blocks=self._group_blocks)
        arrival = self._now if req.arrival_ns is None else req.arrival_ns
        record = EngineRecord(request_id=req.request_id, dp_rank=self.dp_rank, arrival_ns=arrival,
                               isl=len(req.token_ids), max_tokens=req.max_tokens)
        try:
            seq = self._new_seq(req, record)
        except InvalidArgument as exc:  # hashing validates every token id
            raise RequestRejected(RejectReason.MALFORMED, f"token_ids: {exc}", field="token_ids") from None
        self._order += 1
        self._seqs[req.request_id] = seq
        self._enqueue(seq)
        return record

    # ------------------------------------------------------------------ drivers

    def step(self, now_ns: int) -> StepResult:
        """Run one forward pass starting at ``now_ns`` and return it, finished (idle if nothing to do)."""
        if self._inflight is not None:
            raise InvalidArgument(
                f"now_ns: a pass started by advance_to is in flight until {self._inflight.end}; advance_to it first",
                field="now_ns")
        if not isinstance(now_ns, int) or now_ns < self._free_at or now_ns < self._now:
            raise InvalidArgument(f"now_ns must be an integer >= the end of the previous pass "
                                  f"({max(self._free_at, self._now)}), got {now_ns!r}", field="now_ns")
        self._now = now_ns
        p = self._plan(now_ns)
        res = self._step_result(p)
        if not p:
            self._free_at = max(self._free_at, now_ns)
            self._blocked = self._cache_version()
            return res
        self._finish(p, None, res)
        return res

    def advance_to(self, t_ns: int) -> AdvanceResult:
        """Run every pass that starts before ``t_ns`` and ends by it; return what became visible."""
        if not isinstance(t_ns, int) or t_ns < self._now or t_ns > MAX_TIME_NS:
            raise InvalidArgument(f"t_ns must be an integer in [{self._now}, {MAX_TIME_NS}], got {t_ns!r}", field="t_ns")
        out = AdvanceResult()
        while True:
            fl = self._inflight
            if fl is not None:
                if fl.end > t_ns:
                    break
                self._inflight = None
                self._finish(fl, out, None)
                continue
            s = self._next_start()
            if s is None or s >= t_ns:
                break
            if self._steady and s == self._free_at and self._decode_run(s, t_ns, out):
                continue
            p = self._plan(s)
            if not p:  # held, reserved or locked KV keeps the waiting out: wait for a change
                self._free_at = s
                self._blocked = self._cache_version()
                continue
            if p.end > t_ns:
                self._inflight = p
                break
            self._finish(p, out, None)
        self._now = t_ns
        return out
