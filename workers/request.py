"""Requests as a mock engine receives them, and the per-request record it keeps of their life."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["Request", "RequestRecord"]


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """One generation request: prompt token ids, a fixed number of output tokens and its arrival time.

    The engine ignores EOS: it produces exactly ``max_tokens`` tokens. ``output_token_ids`` fixes the
    generated ids (default: a deterministic per-request sequence); they matter only for the hashes of
    blocks filled by generated tokens. ``seq_hashes`` may carry the prompt's sequence hashes computed
    with the engine's block size (e.g. ``RoutingCore.prepare(...).seq_hashes``) to skip rehashing; they
    are trusted, only their count is checked. Validation happens when a worker accepts the request.
    """

    request_id: str
    token_ids: Sequence[int]
    max_tokens: int
    arrival_ns: int = 0
    priority: int = 0
    """Lower values are scheduled first; equal priorities are first come, first served."""
    output_token_ids: Sequence[int] | None = None
    seq_hashes: Sequence[int] | None = None


class RequestRecord:
    """What happened to one request on one rank; all times are virtual nanoseconds.

    ``cached_tokens`` is the prompt prefix found in the rank's cache at first admission (the prefix hit);
    ``token_times`` holds every output token's timestamp (a token is stamped at the end of the forward
    pass that produced it) unless the engine was configured not to record them.
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
