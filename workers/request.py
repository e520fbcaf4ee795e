"""Requests as a mock engine receives them, and the per-request record it keeps of their life."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["Request", "RequestRecord"]


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """One generation request: prompt token ids, exactly ``max_tokens`` output tokens (no EOS), arrival time.

    Validated when a worker or engine core accepts it, not when it is built.
    """

    request_id: str
    token_ids: Sequence[int]
    max_tokens: int
    arrival_ns: int | None = 0
    """Virtual arrival time; None means "now" (the engine's current time when it is added)."""
    priority: int = 0
    """Lower values are scheduled first; equal priorities are first come, first served."""
    output_token_ids: Sequence[int] | None = None
    """Ids of the generated tokens (default: a deterministic per-request sequence); they only matter for
    the hashes of blocks that generated tokens fill."""
    seq_hashes: Sequence[int] | None = None
    """The prompt's sequence hashes at the engine's block size (e.g. ``RoutingCore.prepare(...).seq_hashes``),
    to skip rehashing; trusted, only their count is checked."""


class RequestRecord:
    """What happened to one request on one rank, in virtual nanoseconds; updated live by the engine.

    ``cached_tokens``: prompt prefix found cached at first admission; ``token_times``: each token's pass end.
    """

    __slots__ = (
        "request_id",
        "dp_rank",
        "arrival_ns",
        "prompt_tokens",
        "max_tokens",
        "admitted_ns",
        "first_token_ns",
        "completed_ns",
        "cached_tokens",
        "output_tokens",
        "preemptions",
        "token_times",
    )

    def __init__(self, request_id: str, dp_rank: int, arrival_ns: int, prompt_tokens: int, max_tokens: int) -> None:
        self.request_id = request_id
        self.dp_rank = dp_rank
        self.arrival_ns = arrival_ns
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.admitted_ns: int | None = None
        self.first_token_ns: int | None = None
        self.completed_ns: int | None = None
        self.cached_tokens: int | None = None
        self.output_tokens = 0
        self.preemptions = 0
        self.token_times: list[int] = []

    @property
    def done(self) -> bool:
        """Whether every requested token has been produced."""
        return self.completed_ns is not None

    def as_dict(self) -> dict[str, object]:
        """Plain-dict view (reports, comparisons in tests)."""
        return {name: getattr(self, name) for name in self.__slots__}

    def __repr__(self) -> str:
        return (
            f"RequestRecord({self.request_id!r}, rank={self.dp_rank}, arrival={self.arrival_ns}, "
            f"first_token={self.first_token_ns}, completed={self.completed_ns}, "
            f"out={self.output_tokens}/{self.max_tokens}, cached={self.cached_tokens}, "
            f"preemptions={self.preemptions})"
        )
