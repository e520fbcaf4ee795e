"""What a mock engine core's passes produce: one pass (``step``) or everything in an ``advance_to`` call."""

from __future__ import annotations

from kvemu.records import EngineRecord
from kvemu.kv_events import KVEventBatch
from workers.pass_events import PassEvents
from workers.sequence import SeqState

__all__ = ["StepResult", "AdvanceResult"]


class StepResult:
    """One forward pass: its timing, what it produced (all stamped ``end_ns``) and its KV events."""

    __slots__ = (
        "start_ns",
        "end_ns",
        "prefill_tokens",
        "decodes",
        "tokens",
        "first_tokens",
        "completed",
        "admitted",
        "preempted",
        "events",
        "pulled",
        "_entries",
        "_admitted",
    )

    def __init__(self, start_ns: int, end_ns: int) -> None:
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.prefill_tokens = 0
        self.decodes = 0
        self.tokens: list[str] = []
        """Ids of the requests that received one token in this pass (stamped ``end_ns``)."""
        self.first_tokens: list[str] = []
        self.completed: list[EngineRecord] = []
        self.admitted: list[str] = []
        self.preempted: list[str] = []
        self.events: PassEvents | None = None
        self.pulled: list[tuple[str, int, int]] = []
        """Decode legs whose KV arrived at ``start_ns``: (request id, reserved at, activated at)."""
        self._entries: dict[SeqState, int] = {}  # the vLLM flavour's decisions, read only by the two properties
        self._admitted: list[SeqState] = []

    @property
    def scheduled(self) -> list[tuple[str, int]]:
        """vLLM flavour: (request id, tokens) of every request the pass ran, in the order it scheduled them."""
        return [(seq.rid, n) for seq, n in self._entries.items()]

    @property
    def admitted_hits(self) -> list[tuple[str, int]]:
        """vLLM flavour: (request id, prompt tokens found in the prefix cache) of each request admitted."""
        return [(seq.rid, seq.record.engine.reused_tokens or 0) for seq in self._admitted]

    @property
    def duration_ns(self) -> int:
        """Length of the pass (0 for an idle step or when the speedup ratio is 0)."""
        return self.end_ns - self.start_ns

    @property
    def idle(self) -> bool:
        """True when nothing was scheduled (no request had work at ``start_ns``)."""
        return not self.tokens and not self.admitted and not self.preempted and not self.prefill_tokens

    @property
    def kv_batch(self) -> KVEventBatch | None:
        """The pass's KV events as one batch (None if it logged none)."""
        return self.events.batch() if self.events is not None else None

    def __repr__(self) -> str:
        return (
            f"StepResult({self.start_ns}->{self.end_ns}, prefill={self.prefill_tokens}, decodes={self.decodes}, "
            f"first={self.first_tokens}, done={[r.request_id for r in self.completed]}, preempted={self.preempted})"
        )


class AdvanceResult:
    """Everything externally visible that happened during one ``advance_to`` call, in time order."""

    __slots__ = ("passes", "first_tokens", "completed", "admitted", "preempted", "events", "pulled")

    def __init__(self) -> None:
        self.passes = 0
        self.first_tokens: list[tuple[str, int]] = []
        self.completed: list[EngineRecord] = []
        self.admitted: list[tuple[str, int]] = []
        """(request id, pass start) for every admission, including re-admissions after preemption."""
        self.preempted: list[tuple[str, int]] = []
        """(request id, pass end) for every preemption."""
        self.events: list[PassEvents] = []
        self.pulled: list[tuple[str, int, int]] = []
        """(request id, reserved at, activated at) for every decode leg whose KV arrived (at a pass start)."""

    @property
    def kv_batches(self) -> list[KVEventBatch]:
        """One KV event batch per pass that logged events (materialised now)."""
        return [p.batch() for p in self.events]

    def __repr__(self) -> str:
        return (
            f"AdvanceResult(passes={self.passes}, first_tokens={len(self.first_tokens)}, "
            f"completed={len(self.completed)}, preempted={len(self.preempted)}, event_batches={len(self.events)})"
        )
