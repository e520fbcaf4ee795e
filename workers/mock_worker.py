"""A mock worker: ``dp_size`` independent engine cores (one per data-parallel rank) behind one dispatch point."""

from __future__ import annotations

from kvemu.errors import InvalidArgument
from kvemu.records import EngineRecord
from workers.admission import RejectReason, RequestRejected
from workers.config import EngineConfig
from workers.rank_engine import RankEngine
from workers.vllm.engine import AdvanceResult, VllmEngineCore
from workers.request import Request
from workers.sglang.engine import SglangEngineCore
from workers.timing import AnyTimingModel

__all__ = ["MockWorker", "DispatchOutcome", "Core", "engine_core"]

Core = VllmEngineCore | SglangEngineCore
"""One DP rank's engine: the vLLM/TRT-LLM flavours' ``VllmEngineCore`` or the SGLang flavour's ``SglangEngineCore``."""

# Each flavour's core is what the actor shell needs: mypy checks it here, where a flavour is picked (it names the
# member a flavour lacks or types differently).
_VLLM_IS_A_RANK_ENGINE: type[RankEngine] = VllmEngineCore
_SGLANG_IS_A_RANK_ENGINE: type[RankEngine] = SglangEngineCore


def engine_core(config: EngineConfig, *, dp_rank: int = 0, timing: AnyTimingModel | None = None,
                worker_id: int = 0) -> Core:
    """The engine core for ``config.backend`` (``worker_id`` seeds its own random streams)."""
    if config.backend == "sglang":
        return SglangEngineCore(config, dp_rank=dp_rank, timing=timing, worker_id=worker_id)
    return VllmEngineCore(config, dp_rank=dp_rank, timing=timing, worker_id=worker_id)


class DispatchOutcome:
    """Outcome of dispatching one request: accepted (with its live record) or rejected with a typed reason."""

    __slots__ = ("accepted", "reason", "message", "field", "record", "dp_rank")

    def __init__(
        self,
        accepted: bool,
        *,
        dp_rank: int,
        reason: RejectReason | None = None,
        message: str = "",
        field: str | None = None,
        record: EngineRecord | None = None,
    ) -> None:
        self.accepted = accepted
        self.dp_rank = dp_rank
        self.reason = reason
        self.message = message
        self.field = field
        self.record = record

    def raise_if_rejected(self) -> EngineRecord:
        """The record if accepted, else ``RequestRejected`` with the same reason and message."""
        if not self.accepted:
            assert self.reason is not None
            raise RequestRejected(self.reason, self.message, field=self.field)
        assert self.record is not None
        return self.record

    def __repr__(self) -> str:
        if self.accepted:
            return f"DispatchOutcome(accepted, rank={self.dp_rank})"
        reason = self.reason.value if self.reason else None
        return f"DispatchOutcome(rejected={reason}, rank={self.dp_rank}, {self.message!r})"


class MockWorker:
    """Holds one ``VllmEngineCore`` per DP rank in ``[dp_start_rank, dp_start_rank + dp_size)``; ranks share nothing."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        worker_id: int = 0,
        dp_start_rank: int = 0,
        timing: AnyTimingModel | None = None,
    ) -> None:
        self.config = config if config is not None else EngineConfig()
        if not isinstance(worker_id, int) or worker_id < 0:
            raise InvalidArgument(f"worker_id must be an integer >= 0, got {worker_id!r}", field="worker_id")
        if not isinstance(dp_start_rank, int) or dp_start_rank < 0:
            raise InvalidArgument(f"dp_start_rank must be an integer >= 0, got {dp_start_rank!r}", field="dp_start_rank")
        self.worker_id = worker_id
        self.dp_start_rank = dp_start_rank
        self.cores: list[Core] = [
            engine_core(self.config, dp_rank=dp_start_rank + i, timing=timing, worker_id=worker_id)
            for i in range(self.config.dp_size)
        ]
        self._shutting_down = False

    @property
    def dp_ranks(self) -> range:
        """The DP ranks this worker serves."""
        return range(self.dp_start_rank, self.dp_start_rank + len(self.cores))

    @property
    def shutting_down(self) -> bool:
        """Whether new dispatches are refused (requests already accepted still run to completion)."""
        return self._shutting_down

    def begin_shutdown(self) -> None:
        """Refuse every later dispatch with ``SHUTTING_DOWN``; accepted requests keep running (drain)."""
        self._shutting_down = True

    def core(self, dp_rank: int) -> Core:
        """The engine core of one DP rank."""
        i = dp_rank - self.dp_start_rank if isinstance(dp_rank, int) and not isinstance(dp_rank, bool) else -1
        if not 0 <= i < len(self.cores):
            raise InvalidArgument(
                f"dp_rank {dp_rank!r} does not exist on worker {self.worker_id} (ranks {self.dp_ranks})",
                field="dp_rank", worker_id=self.worker_id, dp_rank=dp_rank,
            )
        return self.cores[i]

    def dispatch(self, request: Request, dp_rank: int = 0) -> DispatchOutcome:
        """Accept ``request`` on ``dp_rank`` or reject it with a typed reason (nothing changes on rejection)."""
        if self._shutting_down:
            return DispatchOutcome(
                False,
                dp_rank=dp_rank,
                reason=RejectReason.SHUTTING_DOWN,
                message=f"worker {self.worker_id} is shutting down",
            )
        i = dp_rank - self.dp_start_rank if isinstance(dp_rank, int) and not isinstance(dp_rank, bool) else -1
        if not 0 <= i < len(self.cores):
            return DispatchOutcome(
                False,
                dp_rank=dp_rank,
                reason=RejectReason.UNKNOWN_DP_RANK,
                message=f"dp_rank: {dp_rank!r} does not exist on worker {self.worker_id} (ranks {self.dp_ranks})",
                field="dp_rank",
            )
        try:
            record = self.cores[i].add_request(request)
        except RequestRejected as exc:
            return DispatchOutcome(False, dp_rank=dp_rank, reason=exc.reason, message=str(exc), field=exc.field)
        record.worker_id = self.worker_id
        return DispatchOutcome(True, dp_rank=dp_rank, record=record)

    def advance_to(self, t_ns: int) -> list[AdvanceResult]:
        """Advance every rank to ``t_ns``; one result per rank, in rank order."""
        cores = self.cores
        if len(cores) == 1:
            return [cores[0].advance_to(t_ns)]
        return [core.advance_to(t_ns) for core in cores]

    def next_event_ns(self) -> int | None:
        """Earliest ``next_event_ns`` over the ranks (None if no rank has work)."""
        cores = self.cores
        if len(cores) == 1:
            return cores[0].next_event_ns()
        times = [t for t in (core.next_event_ns() for core in cores) if t is not None]
        return min(times) if times else None

    @property
    def idle(self) -> bool:
        """No rank holds an unfinished request."""
        return all(core.num_unfinished == 0 for core in self.cores)

    def unsettled(self, now_ns: int) -> int:
        """Requests this worker still works for at ``now_ns``, over its ranks: unfinished, holding KV for a decode
        rank, or being offloaded to the host tier (``Core.unsettled``). 0: settled (a read-only query)."""
        return sum(core.unsettled(now_ns) for core in self.cores)

    def __repr__(self) -> str:
        return f"MockWorker(id={self.worker_id}, ranks={self.dp_ranks}, shutting_down={self._shutting_down})"
