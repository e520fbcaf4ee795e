"""Version-neutral KV events as vLLM emits them (the payload of one ZeroMQ message).

These are what engines produce and decoders return; ``kvemu.wire.codec`` turns them into the exact
bytes of a given vLLM version and back. Fields are declared in wire order and events are tagged by
class name, so a map-form payload (vLLM ≥ 0.24) decodes straight into them. Block hashes are u64 integers (signed values are
reinterpreted); ``token_ids`` are the tokens of exactly the blocks in the event.
"""

from __future__ import annotations

from typing import Annotated, Any, final

import msgspec
from msgspec import Meta

from kvemu.limits import (MAX_ID_CHARS, MAX_NAME_CHARS, MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, I64, Finite, Rank,
                          WireInt)

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KvEvent", "KVEventBatch", "MEDIUM_GPU", "MEDIUM_CPU",
           "MAX_EVENT_BLOCKS", "MAX_EVENT_TOKENS", "MAX_BATCH_EVENTS", "Hash", "Hashes", "EventTokens", "Label",
           "LoraName", "BlockSize", "GroupIdx", "Window", "ExtraKeys", "Stamp"]

MAX_EVENT_BLOCKS = MAX_PROMPT_TOKENS + MAX_OUTPUT_TOKENS
"""Most blocks one event names (one request's blocks, one token each at the extreme)."""
MAX_EVENT_TOKENS = MAX_PROMPT_TOKENS + MAX_OUTPUT_TOKENS
"""Most tokens one event carries (one request's)."""
MAX_BATCH_EVENTS = 1 << 22
"""Most events one batch carries (vLLM sends one per evicted block)."""
Hash = WireInt
"""A block hash: u64, or the signed reinterpretation some releases send (decoders make it u64)."""
Hashes = Annotated[list[Hash], Meta(max_length=MAX_EVENT_BLOCKS)]
"""An event's block hashes, in chain order."""
EventTokens = Annotated[list[WireInt], Meta(max_length=MAX_EVENT_TOKENS)]
"""The token ids of an event's blocks."""
Label = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
"""A short name vLLM attaches to blocks: a medium, a cache spec kind, a locality or an ownership."""
LoraName = Annotated[str, Meta(max_length=MAX_ID_CHARS)]
"""A LoRA name or a session id (a client's ids' bound)."""
BlockSize = Annotated[int, Meta(ge=1, le=1 << 16)]
"""Tokens per block."""
GroupIdx = Annotated[int, Meta(ge=0, le=1 << 16)]
"""A KV cache group's index (hybrid models)."""
Window = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
"""A sliding-window cache spec's window, in tokens."""
ExtraKeys = Annotated[list[Any], Meta(max_length=MAX_EVENT_BLOCKS)]
"""Extra hash keys per block (multimodal hashes, cache salt), as vLLM sends them."""
Stamp = Finite
"""A batch's wall time (float seconds): any finite value, as vLLM's clock gives it."""

MEDIUM_GPU = "GPU"
"""vLLM's medium for blocks in GPU memory (the default)."""
MEDIUM_CPU = "CPU"
"""vLLM's medium for blocks offloaded to host memory (its CPU offloading connector)."""


@final  # decoders and encoders dispatch on the exact class (type(e) is ...)
class BlockStored(msgspec.Struct, frozen=True, kw_only=True, tag=True, gc=False):
    """New full blocks of one request; block k's parent is block k-1, block 0's is ``parent_block_hash``."""

    block_hashes: Hashes
    parent_block_hash: Hash | None
    token_ids: EventTokens
    block_size: BlockSize
    lora_id: I64 | None = None
    medium: Label | None = MEDIUM_GPU
    lora_name: LoraName | None = None
    extra_keys: ExtraKeys | None = None
    group_idx: GroupIdx | None = None
    kv_cache_spec_kind: Label | None = None
    kv_cache_spec_sliding_window: Window | None = None
    locality: Label | None = None
    ownership: Label | None = None
    session_id: LoraName | None = None
    lookahead_token_ids: EventTokens | None = None


@final  # decoders and encoders dispatch on the exact class (type(e) is ...)
class BlockRemoved(msgspec.Struct, frozen=True, kw_only=True, tag=True, gc=False):
    """Evicted blocks (vLLM sends one event per evicted block)."""

    block_hashes: Hashes
    medium: Label | None = MEDIUM_GPU
    group_idx: GroupIdx | None = None
    locality: Label | None = None
    ownership: Label | None = None


@final  # decoders and encoders dispatch on the exact class (type(e) is ...)
class AllBlocksCleared(msgspec.Struct, frozen=True, kw_only=True, tag=True, gc=False):
    """The engine reset its prefix cache."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
"""One event of a batch."""


@final  # decoders and encoders dispatch on the exact class (type(e) is ...)
class KVEventBatch(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """All events of one engine step, stamped with wall time (``ts``, float seconds) and the DP rank."""

    ts: Stamp
    events: Annotated[list[KvEvent], Meta(max_length=MAX_BATCH_EVENTS)]
    data_parallel_rank: Rank | None = None
