"""From vLLM wire events to the router's event model, with Dynamo's conversion rules.

Local hashes are recomputed from each block's ``token_ids`` (with the LoRA seed and multimodal keys),
the engine's block hash becomes the external hash and ``medium`` picks the storage tier. Non-main KV groups are
dropped as Dynamo drops them, except a hybrid model's groups whose kind the router can judge (full attention,
sliding window, state; vLLM >= 0.22 names the kind): their blocks come tagged with the group unless it is a
full-attention group 0 (``kvemu.group_index``), so the router scores a hit only when every group has it (with
vLLM 0.20/0.21, whose events name no kind, the kinds come from the engine's ``Register.kv_groups``); so do
removals of any group but 0 (vLLM's ``BlockRemoved`` names only the group). A block-size mismatch is a loud,
typed error — never a silent zero-match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from kvemu.errors import KvCacheEventError
from kvemu.group_index import group_tag, group_target
from kvemu.router_events import AllCleared, BlocksRemoved, BlocksStored, RouterEvent, StorageTier
from kvemu.hashing import local_block_hashes, mm_hash_from_identifier
from kvemu.kv_events import BlockRemoved, BlockStored, KvEvent

__all__ = ["BlockSizeMismatch", "MissingTokens", "medium_to_tier", "convert_event", "is_chain", "MAIN_GROUP_KINDS"]

MAIN_GROUP_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})

_TIERS = {
    "GPU": StorageTier.DEVICE,
    "DEVICE": StorageTier.DEVICE,
    "CPU": StorageTier.HOST_PINNED,
    "CPU_PINNED": StorageTier.HOST_PINNED,
    "CPU_TIER1": StorageTier.HOST_PINNED,
    "CPU_TIER2": StorageTier.DISK,
    "DISK": StorageTier.DISK,
    "NVME": StorageTier.DISK,
    "STORAGE": StorageTier.DISK,
    "EXTERNAL": StorageTier.EXTERNAL,
    "NETWORK": StorageTier.EXTERNAL,
    "REMOTE": StorageTier.EXTERNAL,
    "SHARED": StorageTier.EXTERNAL,
}


class BlockSizeMismatch(KvCacheEventError):
    """The engine's block size differs from the router's: its blocks can never match a query."""


class MissingTokens(KvCacheEventError):
    """A stored event lacks the token ids of its blocks, so their local hashes cannot be computed."""


def medium_to_tier(medium: str | None) -> StorageTier:
    """Dynamo's medium → tier mapping (unknown or absent media count as device)."""
    if medium is None:
        return StorageTier.DEVICE
    return _TIERS.get(medium.upper(), StorageTier.DEVICE)


GroupKinds = Sequence[tuple[str, int | None]]
"""A hybrid engine's (``kv_cache_spec_kind``, sliding window) per ``group_idx``, known from its engine config."""


def _kind(ev: BlockStored | BlockRemoved, groups: GroupKinds | None) -> tuple[str | None, int | None]:
    """The event's group kind and window: as it names them, else from ``groups`` (vLLM 0.20/0.21 name no kind)."""
    kind = getattr(ev, "kv_cache_spec_kind", None)
    if kind is not None:
        return kind, getattr(ev, "kv_cache_spec_sliding_window", None)
    g = ev.group_idx
    if groups is not None and g is not None and 0 <= g < len(groups):
        return groups[g]
    return None, None


def _is_main_group(ev: BlockStored | BlockRemoved, groups: GroupKinds | None = None) -> bool:
    kind = _kind(ev, groups)[0]
    if kind is not None:
        return kind in MAIN_GROUP_KINDS
    return not ev.group_idx


def _group_stored(ev: BlockStored, worker_id: int, dp_rank: int, block_size: int, event_id: int,
                  groups: GroupKinds | None = None) -> RouterEvent | None:
    """A hybrid model's sliding-window or state group's stored blocks, tagged with the group and the blocks a hit
    needs before its end (``kvemu.group_index``); None (dropped, as Dynamo drops them) for a kind the router cannot
    judge (no kind before vLLM 0.22 and no ``groups`` known, chunked local attention...)."""
    kind, window = _kind(ev, groups)
    target = group_target(kind, window, ev.block_size) if kind is not None else -1
    if target <= 0 or not ev.block_hashes:
        return None
    if ev.block_size != block_size:
        raise BlockSizeMismatch(
            f"worker {worker_id} rank {dp_rank} sent blocks of {ev.block_size} tokens but the router uses block_size "
            f"{block_size}; its {len(ev.block_hashes)} blocks were not indexed (configure both the same)",
            worker_id=worker_id, dp_rank=dp_rank)
    tag = group_tag(ev.group_idx or 0, target)
    return RouterEvent(worker_id=worker_id, dp_rank=dp_rank, data=BlocksStored([h | tag for h in ev.block_hashes], []),
                       tier=medium_to_tier(ev.medium), event_id=event_id)


def _mm_hashes(extra_keys: Any, n_blocks: int) -> dict[int, list[int]] | None:
    """Multimodal hashes per block: 64-hex identifiers (optionally paired with an offset) in extra_keys."""
    if not extra_keys:
        return None
    out: dict[int, list[int]] = {}
    for i, keys in enumerate(extra_keys[:n_blocks]):
        if not keys:
            continue
        found = []
        for key in keys if isinstance(keys, (list, tuple)) else (keys,):
            ident = key[0] if isinstance(key, (list, tuple)) and key else key
            if isinstance(ident, str) and len(ident) == 64:
                try:
                    int(ident, 16)
                except ValueError:
                    continue
                found.append(mm_hash_from_identifier(ident))
        if found:
            out[i] = found
    return out or None


def is_chain(hashes: list[int], parent: int | None) -> bool:
    """A stored run Dynamo indexes: no hash repeated, the parent not among them."""
    return len(set(hashes)) == len(hashes) and (parent is None or parent not in hashes)


def convert_event(
    ev: KvEvent,
    *,
    worker_id: int,
    dp_rank: int,
    block_size: int,
    event_id: int = 0,
    eagle: bool = False,
    groups: GroupKinds | None = None,
) -> RouterEvent | None:
    """The router event for one wire event, or ``None`` when Dynamo would drop it (non-main group,
    repeated hashes). Raises ``BlockSizeMismatch`` / ``MissingTokens`` for stores it cannot use. ``groups``: a
    hybrid engine's group kinds, for events that do not name theirs."""
    t = type(ev)
    if t is BlockStored:
        if not _is_main_group(ev, groups):  # type: ignore[arg-type]
            return _group_stored(ev, worker_id, dp_rank, block_size, event_id, groups)  # type: ignore[arg-type]
        hashes = ev.block_hashes  # type: ignore[union-attr]
        n = len(hashes)
        parent = ev.parent_block_hash  # type: ignore[union-attr]
        if not is_chain(hashes, parent):
            return None
        if ev.block_size != block_size:  # type: ignore[union-attr]
            raise BlockSizeMismatch(
                f"worker {worker_id} rank {dp_rank} sent blocks of {ev.block_size} tokens but the router "  # type: ignore[union-attr]
                f"uses block_size {block_size}; its {n} blocks were not indexed (configure both the same)",
                worker_id=worker_id, dp_rank=dp_rank,
            )
        tokens = ev.token_ids  # type: ignore[union-attr]
        needed = n * block_size + (1 if eagle else 0)
        if len(tokens) < needed:
            raise MissingTokens(
                f"worker {worker_id} rank {dp_rank}: stored event has {len(tokens)} token ids for {n} blocks "
                f"of {block_size}; enable token ids in KV events",
                worker_id=worker_id, dp_rank=dp_rank,
            )
        locs = local_block_hashes(
            tokens if len(tokens) == needed else tokens[:needed],
            block_size,
            lora_name=ev.lora_name,  # type: ignore[union-attr]
            block_mm_hashes=_mm_hashes(ev.extra_keys, n),  # type: ignore[union-attr]
            eagle=eagle,
        )
        if ev.group_idx:  # type: ignore[union-attr]  # a hybrid model's other full-attention group: tagged
            tag = group_tag(ev.group_idx, 0)  # type: ignore[union-attr]
            hashes = [h | tag for h in hashes]
        return RouterEvent(
            worker_id=worker_id,
            dp_rank=dp_rank,
            data=BlocksStored(hashes, locs, parent),
            tier=medium_to_tier(ev.medium),  # type: ignore[union-attr]
            event_id=event_id,
        )
    if t is BlockRemoved:
        removed = cast(BlockRemoved, ev)
        if not _is_main_group(removed):  # a hybrid model's other group: its blocks tagged with it (kvemu.group_index)
            tag = group_tag(removed.group_idx or 0, 0)
            return RouterEvent(worker_id=worker_id, dp_rank=dp_rank,
                               data=BlocksRemoved([h | tag for h in removed.block_hashes]),
                               tier=medium_to_tier(removed.medium), event_id=event_id)
        return RouterEvent(
            worker_id=worker_id,
            dp_rank=dp_rank,
            data=BlocksRemoved(list(ev.block_hashes)),  # type: ignore[union-attr]
            tier=medium_to_tier(ev.medium),  # type: ignore[union-attr]
            event_id=event_id,
        )
    return RouterEvent(worker_id=worker_id, dp_rank=dp_rank, data=AllCleared(), event_id=event_id)
