"""Active-load tracking per ``(worker, dp_rank)``: booked requests, their prefill tokens and active blocks.

Blocks are the router's sequence hashes of each request's prompt blocks, reference-counted so that a
prefix shared by live requests counts once. Because sequence hashes name whole prefixes, a rank's active
set is prefix-closed, which lets a projection find a request's already-active blocks by binary search.

One dict holds every active block with the bitmask of the ranks holding it; a rank keeps only its count of
distinct blocks and the few blocks it holds more than once (a prefix shared by its live requests). A
booking of blocks nobody holds, and its free, are then two bulk dict operations per block, not four.

That block state is native when the build has ``kvemu._loadtable`` (``kvemu/_native/loadtable.c``): a
``HolderTable`` of u64 masks for rank bits below 64, booked and released per request in bulk; the dicts here are
its reference and fallback, and a tracker that needs a 65th rank bit moves its state into them once. Block hashes
must be u64s in both (TypeError / OverflowError otherwise, checked before anything changes).
"""

from __future__ import annotations

import importlib
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Final, NamedTuple, Protocol

from kvemu import _build
from kvemu.errors import BookingFailed, InvalidArgument
from kvemu.index import WorkerKey

__all__ = ["RankLoad", "LoadTracker", "LoadProjection", "active_prefix_len"]

_NATIVE_RANKS: Final = 64
"""Rank bits the native table holds (u64 masks); a tracker needing more runs on the dicts."""


class _Table(Protocol):
    """``kvemu._loadtable.HolderTable``: the native block state (see its stub)."""

    def book(self, blocks: list[int], index: int, /) -> int: ...
    def release(self, blocks: list[int], index: int, /) -> int: ...
    def check(self, hashes: Iterable[int], /) -> None: ...
    def active_prefixes(self, hashes: Iterable[int], keys: list[WorkerKey | None], /) -> dict[WorkerKey, int]: ...
    def prefix_len(self, hashes: Iterable[int], index: int, /) -> int: ...
    def block_refs(self, index: int, /) -> dict[int, int]: ...
    def extra_refs(self, index: int, /) -> dict[int, int]: ...
    def masks(self) -> dict[int, int]: ...


def _native_table_type() -> type[_Table] | None:
    """The native table type when kvemu._build says this install may use it (built, fresh, not forced pure)."""
    if not _build.use_native("kvemu._loadtable"):
        return None
    try:
        module = importlib.import_module("kvemu._loadtable")
    except ImportError:
        return None
    table: type[_Table] = module.HolderTable
    return table


_TABLE_TYPE: Final = _native_table_type()


def _u64s(values: Iterable[int]) -> list[int]:
    """``values`` as a list of u64 ints; TypeError / OverflowError (the native table's types) otherwise."""
    return array("Q", values if type(values) is list else list(values)).tolist()


def active_prefix_len(holders: dict[int, int], bit: int, seq_hashes: Sequence[int]) -> int:
    """Length of the longest prefix of ``seq_hashes`` active on the rank whose bit is ``bit`` in the block →
    holders masks (a prefix-closed set)."""
    lo, hi = 0, len(seq_hashes)
    if not hi or not holders.get(seq_hashes[0], 0) & bit:
        return 0
    if holders.get(seq_hashes[hi - 1], 0) & bit:
        return hi
    lo = 1
    hi -= 1
    while lo < hi:  # invariant: seq[lo-1] held, seq[hi] not
        mid = (lo + hi) >> 1
        if holders.get(seq_hashes[mid], 0) & bit:
            lo = mid + 1
        else:
            hi = mid
    return lo


class _Booking:
    __slots__ = ("key", "blocks", "prefill_tokens", "output_weight", "created_ns")

    def __init__(self, key: WorkerKey, blocks: list[int], prefill_tokens: int, created_ns: int) -> None:
        self.key = key
        self.blocks = blocks
        self.prefill_tokens = prefill_tokens
        self.output_weight = 0.0
        self.created_ns = created_ns


class RankLoad:
    """Load of one rank: live requests, prefill backlog and reference-counted active blocks."""

    __slots__ = ("distinct_blocks", "_extra", "active_prefill_tokens", "active_requests", "output_blocks",
                 "prefilling", "bit", "_index", "_holders", "_table")

    def __init__(self, bit: int, holders: dict[int, int], table: _Table | None = None) -> None:
        self.bit = bit
        """This rank's bit in the tracker's block → holders masks."""
        self._index = bit.bit_length() - 1
        self._holders = holders
        self._table = table  # the tracker's native block state, or None: the dicts
        self.distinct_blocks = 0
        """Active blocks on this rank, each counted once."""
        self._extra: dict[int, int] = {}
        self.active_prefill_tokens = 0
        self.active_requests = 0
        self.output_blocks = 0.0
        self.prefilling = 0

    @property
    def extra_refs(self) -> dict[int, int]:
        """Blocks this rank holds for more than one live booking: the references beyond the first (do not
        mutate; a copy when the block state is native)."""
        table = self._table
        return self._extra if table is None else table.extra_refs(self._index)

    @property
    def block_refs(self) -> dict[int, int]:
        """Every active block of this rank with its reference count (computed: a scan of all active blocks)."""
        table = self._table
        if table is not None:
            return table.block_refs(self._index)
        bit, extra = self.bit, self._extra
        return {h: 1 + extra.get(h, 0) for h, mask in self._holders.items() if mask & bit}

    @property
    def active_decode_blocks(self) -> float:
        """Distinct active prompt blocks plus (weighted) output blocks."""
        return self.distinct_blocks + self.output_blocks


class LoadProjection(NamedTuple):
    """A rank's load if a candidate request were added to it (Dynamo's ``WorkerLoadProjection``)."""

    worker_id: int
    dp_rank: int
    active_prefill_tokens: int
    active_decode_blocks: float
    additional_active_blocks: int
    active_requests: int

    @property
    def potential_decode_blocks(self) -> float:
        """Active decode blocks after adding the request's blocks that are not active yet."""
        return self.active_decode_blocks + self.additional_active_blocks


class LoadTracker:
    """Bookings of routed requests on ranks; the router books after a dispatch is accepted."""

    def __init__(self) -> None:
        self._ranks: dict[WorkerKey, RankLoad] = {}
        self._bookings: dict[str, _Booking] = {}
        self._holders: dict[int, int] = {}  # active block -> bitmask of the ranks holding it
        self._bit_keys: dict[int, WorkerKey] = {}  # bit -> rank
        self._index_keys: list[WorkerKey | None] = []  # bit index -> rank (None: free)
        self._free_bits: list[int] = []
        self._table: _Table | None = None if _TABLE_TYPE is None else _TABLE_TYPE()  # None: the dicts

    def _holder_masks(self) -> dict[int, int]:
        """Every active block with the bitmask of the ranks holding it (a copy; for tests)."""
        table = self._table
        return dict(self._holders) if table is None else table.masks()

    def _to_pure(self) -> None:
        """Move the native block state into the dicts (once, when a rank bit beyond the table's is needed)."""
        table = self._table
        if table is None:
            return
        self._holders.update(table.masks())
        for load in self._ranks.values():
            load._extra = table.extra_refs(load._index)
            load._table = None
        self._table = None

    def _new_rank(self, key: WorkerKey) -> RankLoad:
        load = self._ranks[key] = RankLoad(self._free_bits.pop() if self._free_bits else 1 << len(self._ranks),
                                           self._holders, self._table)
        self._bit_keys[load.bit] = key
        index_keys = self._index_keys
        while len(index_keys) <= load._index:
            index_keys.append(None)
        index_keys[load._index] = key
        return load

    def rank(self, key: WorkerKey) -> RankLoad | None:
        """The rank's load, or ``None`` if nothing was ever booked on it."""
        return self._ranks.get(key)

    def ranks(self) -> dict[WorkerKey, RankLoad]:
        """Live view of all rank loads (do not mutate)."""
        return self._ranks

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._bookings

    def __len__(self) -> int:
        return len(self._bookings)

    def booked_rank(self, request_id: str) -> WorkerKey | None:
        """Where a request is booked, or ``None``."""
        b = self._bookings.get(request_id)
        return None if b is None else b.key

    def booked_ns(self, request_id: str) -> int | None:
        """When a request was booked (``now_ns`` given to ``add``), or ``None``."""
        b = self._bookings.get(request_id)
        return None if b is None else b.created_ns

    def add(
        self,
        request_id: str,
        key: WorkerKey,
        block_ids: Sequence[int],
        prefill_tokens: int,
        *,
        now_ns: int = 0,
    ) -> None:
        """Book a request on a rank: acquire its prompt blocks and register its effective prefill tokens.

        A request id may hold one booking; a second raises ``BookingFailed`` and changes nothing.
        """
        if request_id in self._bookings:
            held = self._bookings[request_id].key
            raise BookingFailed(f"request {request_id!r} is already booked on {held}", request_id=request_id,
                                worker_id=held[0], dp_rank=held[1])
        if prefill_tokens < 0:
            raise InvalidArgument(f"request {request_id!r}: prefill_tokens must be >= 0, got {prefill_tokens}",
                                  field="prefill_tokens")
        load = self._ranks.get(key)
        table = self._table
        if table is not None and load is None and not self._free_bits and len(self._ranks) >= _NATIVE_RANKS:
            self._to_pure()
            table = None
        if table is not None:
            blocks = list(block_ids)
            if load is None:  # booked before the rank exists: a bad hash raises with nothing changed
                bit = self._free_bits[-1] if self._free_bits else 1 << len(self._ranks)
                added = table.book(blocks, bit.bit_length() - 1)
                load = self._new_rank(key)
            else:
                added = table.book(blocks, load._index)
            load.distinct_blocks += added
        else:
            blocks = _u64s(block_ids)
            if load is None:
                load = self._new_rank(key)
            holders = self._holders
            bit = load.bit
            fresh = dict.fromkeys(blocks, bit)
            if len(fresh) == len(blocks) and holders.keys().isdisjoint(fresh):  # nobody holds any: in bulk
                holders.update(fresh)
                load.distinct_blocks += len(blocks)
            else:
                extra = load._extra
                for h in blocks:
                    mask = holders.get(h, 0)
                    if mask & bit:
                        extra[h] = extra.get(h, 0) + 1
                    else:
                        holders[h] = mask | bit
                        load.distinct_blocks += 1
        load.active_requests += 1
        if prefill_tokens:
            load.active_prefill_tokens += prefill_tokens
            load.prefilling += 1
        self._bookings[request_id] = _Booking(key, blocks, prefill_tokens, now_ns)

    def mark_prefill_completed(self, request_id: str) -> bool:
        """Drop the request's prefill tokens (first token seen); its blocks stay active. False if unknown."""
        b = self._bookings.get(request_id)
        if b is None or not b.prefill_tokens:
            return False
        load = self._ranks[b.key]
        load.active_prefill_tokens -= b.prefill_tokens
        load.prefilling -= 1
        b.prefill_tokens = 0
        return True

    def add_output_block(self, request_id: str, weight: float = 1.0) -> bool:
        """Count one more generated block (optionally fractional) for the request. False if unknown."""
        b = self._bookings.get(request_id)
        if b is None:
            return False
        b.output_weight += weight
        self._ranks[b.key].output_blocks += weight
        return True

    def free(self, request_id: str) -> WorkerKey | None:
        """Release everything the request holds; returns its rank, or ``None`` if it was not booked."""
        b = self._bookings.pop(request_id, None)
        if b is None:
            return None
        load = self._ranks[b.key]
        blocks = b.blocks
        table = self._table
        if table is not None:
            load.distinct_blocks -= table.release(blocks, load._index)
            self._settle(b, load)
            return b.key
        holders = self._holders
        bit = load.bit
        extra = load._extra
        if (list(map(holders.__getitem__, blocks)).count(bit) == len(blocks)
                and (not extra or extra.keys().isdisjoint(blocks))):  # held by this booking alone: in bulk
            deque(map(holders.__delitem__, blocks), maxlen=0)
            load.distinct_blocks -= len(blocks)
        else:
            for h in blocks:
                c = extra.get(h)
                if c is not None:
                    if c > 1:
                        extra[h] = c - 1
                    else:
                        del extra[h]
                else:
                    mask = holders[h] ^ bit
                    if mask:
                        holders[h] = mask
                    else:
                        del holders[h]
                    load.distinct_blocks -= 1
        self._settle(b, load)
        return b.key

    @staticmethod
    def _settle(b: _Booking, load: RankLoad) -> None:
        """The freed booking's counts off its rank."""
        if b.prefill_tokens:
            load.active_prefill_tokens -= b.prefill_tokens
            load.prefilling -= 1
        load.active_requests -= 1
        load.output_blocks = load.output_blocks - b.output_weight if load.active_requests else 0.0

    def drop_worker(self, worker_id: int) -> list[str]:
        """Free every booking on any rank of ``worker_id``; returns the freed request ids (sorted)."""
        ids = sorted(r for r, b in self._bookings.items() if b.key[0] == worker_id)
        for r in ids:
            self.free(r)
        for key in [k for k in self._ranks if k[0] == worker_id]:
            load = self._ranks.pop(key)
            del self._bit_keys[load.bit]
            self._index_keys[load._index] = None
            self._free_bits.append(load.bit)
        return ids

    def active_prefixes(self, seq_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """For every rank, how many leading blocks of the request are already active there (0 omitted).

        One walk along the request for all ranks: the set of ranks holding block ``i`` only shrinks
        with ``i``, so ranks are settled whenever the holder mask changes.
        """
        table = self._table
        if table is not None:
            return table.active_prefixes(seq_hashes, self._index_keys)
        seq_hashes = _u64s(seq_hashes)
        holders = self._holders
        n = len(seq_hashes)
        if not n or not holders:
            return {}
        active = holders.get(seq_hashes[0], 0)
        if not active:
            return {}
        keys = self._bit_keys
        out: dict[WorkerKey, int] = {}
        i = 1
        while i < n:
            mask = holders.get(seq_hashes[i], 0) & active
            if mask != active:
                gone = active & ~mask
                while gone:
                    low = gone & -gone
                    out[keys[low]] = i
                    gone ^= low
                active = mask
                if not active:
                    return out
            i += 1
        while active:
            low = active & -active
            out[keys[low]] = n
            active ^= low
        return out

    def expire(self, now_ns: int, horizon_ns: int) -> list[str]:
        """Force-free bookings older than ``horizon_ns`` (stale requests); returns their ids, sorted."""
        ids = sorted(r for r, b in self._bookings.items() if now_ns - b.created_ns > horizon_ns)
        for r in ids:
            self.free(r)
        return ids

    def project(self, key: WorkerKey, seq_hashes: Sequence[int]) -> LoadProjection:
        """The rank's load if a request with these prompt sequence hashes were added to it."""
        load = self._ranks.get(key)
        table = self._table
        if load is None:
            if table is not None:
                table.check(seq_hashes)
            else:
                _u64s(seq_hashes)
            return LoadProjection(key[0], key[1], 0, 0.0, len(seq_hashes), 0)
        if table is not None:
            shared = table.prefix_len(seq_hashes, load._index)
        else:
            shared = active_prefix_len(self._holders, load.bit, _u64s(seq_hashes))
        return LoadProjection(
            key[0],
            key[1],
            load.active_prefill_tokens,
            load.active_decode_blocks,
            len(seq_hashes) - shared,
            load.active_requests,
        )

    def potential_loads(self, keys: Iterable[WorkerKey], seq_hashes: Sequence[int]) -> list[LoadProjection]:
        """``project`` for each key, in the given order."""
        return [self.project(k, seq_hashes) for k in keys]
