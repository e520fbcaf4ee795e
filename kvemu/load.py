"""Active-load tracking per ``(worker, dp_rank)``: booked requests, their prefill tokens and active blocks.

Blocks are the router's sequence hashes of each request's prompt blocks, reference-counted so that a
prefix shared by live requests counts once. Because sequence hashes name whole prefixes, a rank's active
set is prefix-closed, which lets a projection find a request's already-active blocks by binary search.

One dict holds every active block with the bitmask of the ranks holding it; a rank keeps only its count of
distinct blocks and the few blocks it holds more than once (a prefix shared by its live requests). A
booking of blocks nobody holds, and its free, are then two bulk dict operations per block, not four.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvemu.errors import BookingFailed, InvalidArgument
from kvemu.index import WorkerKey

__all__ = ["RankLoad", "LoadTracker", "LoadProjection", "active_prefix_len"]


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

    __slots__ = ("distinct_blocks", "extra_refs", "active_prefill_tokens", "active_requests", "output_blocks",
                 "prefilling", "bit", "_holders")

    def __init__(self, bit: int, holders: dict[int, int]) -> None:
        self.bit = bit
        """This rank's bit in the tracker's block → holders masks."""
        self._holders = holders
        self.distinct_blocks = 0
        """Active blocks on this rank, each counted once."""
        self.extra_refs: dict[int, int] = {}
        """Blocks this rank holds for more than one live booking: the references beyond the first."""
        self.active_prefill_tokens = 0
        self.active_requests = 0
        self.output_blocks = 0.0
        self.prefilling = 0

    @property
    def block_refs(self) -> dict[int, int]:
        """Every active block of this rank with its reference count (computed: a scan of all active blocks)."""
        bit, extra = self.bit, self.extra_refs
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
        self._free_bits: list[int] = []

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
        if load is None:
            load = self._ranks[key] = RankLoad(self._free_bits.pop() if self._free_bits else 1 << len(self._ranks),
                                               self._holders)
            self._bit_keys[load.bit] = key
        blocks = list(block_ids)
        holders = self._holders
        bit = load.bit
        fresh = dict.fromkeys(blocks, bit)
        if len(fresh) == len(blocks) and holders.keys().isdisjoint(fresh):  # nobody holds any: in bulk
            holders.update(fresh)
            load.distinct_blocks += len(blocks)
        else:
            extra = load.extra_refs
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
        holders = self._holders
        bit = load.bit
        blocks = b.blocks
        extra = load.extra_refs
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
        if b.prefill_tokens:
            load.active_prefill_tokens -= b.prefill_tokens
            load.prefilling -= 1
        load.active_requests -= 1
        load.output_blocks = load.output_blocks - b.output_weight if load.active_requests else 0.0
        return b.key

    def drop_worker(self, worker_id: int) -> list[str]:
        """Free every booking on any rank of ``worker_id``; returns the freed request ids (sorted)."""
        ids = sorted(r for r, b in self._bookings.items() if b.key[0] == worker_id)
        for r in ids:
            self.free(r)
        for key in [k for k in self._ranks if k[0] == worker_id]:
            load = self._ranks.pop(key)
            del self._bit_keys[load.bit]
            self._free_bits.append(load.bit)
        return ids

    def active_prefixes(self, seq_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """For every rank, how many leading blocks of the request are already active there (0 omitted).

        One walk along the request for all ranks: the set of ranks holding block ``i`` only shrinks
        with ``i``, so ranks are settled whenever the holder mask changes.
        """
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
        if load is None:
            return LoadProjection(key[0], key[1], 0, 0.0, len(seq_hashes), 0)
        shared = active_prefix_len(self._holders, load.bit, seq_hashes)
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
