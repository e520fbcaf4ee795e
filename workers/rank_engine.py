"""What the actor shell (``workers/actor/``) needs from one DP rank's engine core, whatever its flavour.

Both flavours' cores (``workers.vllm.engine.VllmEngineCore``, ``workers.sglang.engine.SglangEngineCore``) satisfy
``RankEngine`` structurally; mypy checks it where a flavour is picked (``workers.mock_worker``). The shell calls
nothing else on a core, so a new flavour is ready for the shell once it satisfies this protocol.

Not compiled (``setup.py``): a ``Protocol`` is for the type checker only.
"""

from __future__ import annotations

from typing import Protocol

from kvemu.records import EngineRecord
from workers.config import EngineConfig
from workers.results import AdvanceResult, StepResult
from workers.speculative import DraftSampler
from workers.timing import PassTimer

__all__ = ["RankEngine"]


class RankEngine(Protocol):
    """One DP rank's engine as the worker actor, its mode drivers and its metrics use it."""

    # ------------------------------------------------------------------ what it is

    @property
    def dp_rank(self) -> int:
        """The data-parallel rank it serves."""

    @property
    def config(self) -> EngineConfig:
        """Its knobs (a rank that restarts after a fault is built again from them)."""

    @property
    def timer(self) -> PassTimer:
        """Its pass timing: the model a restarted rank reuses, and chaos's slowdown factor."""

    # ------------------------------------------------------------------ time (the drivers)

    @property
    def now_ns(self) -> int:
        """The time it was last advanced or stepped to."""

    @property
    def busy_until_ns(self) -> int:
        """The end of its last pass (or of the pass in flight)."""

    def next_event_ns(self) -> int | None:
        """When to advance to for its next externally visible change (None: idle)."""

    def advance_to(self, t_ns: int) -> AdvanceResult:
        """Virtual time: run every pass that ends by ``t_ns``; what became visible."""

    def step(self, now_ns: int) -> StepResult:
        """Wall time: run one pass starting at ``now_ns``, finished."""

    # ------------------------------------------------------------------ requests (the actor)

    @property
    def num_unfinished(self) -> int:
        """Accepted requests not completed (0: a live rank's task waits for work)."""

    def has_request(self, request_id: str) -> bool:
        """Whether an unfinished request with this id is on this rank."""

    def abort(self, request_id: str, reason: str = "cancelled") -> EngineRecord | None:
        """Drop an unfinished request; its record, or None if it is not here."""

    def release_kv(self, request_id: str) -> bool:
        """Free the KV held for a finished prefill leg; whether it was held here."""

    # ------------------------------------------------------------------ an optional capability

    @property
    def can_defer_kv_events(self) -> bool:
        """Whether ``defer_kv_events`` lets ``next_event_ns`` pass over passes whose only visible effect is KV
        events (the SGLang flavour's per-pass evictions); False: every such pass is an event (vLLM's)."""

    defer_kv_events: bool
    """Set by a host that advances the core to the present before anything reads those KV events; only a
    flavour that ``can_defer_kv_events`` acts on it."""

    # ------------------------------------------------------------------ gauges (the metrics, at scrape time)

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""

    @property
    def num_waiting(self) -> int:
        """Accepted requests not running."""

    @property
    def kv_usage(self) -> float:
        """Share of its KV pool that requests hold."""

    @property
    def spec(self) -> DraftSampler | None:
        """Speculative decoding's counts (None: off)."""
