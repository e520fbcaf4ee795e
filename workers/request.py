"""Requests as a mock engine receives them (the record of their life is ``kvemu.records.EngineRecord``)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvemu.transfer import KvTransfer

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
    kv_hold: bool = False
    """Disaggregated prefill leg: once its first token is sampled it completes, but its blocks stay held
    (in use, shareable as a prefix) until ``VllmEngineCore.release_kv``."""
    kv_transfer: KvTransfer | None = None
    """Disaggregated decode leg: its prompt's KV comes from a prefill rank. The engine reserves blocks for the
    prompt (less what it has cached), waits the transfer, and then decodes it without computing the prompt."""
