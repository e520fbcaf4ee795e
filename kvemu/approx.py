"""Approximate index for engines that publish no KV events: learn from the router's own decisions.

Every routed request's prompt blocks are recorded under the chosen rank with a TTL (refreshed when a
later request routes the same blocks there). Expired blocks are dropped lazily at the injected clock's
time; past ``max_tree_size`` entries the soonest-expiring (deepest first on ties) go until 80 % remain.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvemu.clock import Clock, check_deadline, seconds_to_ns
from kvemu.errors import BlockNotFound, InvalidArgument
from kvemu.index import PrefixIndex, WorkerKey

__all__ = ["ApproxIndex"]


class ApproxIndex:
    """A ``PrefixIndex`` fed by routing decisions, with per-(rank, block) expiry on a given clock."""

    def __init__(
        self,
        clock: Clock,
        *,
        ttl_secs: float = 120.0,
        max_tree_size: int = 2**20,
        prune_target_ratio: float = 0.8,
    ) -> None:
        if not ttl_secs > 0:
            raise InvalidArgument(f"ttl_secs must be > 0, got {ttl_secs!r}", field="ttl_secs")
        if max_tree_size < 1:
            raise InvalidArgument(f"max_tree_size must be >= 1, got {max_tree_size!r}", field="max_tree_size")
        if not 0 < prune_target_ratio <= 1:
            raise InvalidArgument(f"prune_target_ratio must be in (0, 1], got {prune_target_ratio!r}",
                                  field="prune_target_ratio")
        self.clock = clock
        self.ttl_ns = seconds_to_ns(ttl_secs)
        self.max_tree_size = max_tree_size
        self.prune_target = int(max_tree_size * prune_target_ratio)
        self.index = PrefixIndex()
        self._expiry: dict[tuple[int, int, int], int] = {}  # (worker, rank, seq hash) -> expiry ns
        self._heap: list[tuple[int, int, int, int, int, int]] = []  # (expiry, -depth, n, worker, rank, seq)
        self._pushes = 0
        self.expired_blocks = 0
        self.pruned_blocks = 0

    def record(self, worker_id: int, dp_rank: int, local_hashes: Sequence[int], seq_hashes: Sequence[int]) -> None:
        """Remember that this rank now caches the request's prompt blocks (refreshing their TTL)."""
        now = self.clock.now_ns()
        self.expire(now)
        n = len(seq_hashes)
        if len(local_hashes) != n:
            raise InvalidArgument(f"record: {len(local_hashes)} local hashes but {n} sequence hashes", field="local_hashes",
                                  worker_id=worker_id, dp_rank=dp_rank)
        if not n:
            return
        expiry = check_deadline(now, self.ttl_ns, "approximate index TTL")
        index = self.index
        held = self._held_prefix(worker_id, dp_rank, seq_hashes)
        if held < n:
            index.store(
                worker_id,
                local_hashes[held:],
                seq_hashes[held:],
                parent_hash=seq_hashes[held - 1] if held else None,
                dp_rank=dp_rank,
            )
        table = self._expiry
        heap = self._heap
        for depth, seq in enumerate(seq_hashes):
            table[(worker_id, dp_rank, seq)] = expiry
            self._pushes += 1
            heapq.heappush(heap, (expiry, -depth, self._pushes, worker_id, dp_rank, seq))
        if index.current_size > self.max_tree_size:
            self._prune()

    def find_matches(self, local_hashes: Sequence[int], early_exit: bool = False) -> dict[WorkerKey, int]:
        """Overlap depths after dropping what expired by now."""
        self.expire(self.clock.now_ns())
        return self.index.find_matches(local_hashes, early_exit)

    def expire(self, now_ns: int | None = None) -> int:
        """Drop every block whose TTL ran out by ``now_ns`` (default: the clock); returns how many."""
        now = self.clock.now_ns() if now_ns is None else now_ns
        heap = self._heap
        dropped = 0
        while heap and heap[0][0] <= now:
            dropped += self._pop()
        self.expired_blocks += dropped
        return dropped

    def remove_worker(self, worker_id: int) -> None:
        """Forget a worker's blocks (and their expiry bookkeeping)."""
        self.index.remove_worker(worker_id)
        self._expiry = {k: v for k, v in self._expiry.items() if k[0] != worker_id}

    def clear_all_blocks(self, worker_id: int) -> None:
        """Drop a worker's blocks but keep it known."""
        self.index.clear_all_blocks(worker_id)
        self._expiry = {k: v for k, v in self._expiry.items() if k[0] != worker_id}

    def _held_prefix(self, worker_id: int, dp_rank: int, seq_hashes: Sequence[int]) -> int:
        holds = self.index.holds
        lo, hi = 0, len(seq_hashes)
        while lo < hi:  # a rank's blocks are prefix-closed, so binary search works
            mid = (lo + hi) >> 1
            if holds(worker_id, seq_hashes[mid], dp_rank):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _pop(self) -> int:
        expiry, _, _, wid, rank, seq = heapq.heappop(self._heap)
        key = (wid, rank, seq)
        if self._expiry.get(key) != expiry:
            return 0  # refreshed or already gone: a stale heap entry
        before = self.index.current_size
        try:
            self.index.remove(wid, (seq,), dp_rank=rank)
        except BlockNotFound:
            pass
        del self._expiry[key]
        return before - self.index.current_size

    def _prune(self) -> None:
        heap = self._heap
        while heap and self.index.current_size > self.prune_target:
            self.pruned_blocks += self._pop()
