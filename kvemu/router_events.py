"""The router's internal KV-event model (what wire decoders produce and indexes consume).

A ``RouterEvent`` says that one ``(worker, dp_rank)`` stored a chain of blocks, removed blocks, or
cleared everything, in one storage tier. ``apply_event`` applies it to a ``PrefixIndex`` (or a lower tier's
``TierIndex``).
An ``EventBatch`` is one engine pass's events already in this model (local hashes computed by the
engine, no token ids): what in-memory KV buses carry in virtual time instead of vLLM bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

import msgspec

from kvemu.kv_events import KVEventBatch

__all__ = [
    "StorageTier",
    "BlocksStored",
    "BlocksRemoved",
    "AllCleared",
    "RouterEvent",
    "EventBatch",
    "EngineEvents",
    "BlockIndex",
    "apply_event",
    "wire_event_count",
]


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
    sequence_hashed: bool = False
    """``block_hashes`` are kvemu's rolling sequence hashes of ``local_hashes`` (``kvemu.hashing``), as
    kvemu's own engines hash, so the index takes them as the blocks' identities instead of hashing again."""


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


EventData = BlocksStored | BlocksRemoved | AllCleared


class EventBatch(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's KV events of one engine pass, in the router's model (device tier, then its host tier).

    A ``BlocksRemoved`` here stands for one vLLM ``BlockRemoved`` event per hash, as engines send
    them; counters count it that way, so a batch reads the same as its wire form.
    """

    ts_ns: int
    dp_rank: int
    block_size: int
    events: list[EventData]
    host_events: list[EventData] = []
    """Events of the rank's host tier (``StorageTier.HOST_PINNED``; medium ``CPU`` on the wire)."""


class EngineEvents(Protocol):
    """What an engine hands its KV publisher: one pass's events, in either form on demand."""

    def batch(self) -> KVEventBatch:
        """The vLLM wire structs (with token ids), for encoders."""
        ...

    def router_batch(self) -> EventBatch:
        """The router's model (local hashes, no token ids), for in-memory delivery."""
        ...


def wire_event_count(data: EventData) -> int:
    """How many vLLM events ``data`` stands for (one per removed block)."""
    return len(data.block_hashes) if type(data) is BlocksRemoved else 1


class BlockIndex(Protocol):
    """What ``apply_event`` drives: a ``PrefixIndex`` (device tier) or a ``TierIndex`` (lower tiers)."""

    def store(self, worker_id: int, local_hashes: Sequence[int], block_hashes: Sequence[int], *,
              parent_hash: int | None = None, dp_rank: int = 0, sequence_hashed: bool = False) -> None: ...

    def remove(self, worker_id: int, block_hashes: Sequence[int], *, dp_rank: int = 0) -> None: ...

    def clear(self, worker_id: int, dp_rank: int = 0) -> None: ...


def apply_event(index: BlockIndex, event: RouterEvent) -> None:
    """Apply ``event`` to ``index`` (its tier is the caller's concern); raises ``KvCacheEventError``."""
    data = event.data
    if type(data) is BlocksStored:
        index.store(event.worker_id, data.local_hashes, data.block_hashes, parent_hash=data.parent_hash,
                    dp_rank=event.dp_rank, sequence_hashed=data.sequence_hashed)
    elif type(data) is BlocksRemoved:
        index.remove(event.worker_id, data.block_hashes, dp_rank=event.dp_rank)
    else:
        index.clear(event.worker_id, event.dp_rank)
