"""Host-memory KV tier of one DP rank (vLLM's CPU offloading; the reference's ``native_host_offload``), sans-IO.

* Stores are write-through: the prompt blocks a pass fills, per request (a *cohort*, less what the host holds
  or is receiving), are submitted at the pass's end to a device-to-host lane and become *resident* when
  their copy ends. A cohort is admitted whole: it takes its room at submission, evicting the least recently
  used resident blocks that no load pins (one recency *epoch* per completed store or load, ties by hash
  value read as a signed 64-bit integer, as the reference orders them); a cohort that cannot fit waits for the next pass boundary (one larger than the tier never fits
  and is dropped).
* A GPU block whose store is still in flight cannot be evicted, nor its request preempted: a pass that evicts
  one, or preempts a request holding one, starts only when the store ends (``fence_ns``).
* A waiting request whose GPU prefix is followed by resident host blocks loads them (host-to-device lane)
  before it is admitted with them cached (``lookup`` / ``load``); one that meets a block still being
  stored waits for that store. The scheduler makes the request hold its GPU prefix and the loaded blocks'
  GPU destinations from the load's start (``workers.vllm.scheduler``).

Transfers of ``n`` blocks take ``latency_to_first_byte_ms + n x block bytes / bandwidth`` on a first-in,
first-out lane per direction (a bandwidth of 0 is instantaneous). Stores and evictions are logged into the
GPU pool's KV log as ``HOST_STORED`` / ``HOST_REMOVED`` entries (medium ``CPU`` on the wire).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from workers.blocks import HOST_REMOVED, HOST_STORED, BlockPool, TokenSource
from workers.config import HostOffloadConfig

__all__ = ["HostTier", "HOST_STORED", "HOST_REMOVED"]  # the log kinds live with the pool's (workers.blocks)
_I64_LIMIT = 1 << 63
_TWO_64 = 1 << 64


class StagedSource(TokenSource, Protocol):
    """A request whose prompt blocks are staged for storing (``workers.sequence.SeqState``): a ``TokenSource``
    that also has the sequence hashes of its blocks."""

    hashes: list[int]
    rid: str


class HostTier:
    """Resident and in-flight host blocks, host LRU, and the two transfer lanes of one rank."""

    __slots__ = ("capacity", "pool", "resident", "pending", "pins", "staged", "stores", "stored_blocks",
                 "loaded_blocks", "evicted_blocks", "_d2h_ns", "_h2d_ns", "_latency_ns", "_d2h_tail", "_h2d_tail",
                 "_epoch", "_lru")

    def __init__(self, config: HostOffloadConfig, block_size: int, bytes_per_token: int, pool: BlockPool) -> None:
        self.capacity = config.num_host_blocks
        self.pool = pool
        """The GPU pool whose KV log receives the host tier's entries."""
        block_bytes = block_size * bytes_per_token
        # ns per block: bytes / (GB/s x 1e9) s = bytes / GB/s ns
        self._d2h_ns = block_bytes / config.d2h_bandwidth_gbps if config.d2h_bandwidth_gbps else 0.0
        self._h2d_ns = block_bytes / config.h2d_bandwidth_gbps if config.h2d_bandwidth_gbps else 0.0
        self._latency_ns = config.latency_to_first_byte_ms * 1e6
        self._d2h_tail = self._h2d_tail = 0
        self.resident: dict[int, int] = {}
        """Sequence hash -> recency epoch of the blocks the host holds."""
        self.pending: dict[int, int] = {}
        """Sequence hash -> end of its store, for blocks being copied to the host (their room is taken)."""
        self.pins: dict[int, int] = {}
        """Sequence hash -> loads in flight reading it (a pinned block is not evicted)."""
        self.staged: dict[StagedSource, tuple[list[int], int]] = {}
        """Cohorts filled by the pass being scheduled (or not yet admitted): request -> (hashes, first index)."""
        self.stores: deque[tuple[int, list[int], int | None, StagedSource, int]] = deque()
        """Stores in flight, in lane order: (end, hashes, parent, source, first block index)."""
        self._epoch = 0
        self._lru: list[tuple[int, int, int]] = []  # (epoch, hash as i64, hash), lazily pruned
        self.stored_blocks = 0
        self.loaded_blocks = 0
        self.evicted_blocks = 0

    # ---------------------------------------------------------------- stores

    def stage(self, source: StagedSource, hashes: Sequence[int], lo: int, hi: int) -> None:
        """Prompt blocks ``lo .. hi-1`` of ``source`` became full in the pass being scheduled."""
        got = self.staged.get(source)
        if got is None:
            self.staged[source] = (list(hashes[lo:hi]), lo)
        else:
            got[0].extend(hashes[got[1] + len(got[0]):hi])

    def submit(self, now_ns: int) -> None:
        """End of a pass: stores that ended are applied, then the staged cohorts are admitted in order."""
        self.poll(now_ns)
        if not self.staged:
            return
        staged, self.staged = self.staged, {}
        resident, pending = self.resident, self.pending
        for source, (hashes, first) in staged.items():
            keep = [i for i, h in enumerate(hashes) if h not in resident and h not in pending]
            if not keep:
                continue
            n = len(keep)
            if n > self.capacity:
                continue  # can never fit (the reference retries it forever)
            over = len(resident) + len(pending) + n - self.capacity
            if over > 0 and not self._evict(over, hashes):
                self.staged[source] = (hashes, first)  # retried at the next pass boundary
                continue
            lo = keep[0]  # one store per contiguous run of the cohort
            runs: list[tuple[int, int]] = []
            for a, b in zip(keep, keep[1:] + [-1]):
                if b != a + 1:
                    runs.append((lo, a + 1))
                    lo = b
            for lo, hi in runs:
                run = hashes[lo:hi]
                start = max(self._d2h_tail, now_ns)
                end = start + round(self._latency_ns + len(run) * self._d2h_ns)
                self._d2h_tail = end
                pending.update(dict.fromkeys(run, end))
                idx = first + lo
                parent = hashes[lo - 1] if lo else (source.hashes[idx - 1] if idx else None)
                self.stores.append((end, run, parent, source, idx))

    def _evict(self, n: int, cohort: Sequence[int]) -> bool:
        """Evict ``n`` resident blocks, neither pinned nor in ``cohort`` (the store being admitted), least
        recent first (ties by hash); False (nothing done) if fewer."""
        resident, pins, lru = self.resident, self.pins, self._lru
        kept = {h for h in cohort if h in resident and h not in pins}
        if len(resident) - len(pins) - len(kept) < n:  # pinned blocks are resident
            return False
        victims: list[int] = []
        skipped: list[tuple[int, int, int]] = []
        while len(victims) < n:
            entry = heapq.heappop(lru)
            h = entry[2]
            if resident.get(h) != entry[0]:
                continue  # touched again, or gone
            if h in pins or h in kept:
                skipped.append(entry)
                continue
            victims.append(h)
            del resident[h]
        for entry in skipped:
            heapq.heappush(lru, entry)
        self.evicted_blocks += n
        self.pool.log.append((HOST_REMOVED, victims))
        return True

    def poll(self, now_ns: int) -> None:
        """Stores that ended by ``now_ns`` make their blocks resident (one epoch each) and are logged."""
        stores = self.stores
        while stores and stores[0][0] <= now_ns:
            end, run, parent, source, first = stores.popleft()
            self._epoch += 1
            self._touch(run)
            pending = self.pending
            for h in run:
                del pending[h]
            self.stored_blocks += len(run)
            self.pool.log.append((HOST_STORED, run, parent, source, first))

    def _touch(self, hashes: Sequence[int]) -> None:
        epoch = self._epoch
        resident, lru = self.resident, self._lru
        for h in hashes:
            resident[h] = epoch
            heapq.heappush(lru, (epoch, h - _TWO_64 if h >= _I64_LIMIT else h, h))

    def touch_prompt(self, hashes: Sequence[int], n: int) -> None:
        """A lookup of a prompt whose first ``n`` blocks are ``hashes[:n]``: its resident unpinned blocks are
        used again, last block first, one epoch each (so its first block is the most recent)."""
        resident, pins, lru = self.resident, self.pins, self._lru
        epoch = self._epoch
        for i in range(n - 1, -1, -1):
            h = hashes[i]
            if h in resident and h not in pins:
                epoch += 1
                resident[h] = epoch
                heapq.heappush(lru, (epoch, h - _TWO_64 if h >= _I64_LIMIT else h, h))
        self._epoch = epoch
        if len(lru) > 4 * len(resident) + 4096:  # drop the stale entries touches leave behind
            self._lru = [(e, h - _TWO_64 if h >= _I64_LIMIT else h, h) for h, e in resident.items()]
            heapq.heapify(self._lru)

    def fence_ns(self, victims: Sequence[int]) -> int:
        """When the last store of these evicted GPU blocks ends (0: none is being stored)."""
        get = self.pending.get
        return max([get(h, 0) for h in victims], default=0)

    @property
    def busy(self) -> bool:
        """Whether stores are in flight or waiting to be admitted."""
        return bool(self.stores or self.staged)

    # ----------------------------------------------------------------- loads

    def lookup(self, hashes: Sequence[int], lo: int, hi: int) -> tuple[int, int]:
        """Resident blocks contiguous from ``hashes[lo]`` (before ``hi``), and the end of a store that a block
        right after them awaits (0: none; the request should wait for it)."""
        resident = self.resident
        n = lo
        while n < hi and hashes[n] in resident:
            n += 1
        wait = self.pending.get(hashes[n], 0) if n < hi else 0
        return n - lo, wait

    def load(self, hashes: Sequence[int], now_ns: int) -> int:
        """Start loading these resident blocks to the GPU (pinned meanwhile); returns when the load ends."""
        pins = self.pins
        for h in hashes:
            pins[h] = pins.get(h, 0) + 1
        start = max(self._h2d_tail, now_ns)
        end = start + round(self._latency_ns + len(hashes) * self._h2d_ns)
        self._h2d_tail = end
        self.loaded_blocks += len(hashes)
        return end

    def loaded(self, hashes: Sequence[int]) -> None:
        """A load ended: its blocks are unpinned and count as just used."""
        pins = self.pins
        for h in hashes:
            left = pins[h] - 1
            if left:
                pins[h] = left
            else:
                del pins[h]
        self._epoch += 1
        self._touch(hashes)

    def check(self) -> None:
        """Assert the tier's invariants (tests)."""
        assert len(self.resident) + len(self.pending) <= self.capacity, (len(self.resident), len(self.pending))
        assert self.resident.keys().isdisjoint(self.pending)
        assert all(h in self.resident for h in self.pins)
        assert sum(len(s[1]) for s in self.stores) == len(self.pending)
