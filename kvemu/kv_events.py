"""Version-neutral KV events as vLLM emits them (the payload of one ZeroMQ message).

These are what engines produce and decoders return; ``kvemu.wire.codec`` turns them into the exact
bytes of a given vLLM version and back. Fields are declared in wire order and events are tagged by
class name, so a map-form payload (vLLM ≥ 0.24) decodes straight into them. Block hashes are u64 integers (signed values are
reinterpreted); ``token_ids`` are the tokens of exactly the blocks in the event.
"""

from __future__ import annotations

from typing import final

import msgspec

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KvEvent", "KVEventBatch", "MEDIUM_GPU", "MEDIUM_CPU"]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
"""vLLM's medium for blocks offloaded to host memory (its CPU offloading connector)."""


@final  # decoders and encoders dispatch on the exact class (type(e) is ...)
class BlockStored(msgspec.Struct, frozen=True, kw_only=True, tag=True, gc=False):
    """New full blocks of one request; block k's parent is block k-1, block 0's is ``parent_block_hash``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


@final  # decoders and encoders dispatch on the exact class (type(e) is ...)
class BlockRemoved(msgspec.Struct, frozen=True, kw_only=True, tag=True, gc=False):
    """Evicted blocks (vLLM sends one event per evicted block)."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@final  # decoders and encoders dispatch on the exact class (type(e) is ...)
class AllBlocksCleared(msgspec.Struct, frozen=True, kw_only=True, tag=True, gc=False):
    """The engine reset its prefix cache."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@final  # decoders and encoders dispatch on the exact class (type(e) is ...)
class KVEventBatch(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """All events of one engine step, stamped with wall time (``ts``, float seconds) and the DP rank."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None
