"""The router's internal KV-event model (what wire decoders produce and indexes consume).

A ``RouterEvent`` says that one ``(worker, dp_rank)`` stored a chain of blocks, removed blocks, or
cleared everything, in one storage tier. ``apply_event`` applies it to a ``PrefixIndex``.
"""

from __future__ import annotations

import enum

import msgspec

from kvemu.index import PrefixIndex

__all__ = ["StorageTier", "BlocksStored", "BlocksRemoved", "AllCleared", "RouterEvent", "apply_event"]


class StorageTier(enum.Enum):
    """Where the cached blocks live; only ``device`` feeds the main prefix index."""

    DEVICE = "device"
    HOST_PINNED = "host_pinned"
    DISK = "disk"
    EXTERNAL = "external"


class BlocksStored(msgspec.Struct, frozen=True, tag="stored"):
    """A chain of blocks; block k's parent is block k-1, block 0's is ``parent_hash`` (None = root).

    ``block_hashes`` are the engine's (external) hashes, ``local_hashes`` the router's hashes of each
    block's tokens, position by position.
    """

    block_hashes: list[int]
    local_hashes: list[int]
    parent_hash: int | None = None


class BlocksRemoved(msgspec.Struct, frozen=True, tag="removed"):
    """Blocks evicted by the engine (external hashes)."""

    block_hashes: list[int]


class AllCleared(msgspec.Struct, frozen=True, tag="cleared"):
    """The rank dropped its whole cache."""


class RouterEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One KV event from one rank of one worker."""

    worker_id: int
    data: BlocksStored | BlocksRemoved | AllCleared
    dp_rank: int = 0
    tier: StorageTier = StorageTier.DEVICE
    event_id: int = 0


def apply_event(index: PrefixIndex, event: RouterEvent) -> None:
    """Apply ``event`` to ``index`` (its tier is the caller's concern); raises ``KvCacheEventError``."""
    data = event.data
    if type(data) is BlocksStored:
        index.store(
            event.worker_id, data.local_hashes, data.block_hashes, parent_hash=data.parent_hash, dp_rank=event.dp_rank
        )
    elif type(data) is BlocksRemoved:
        index.remove(event.worker_id, data.block_hashes, dp_rank=event.dp_rank)
    else:
        index.clear(event.worker_id, event.dp_rank)
