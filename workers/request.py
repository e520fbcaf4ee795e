"""Requests as a mock engine receives them (the record of their life is ``kvemu.RequestRecord``)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["Request"]


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
