"""KV event output of an engine core: per-pass compact logs, turned into event batches on demand.

The block pool logs stores, evictions and resets as small tuples; building the vLLM wire structs (with
the token id lists of stored blocks), or the router-model ``EventBatch`` that in-memory buses carry, is
deferred until a consumer asks, so fast-forwarding through hours of virtual time does not pay for events
nobody reads. Materialising is deterministic and repeatable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvemu.group_index import group_tag, group_target
from kvemu.router_events import AllCleared, BlocksRemoved, BlocksStored, EventBatch, EventData
from kvemu.kv_events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KvEvent
from workers.blocks import CLEARED, HOST_REMOVED, HOST_STORED, REMOVED, STORED

_MEDIUM = {STORED: MEDIUM_GPU, REMOVED: MEDIUM_GPU, HOST_STORED: MEDIUM_CPU, HOST_REMOVED: MEDIUM_CPU}

__all__ = ["PassEvents", "materialize_events", "materialize_batches", "router_events", "NS_PER_S"]

NS_PER_S = 1_000_000_000


class PassEvents:
    """The KV log entries of one pass (or reset) of one rank, stamped with the virtual time they become visible."""

    __slots__ = ("ts_ns", "dp_rank", "entries", "block_size", "groups")

    def __init__(self, ts_ns: int, dp_rank: int, entries: list[tuple], block_size: int,
                 groups: list[tuple[str, int | None]] | None = None) -> None:
        self.ts_ns = ts_ns
        self.dp_rank = dp_rank
        self.entries = entries
        self.block_size = block_size
        self.groups = groups
        """Hybrid KV groups: (``kv_cache_spec_kind``, sliding window) per ``group_idx``; the log's block keys carry
        the group above 64 bits (``workers.vllm.hybrid``). None: one plain group."""

    def batch(self) -> KVEventBatch:
        """This pass's events as one ``KVEventBatch`` (``ts`` in float seconds of virtual time)."""
        return KVEventBatch(
            ts=self.ts_ns / NS_PER_S,
            events=materialize_events(self.entries, self.block_size, self.groups),
            data_parallel_rank=self.dp_rank,
        )

    def router_batch(self) -> EventBatch:
        """This pass's events in the router's model: a stored run with its local hashes, a removal run as one event."""
        entries = self.entries
        if self.groups is not None:
            return EventBatch(ts_ns=self.ts_ns, dp_rank=self.dp_rank, block_size=self.block_size,
                              events=_router_groups(entries, self.groups, self.block_size))
        if not any(e[0] >= HOST_STORED for e in entries):
            return EventBatch(ts_ns=self.ts_ns, dp_rank=self.dp_rank, block_size=self.block_size,
                              events=router_events(entries))
        return EventBatch(ts_ns=self.ts_ns, dp_rank=self.dp_rank, block_size=self.block_size,
                          events=router_events(e for e in entries if e[0] < HOST_STORED),
                          host_events=router_events(e for e in entries if e[0] >= HOST_STORED))

    def block_counts(self) -> tuple[int, int]:
        """(blocks stored, blocks removed) in this pass, without materialising anything."""
        stored = removed = 0
        for e in self.entries:
            if e[0] == STORED:
                stored += len(e[1])
            elif e[0] == REMOVED:
                removed += len(e[1])
        return stored, removed

    def __repr__(self) -> str:
        return f"PassEvents(ts_ns={self.ts_ns}, dp_rank={self.dp_rank}, entries={len(self.entries)})"


def materialize_events(entries: Iterable[tuple], block_size: int,
                       groups: list[tuple[str, int | None]] | None = None) -> list[KvEvent]:
    """Wire structs for compact log entries: one ``BlockStored`` per stored run, one ``BlockRemoved`` per block
    (medium ``GPU``, or ``CPU`` for the host tier's, with the same metadata). With hybrid KV ``groups`` every
    event carries its ``group_idx`` (stores also the group's spec kind and window), as vLLM >= 0.22 sends them."""
    if groups is not None:
        return _walk_groups(entries, block_size, groups)
    return _walk(entries, block_size, True)


_U64 = (1 << 64) - 1


def _router_groups(entries: Iterable[tuple], groups: list[tuple[str, int | None]], block_size: int) -> list[EventData]:
    """Router-model events of a hybrid engine, as ``kvemu.wire.convert`` makes them of its wire events
    (``kvemu.group_index``): group 0's plain if it is full attention, every other group's (and a sliding-window or
    state group 0's stores) tagged; a full-attention group's stores keep their local hashes and parent."""
    tags = [0 if g == 0 and spec == "full_attention" else group_tag(g, group_target(spec, window, block_size))
            for g, (spec, window) in enumerate(groups)]
    out: list[EventData] = []
    for e in entries:
        kind = e[0]
        if kind == REMOVED:
            by_group: dict[int, list[int]] = {}  # one removal per group (each names its group)
            for k in e[1]:
                g = k >> 64
                by_group.setdefault(g, []).append((k & _U64) | group_tag(g, 0) if g else k)
            out += [BlocksRemoved(hashes) for hashes in by_group.values()]
        elif kind == STORED:
            _, keys, parent, source, first = e
            g = keys[0] >> 64
            tag = tags[g]
            if groups[g][0] == "full_attention":
                out.append(BlocksStored([(k & _U64) | tag for k in keys], source.local_hashes(first, first + len(keys)),
                                        None if parent is None else parent & _U64, True))
            else:
                out.append(BlocksStored([(k & _U64) | tag for k in keys], [], None, True))
        elif kind == CLEARED:
            out.append(AllCleared())
    return out


def _walk_groups(entries: Iterable[tuple], block_size: int, groups: list[tuple[str, int | None]]) -> list[KvEvent]:
    """``_walk`` for a hybrid engine: block keys are ``hash + (group_idx << 64)``."""
    out: list[KvEvent] = []
    for e in entries:
        kind = e[0]
        if kind == REMOVED:
            out += [BlockRemoved(block_hashes=[h & _U64], group_idx=h >> 64) for h in e[1]]
        elif kind == STORED:
            _, keys, parent, source, first = e
            g = keys[0] >> 64
            spec, window = groups[g]
            lo = first * block_size
            out.append(BlockStored(
                block_hashes=[h & _U64 for h in keys],
                parent_block_hash=None if parent is None else parent & _U64,
                token_ids=source.token_slice(lo, lo + len(keys) * block_size),
                block_size=block_size,
                group_idx=g,
                kv_cache_spec_kind=spec,
                kv_cache_spec_sliding_window=window,
            ))
        elif kind == CLEARED:
            out.append(AllBlocksCleared())
        else:  # pragma: no cover - a hybrid engine has no host tier
            raise AssertionError(f"unknown KV log entry {e!r}")
    return out


def router_events(entries: Iterable[tuple]) -> list[EventData]:
    """Router-model events for compact log entries (no token ids: the engine knows its local hashes)."""
    return _walk(entries, 0, False)


def _walk(entries: Iterable[tuple], block_size: int, wire: bool) -> list[Any]:
    """The one reading of a compact log, entry by entry: as wire structs (``wire``) or as router-model events."""
    out: list[Any] = []
    append = out.append
    for e in entries:
        kind = e[0]
        if kind == REMOVED or kind == HOST_REMOVED:
            if wire:
                medium = _MEDIUM[kind]
                out += [BlockRemoved(block_hashes=[h], medium=medium) for h in e[1]]
            else:
                append(BlocksRemoved(list(e[1])))
        elif kind == STORED or kind == HOST_STORED:
            _, hashes, parent, source, first = e
            if wire:
                lo = first * block_size
                append(
                    BlockStored(
                        block_hashes=list(hashes),
                        parent_block_hash=parent,
                        token_ids=source.token_slice(lo, lo + len(hashes) * block_size),
                        block_size=block_size,
                        medium=_MEDIUM[kind],
                    )
                )
            else:
                append(BlocksStored(list(hashes), source.local_hashes(first, first + len(hashes)), parent, True))
        elif kind == CLEARED:
            append(AllBlocksCleared() if wire else AllCleared())
        else:  # pragma: no cover - the pool only writes the three kinds
            raise AssertionError(f"unknown KV log entry {e!r}")
    return out


def materialize_batches(passes: Sequence[PassEvents]) -> list[KVEventBatch]:
    """One ``KVEventBatch`` per pass that logged anything, in order."""
    return [p.batch() for p in passes]
