"""A workload's units: a ``Session`` of ``Turn`` requests (synthesized, or materialized from a loaded trace).

Their own module so that the trace's column store (``harness.workload.trace_sessions``) and the workload builders
(``harness.workload``) share them without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from workers.trace import HashIdTokens

from harness.workload.traces.graph import TraceGraph

__all__ = ["Turn", "Session", "Sessions"]


class Turn(NamedTuple):
    """One request of a session (trace turns keep their hash ids and expand them only when sent)."""

    tokens: list[int] | None
    max_tokens: int
    delay_ns: int = 0
    """Wait after the previous turn of the session completed (0 for the first turn)."""
    output_token_ids: list[int] | None = None
    """The reply's token ids, so that later turns that quote it hit the engine's cache."""
    sub_agents: tuple[tuple[list[int], int], ...] = ()
    """Sibling requests ``(tokens, max_tokens)`` started when this turn completes."""
    worker_id: int | None = None
    hash_ids: Sequence[int] | None = None
    """A trace turn's hash ids: those its prompt uses, as the low 32 bits its tokens take (an ``array("I")``)."""
    input_length: int = 0
    trace_block_size: int = 0

    def prompt(self) -> Sequence[int]:
        """The prompt's token ids (a trace prompt stays a lazy ``HashIdTokens``: it hashes its blocks
        once per trace block instead of per token, and is encoded as a list where bytes are needed)."""
        if self.tokens is not None:
            return self.tokens
        return HashIdTokens(self.hash_ids or (), self.input_length, self.trace_block_size)


class Session(NamedTuple):
    """Turns that run one after another, starting at ``start_ns``."""

    session_id: str
    start_ns: int
    turns: list[Turn]
    sticky: bool = False
    """Whether its requests carry the session id (affinity); trace rows without one do not."""


Sessions = Sequence[Session] | TraceGraph
"""What a workload plays: sessions of turns, or a trace's dependency graph (``harness.workload.traces``)."""
