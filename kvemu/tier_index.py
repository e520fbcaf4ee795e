"""Index of a lower KV tier (host, disk, external): which rank holds which block, not which prefix.

A lower tier is consulted past what the faster tiers hold, so the router asks for the blocks a rank holds
contiguously from a given position of the prompt, not from its first block: a host that lost the start of a
chain the GPU still holds keeps counting for the rest. Blocks are identified by the rolling sequence hash of
their path (``kvemu.hashing``); a removal takes out only the blocks it names, and a store under a parent the
index does not know is placed by its own hashes when they are kvemu's sequence hashes (dropped otherwise, as
its path is then unknown).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvemu.hashing import extend_sequence_hashes, sequence_hashes
from kvemu.index import WorkerKey

__all__ = ["TierIndex"]


class TierIndex:
    """Blocks of one lower tier per rank, fed by the same store / remove / clear calls as ``PrefixIndex``."""

    __slots__ = ("_paths", "_holders", "dropped_stores")

    def __init__(self) -> None:
        self._paths: dict[WorkerKey, dict[int, int]] = {}
        """Rank -> the engine's (external) block hash -> the block's path hash."""
        self._holders: dict[int, set[WorkerKey]] = {}
        """Path hash -> ranks holding the block."""
        self.dropped_stores = 0
        """Stores that could not be placed (unknown parent, external hashes)."""

    def store(self, worker_id: int, local_hashes: Sequence[int], block_hashes: Sequence[int],
              parent_hash: int | None = None, dp_rank: int = 0, sequence_hashed: bool = False) -> None:
        key = (worker_id, dp_rank)
        paths = self._paths.setdefault(key, {})
        if parent_hash is None:
            chain = sequence_hashes(local_hashes)
        elif parent_hash in paths:
            chain = extend_sequence_hashes(paths[parent_hash], local_hashes)
        elif sequence_hashed:
            chain = list(block_hashes)
        else:
            self.dropped_stores += 1
            return
        holders = self._holders
        for ext, path in zip(block_hashes, chain):
            old = paths.get(ext)
            if old is not None and old != path:
                self._drop(key, old)
            paths[ext] = path
            holders.setdefault(path, set()).add(key)

    def remove(self, worker_id: int, block_hashes: Sequence[int], dp_rank: int = 0) -> None:
        key = (worker_id, dp_rank)
        paths = self._paths.get(key)
        if paths is None:
            return
        for ext in block_hashes:
            path = paths.pop(ext, None)
            if path is not None:
                self._drop(key, path)

    def clear(self, worker_id: int, dp_rank: int = 0) -> None:
        key = (worker_id, dp_rank)
        for path in self._paths.pop(key, {}).values():
            self._drop(key, path)

    def remove_worker(self, worker_id: int) -> None:
        for key in [k for k in self._paths if k[0] == worker_id]:
            self.clear(*key)

    def _drop(self, key: WorkerKey, path: int) -> None:
        ranks = self._holders.get(path)
        if ranks is not None:
            ranks.discard(key)
            if not ranks:
                del self._holders[path]

    def runs_from(self, paths: Sequence[int], starts: dict[WorkerKey, int]) -> dict[WorkerKey, int]:
        """Per rank of the index, how many blocks of ``paths`` (a prompt's path hashes) it holds contiguously
        from position ``starts[rank]`` (0 for a rank not named); zero omitted."""
        holders = self._holders
        n = len(paths)
        out: dict[WorkerKey, int] = {}
        for key in self._paths:
            i = start = starts.get(key, 0)
            while i < n:
                ranks = holders.get(paths[i])
                if ranks is None or key not in ranks:
                    break
                i += 1
            if i > start:
                out[key] = i - start
        return out

    def find_matches(self, local_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """Blocks of the prompt each rank holds contiguously from its first block (zero omitted)."""
        return self.runs_from(sequence_hashes(local_hashes), {})
