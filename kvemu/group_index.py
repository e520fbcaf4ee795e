"""The router's view of a hybrid model's KV cache groups (engines with ``kv_groups``; vLLM's hybrid KV cache manager).

Group 0's events carry the plain block hashes, as any engine's. Every other group's carry *tagged* hashes:
``hash | (tag << 64)`` with ``tag = (group_idx + 1) | (target << TARGET_SHIFT)``, ``target`` being the blocks a hit
needs right before its end in that group: 0 for full attention (the whole prefix), ``ceil((window - 1) /
block_size)`` for a sliding window, 1 for a state group's checkpoint. A sliding-window or state group's stores come
tagged even in group 0 (their kind says so); removals name only the group (vLLM's ``BlockRemoved`` has no kind).

Per rank, one full-attention group is *main*: its blocks live in the prefix index (``kvemu.index``), which scores
prefixes as for any engine (group 0 when it is full attention, else the first full-attention group seen). Every
other group's blocks live here, as flat sets of hashes per rank and group: a sliding-window group frees its oldest
blocks first, so its cached blocks are not prefixes (the tree's cascading removals would drop the rest), and a
second full-attention group evicts in its own order. A rank's overlap is then what its engine would find (vLLM's
fixed point, ``workers.vllm.hybrid``): the largest block count within the main group's prefix that every group
accepts. It never exceeds the prefix index's match, so a hybrid rank is scored a hit only when every group has it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["GroupBlocks", "TARGET_SHIFT", "group_tag", "group_target", "is_tagged", "group_of", "target_of"]

TARGET_SHIFT = 20
_U64 = (1 << 64) - 1
WorkerKey = tuple[int, int]


def group_tag(group_idx: int, target: int) -> int:
    """The bits above 64 that mark a block of a non-main group."""
    return ((group_idx + 1) | (target << TARGET_SHIFT)) << 64


def group_target(kind: str, window: int | None, block_size: int) -> int:
    """Blocks right before a hit point a group needs (0: the whole prefix, full attention), by
    ``kv_cache_spec_kind``; -1 for a kind the router cannot judge."""
    if kind in ("full_attention", "mla_attention", "sink_full_attention"):
        return 0
    if kind in ("sliding_window", "sliding_window_mla") and window is not None and window >= 2:
        return -(-(window - 1) // block_size)
    if kind == "mamba":
        return 1
    return -1


def target_of(tagged: int) -> int:
    """The hit target a tagged hash carries (0: full attention)."""
    return tagged >> (64 + TARGET_SHIFT)


def is_tagged(block_hash: int) -> bool:
    return block_hash > _U64


def group_of(tagged: int) -> int:
    """The ``group_idx`` a tagged hash names."""
    return ((tagged >> 64) & ((1 << TARGET_SHIFT) - 1)) - 1


class GroupBlocks:
    """Per rank and non-main group: the plain hashes of the cached blocks, and the group's hit target."""

    __slots__ = ("held", "main")

    def __init__(self) -> None:
        self.held: dict[WorkerKey, dict[int, tuple[int, set[int]]]] = {}
        """rank -> group_idx -> (target, hashes), every group but the main one."""
        self.main: dict[WorkerKey, int] = {}
        """rank -> its main group (whose blocks are in the prefix index), once known."""

    def store(self, key: WorkerKey, tagged: Sequence[int]) -> None:
        groups = self.held.setdefault(key, {})
        for h in tagged:
            tag = h >> 64
            g = (tag & ((1 << TARGET_SHIFT) - 1)) - 1
            entry = groups.get(g)
            if entry is None:
                entry = groups[g] = (tag >> TARGET_SHIFT, set())
            entry[1].add(h & _U64)

    def sizes(self, key: WorkerKey, main_blocks: int) -> dict[int, int] | None:
        """Blocks the rank holds per ``group_idx`` (the main group's: ``main_blocks``, the prefix index's); None for a
        rank with no other group."""
        groups = self.held.get(key)
        main = self.main.get(key)
        if groups is None and main is None:
            return None
        out = {g: len(entry[1]) for g, entry in (groups or {}).items()}
        if main is not None:
            out[main] = main_blocks
        return dict(sorted(out.items()))

    def knows(self, key: WorkerKey, group_idx: int) -> bool:
        """Whether blocks of this rank's group were stored here (a sliding-window or state group)."""
        groups = self.held.get(key)
        return groups is not None and group_idx in groups

    def remove(self, key: WorkerKey, tagged: Sequence[int]) -> None:
        groups = self.held.get(key)
        if groups is None:
            return
        for h in tagged:
            entry = groups.get(((h >> 64) & ((1 << TARGET_SHIFT) - 1)) - 1)
            if entry is not None:
                entry[1].discard(h & _U64)

    def clear(self, key: WorkerKey) -> None:
        self.held.pop(key, None)
        self.main.pop(key, None)

    def remove_worker(self, worker_id: int) -> None:
        for key in [k for k in self.held if k[0] == worker_id]:
            del self.held[key]
        for key in [k for k in self.main if k[0] == worker_id]:
            del self.main[key]

    def limit(self, matches: dict[WorkerKey, int], seq_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """``matches`` (main-group prefix per rank) cut to what every group of each rank accepts."""
        out: dict[WorkerKey, int] = {}
        for key, k in matches.items():
            groups = self.held.get(key)
            if groups and k:
                k = _fixed_point(groups, seq_hashes, k)
            out[key] = k
        return out


def _fixed_point(groups: dict[int, tuple[int, set[int]]], seq_hashes: Sequence[int], k: int) -> int:
    curr = k
    while curr:
        before = curr
        for target, held in groups.values():
            if not curr:
                break
            if target == 0:  # another full-attention group: its leading run
                run = 0
                while run < curr and seq_hashes[run] in held:
                    run += 1
                curr = run
            else:  # the first run of ``target`` blocks from the right ends the hit; else the run from block 0
                run = 0
                found = -1
                for i in range(curr - 1, -1, -1):
                    if seq_hashes[i] in held:
                        run += 1
                        if run >= target:
                            found = i + run
                            break
                    else:
                        run = 0
                curr = found if found >= 0 else run
        if curr == before:
            break
    return curr
