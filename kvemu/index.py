"""The prefix index: which (worker, dp_rank) holds which prompt prefix, fed by KV events.

A path-compressed radix tree over local block hashes. A segment is a run of blocks held by exactly the
same set of ranks, so a ``find_matches`` walk costs one dict lookup and one list comparison per segment
instead of per block. Blocks are identified internally by the rolling sequence hash of their path, which
stays valid when segments split or merge; each rank maps the engine's external hashes onto it.

Semantics follow Dynamo's index: a store under an unknown parent is rejected whole; a removal continues
past unknown hashes and cascades to the rank's descendants of the removed block; a clear is per rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from types import ModuleType
from typing import NamedTuple, cast

from kvemu.blockmap import NATIVE_MAPS, HashMap, HashMapLike, SegMap, SegMapLike
from kvemu.errors import BlockNotFound, InvalidArgument, InvalidBlockSequence, ParentBlockNotFound
from kvemu.hashing import extend_sequence_hashes

__all__ = ["WorkerKey", "PrefixIndex", "StoredChain"]

WorkerKey = tuple[int, int]
"""``(worker_id, dp_rank)``: the unit every piece of router state is keyed by."""


class StoredChain(NamedTuple):
    """One chain of blocks held by a rank, as ``dump`` returns it (replayable through ``store``)."""

    worker_id: int
    dp_rank: int
    parent_hash: int | None
    block_hashes: list[int]
    local_hashes: list[int]


class _Seg:
    """A run of blocks with the same holder set; children are keyed by their first local hash."""

    __slots__ = ("locs", "seqs", "exts", "workers", "children", "parent")

    def __init__(self, locs: list[int], seqs: list[int], exts: list[int], workers: set[int], parent: _Seg | None):
        self.locs = locs
        self.seqs = seqs  # rolling sequence hashes: the blocks' stable identities
        self.exts = exts  # external hash given by the block's first storer
        self.workers = workers  # rank slots holding every block of the run
        self.children: dict[int, _Seg] = {}
        self.parent = parent


def _offset(seqs: list[int], seq: int) -> int:
    """Position of ``seq`` in a run; engines evict from the leaf end, so look there first."""
    return len(seqs) - 1 if seqs[-1] == seq else seqs.index(seq)


def _common_run(a: list[int], start: int, b: list[int], i: int) -> int:
    """How many items of ``a[start:]`` and ``b[i:]`` are equal before the first difference."""
    limit = min(len(a) - start, len(b) - i)
    if a[start : start + limit] == b[i : i + limit]:
        return limit
    m = 0
    while a[start + m] == b[i + m]:
        m += 1
    return m


class PrefixIndex:
    """Prefix index of cached blocks per ``(worker_id, dp_rank)``; synchronous and I/O-free."""

    def __init__(self) -> None:
        self._root = _Seg([], [], [], set(), None)
        self._maps: ModuleType | None = NATIVE_MAPS  # kvemu._blockmap when its tables hold the per-block maps (else dicts)
        self._blocks: SegMapLike[_Seg] = SegMap() if self._maps is None else self._maps.SegMap()  # sequence hash -> segment
        self._slot_of: dict[WorkerKey, int] = {}
        self._keys: list[WorkerKey | None] = []  # slot -> key
        self._lookup: list[HashMapLike | None] = []  # slot -> {external hash -> sequence hash}
        self._xext: list[dict[int, int] | None] = []  # slot -> {sequence hash -> ext} where ext != canonical
        self._free: list[int] = []
        self._size = 0

    # ------------------------------------------------------------------ queries

    def find_matches(self, local_hashes: Sequence[int], early_exit: bool = False) -> dict[WorkerKey, int]:
        """Contiguous prefix depth, in blocks, of ``local_hashes`` cached on each rank (zero omitted).

        ``early_exit`` stops once a single rank remains; that rank's score is then the depth reached
        at the end of the current run, not necessarily its true depth.
        """
        q = local_hashes if type(local_hashes) is list else list(local_hashes)
        n = len(q)
        if not n:
            return {}
        seg = self._root.children.get(q[0])
        if seg is None:
            return {}
        keys = self._keys
        scores: dict[WorkerKey, int] = {}
        active = seg.workers
        pos = 0
        while True:
            locs = seg.locs
            size = len(locs)
            end = pos + size
            if size == 1 or q[pos:end] == locs:
                pos = end
            else:
                m = 1
                limit = min(size, n - pos)
                while m < limit and q[pos + m] == locs[m]:
                    m += 1
                pos += m
                break
            if pos >= n or (early_exit and len(active) == 1):
                break
            nxt = seg.children.get(q[pos])
            if nxt is None:
                break
            ws = nxt.workers
            if len(ws) != len(active):
                for s in active - ws:
                    scores[keys[s]] = pos  # type: ignore[index]
                active = ws
            seg = nxt
        for s in active:
            scores[keys[s]] = pos  # type: ignore[index]
        return scores

    def path_sequence_hashes(self, local_hashes: Sequence[int], depth: int) -> list[int]:
        """Sequence hashes of the first ``depth`` blocks of a query that ``find_matches`` matched that deep."""
        out: list[int] = []
        seg = self._root
        pos = 0
        while pos < depth:
            seg = seg.children[local_hashes[pos]]
            take = depth - pos
            out.extend(seg.seqs if take >= len(seg.seqs) else seg.seqs[:take])
            pos += len(seg.seqs)
        return out

    def tree_size(self, worker_id: int, dp_rank: int = 0) -> int:
        """Number of blocks the rank holds (0 for an unknown rank)."""
        slot = self._slot_of.get((worker_id, dp_rank))
        return 0 if slot is None else len(self._lookup[slot])  # type: ignore[arg-type]

    @property
    def current_size(self) -> int:
        """Total (block, rank) entries: the sum of every rank's tree size."""
        return self._size

    @property
    def num_blocks(self) -> int:
        """Distinct blocks in the tree, however many ranks hold each."""
        return len(self._blocks)

    def ranks(self) -> list[WorkerKey]:
        """Every rank known to the index (including ranks cleared to zero blocks), sorted."""
        return sorted(self._slot_of)

    def holds(self, worker_id: int, block_hash: int, dp_rank: int = 0) -> bool:
        """Whether the rank holds the block with this external hash."""
        slot = self._slot_of.get((worker_id, dp_rank))
        if self._maps is not None and not self._maps.all_u64([block_hash]):
            self._to_dicts()
        return slot is not None and block_hash in self._lookup[slot]  # type: ignore[operator]

    def dump(self) -> list[StoredChain]:
        """The whole index as store events, parents before children, in a deterministic order.

        Replaying them into an empty index reproduces every rank's blocks and external hashes.
        """
        out: list[StoredChain] = []
        stack = [c for _, c in sorted(self._root.children.items(), reverse=True)]
        while stack:
            seg = stack.pop()
            for slot in sorted(seg.workers, key=self._keys.__getitem__):  # type: ignore[arg-type]
                wid, rank = self._keys[slot]  # type: ignore[misc]
                xext = self._xext[slot]
                exts = seg.exts if not xext else [xext.get(s, e) for s, e in zip(seg.seqs, seg.exts)]
                parent = None
                if seg.parent is not self._root:
                    pseg = seg.parent
                    pseq = pseg.seqs[-1]  # type: ignore[union-attr]
                    parent = xext.get(pseq, pseg.exts[-1]) if xext else pseg.exts[-1]  # type: ignore[union-attr]
                out.append(StoredChain(wid, rank, parent, list(exts), list(seg.locs)))
            stack.extend(c for _, c in sorted(seg.children.items(), reverse=True))
        return out

    # ------------------------------------------------------------------ events

    def store(
        self,
        worker_id: int,
        local_hashes: Sequence[int],
        block_hashes: Sequence[int],
        *,
        parent_hash: int | None = None,
        dp_rank: int = 0,
        sequence_hashed: bool = False,
    ) -> None:
        """Apply a ``BlockStored``: a chain of blocks under ``parent_hash`` (``None`` = root).

        Rejected whole, with nothing changed: unknown parent (``ParentBlockNotFound``), repeated
        hashes or a hash the rank already holds at another position (``InvalidBlockSequence``).
        ``sequence_hashed``: the block hashes are ``kvemu.hashing`` sequence hashes of the local hashes
        (the index's own block identities), so new blocks are not hashed again; the first is checked.
        """
        if type(local_hashes) is not list:
            local_hashes = list(local_hashes)
        if type(block_hashes) is not list:
            block_hashes = list(block_hashes)
        n = len(block_hashes)
        if len(local_hashes) != n:
            raise InvalidArgument(
                f"store for worker {worker_id} rank {dp_rank}: {n} block_hashes but {len(local_hashes)} local_hashes",
                field="local_hashes", worker_id=worker_id, dp_rank=dp_rank,
            )
        maps = self._maps
        distinct: bool | None = None  # (the native maps tell it with the hashes' check, in one pass)
        if maps is not None:
            distinct = maps.distinct_u64(block_hashes, parent_hash)
            if distinct is None:  # a hash the native maps cannot hold: the dicts from now on
                self._to_dicts()
        key = (worker_id, dp_rank)
        slot = self._slot_of.get(key)
        lk = self._lookup[slot] if slot is not None else None
        seg, off = self._root, -1
        if parent_hash is not None:
            pseq = lk.get(parent_hash) if lk is not None else None
            if pseq is None:
                raise ParentBlockNotFound(
                    f"worker {worker_id} rank {dp_rank}: parent block {parent_hash} is not held; store of {n} blocks rejected",
                    worker_id=worker_id, dp_rank=dp_rank, block_hash=parent_hash,
                )
            seg = self._blocks[pseq]
            off = _offset(seg.seqs, pseq)
        if n == 0:
            return
        if distinct is None:
            distinct = len(set(block_hashes)) == n and (parent_hash is None or parent_hash not in block_hashes)
        if not distinct:
            repeated = parent_hash if parent_hash in block_hashes else next(
                h for i, h in enumerate(block_hashes) if h in block_hashes[:i])
            raise InvalidBlockSequence(
                f"worker {worker_id} rank {dp_rank}: store repeats a block hash (blocks {list(block_hashes)[:8]}..., parent {parent_hash})",
                worker_id=worker_id, dp_rank=dp_rank, block_hash=repeated,
            )
        if lk and not lk.isdisjoint(block_hashes):
            self._check_restore(slot, seg, off, local_hashes, block_hashes)  # type: ignore[arg-type]
        if slot is None:
            slot = self._new_slot(key)
        self._store(slot, seg, off, local_hashes, block_hashes, sequence_hashed)

    def remove(self, worker_id: int, block_hashes: Iterable[int], *, dp_rank: int = 0) -> None:
        """Apply a ``BlockRemoved``: drop each block and, for this rank, all its descendants.

        Hashes the rank did not hold when the event arrived do not stop the batch; afterwards
        ``BlockNotFound`` lists them (a block dropped by an earlier cascade of the same event is fine).
        """
        slot = self._slot_of.get((worker_id, dp_rank))
        if slot is None:
            missing = list(block_hashes)
        else:
            exts = block_hashes if type(block_hashes) is list else list(block_hashes)
            if self._maps is not None and not self._maps.all_u64(exts):
                self._to_dicts()
            lk = self._lookup[slot]
            seqs = lk.get_many(exts)  # type: ignore[union-attr]
            if seqs and None not in seqs:
                held = cast("list[int]", seqs)
                segs = self._blocks.get_many(held)
                if segs.count(segs[0]) == len(segs):  # the usual eviction: blocks of one run, cut once
                    self._cut_first(slot, segs[0], set(held))
                    return
            missing = []
            hit: dict[int, tuple[_Seg, set[int]]] = {}  # id(segment) -> (segment, its removed blocks)
            blocks = self._blocks
            for ext in exts:
                seq = lk.get(ext)  # type: ignore[union-attr]
                if seq is None:
                    missing.append(ext)
                    continue
                seg = blocks[seq]
                entry = hit.get(id(seg))
                if entry is None:
                    hit[id(seg)] = (seg, {seq})
                else:
                    entry[1].add(seq)
            for seg, removed in hit.values():  # cut each segment once, at its shallowest removed block
                self._cut_first(slot, seg, removed)
        if missing:
            raise BlockNotFound(
                f"worker {worker_id} rank {dp_rank}: {len(missing)} removed block(s) not held, first {missing[0]}; "
                "the others were removed",
                worker_id=worker_id, dp_rank=dp_rank, block_hash=missing[0], block_hashes=tuple(missing),
            )

    def clear(self, worker_id: int, dp_rank: int = 0) -> None:
        """Apply ``AllBlocksCleared`` for one rank: it keeps no blocks but stays known."""
        slot = self._slot_of.get((worker_id, dp_rank))
        if slot is None:
            self._new_slot((worker_id, dp_rank))
            return
        lk = self._lookup[slot]
        if not lk:
            return
        blocks = self._blocks
        segs = {id(s): s for s in blocks.get_many(list(lk.values()))}
        ordered = sorted(segs.values(), key=lambda s: s.seqs[0])
        for seg in ordered:
            seg.workers.discard(slot)
        self._size -= len(lk)
        lk.clear()
        self._xext[slot] = None
        parents: list[_Seg] = []
        for seg in ordered:
            if not seg.workers and seg.parent is not None and (seg.parent is self._root or seg.parent.workers):
                parents.append(seg.parent)
                self._detach(seg)
        for seg in ordered:
            if seg.parent is not None:
                self._try_merge(seg)
        for seg in parents:
            if seg.parent is not None:
                self._try_merge(seg)

    def clear_all_blocks(self, worker_id: int) -> None:
        """Clear every rank of ``worker_id``; the worker stays known."""
        for key in self._ranks_of(worker_id):
            self.clear(*key)

    def remove_worker(self, worker_id: int) -> None:
        """Forget every rank of ``worker_id`` and all its blocks."""
        for key in self._ranks_of(worker_id):
            self.clear(*key)
            slot = self._slot_of.pop(key)
            self._keys[slot] = None
            self._lookup[slot] = None
            self._xext[slot] = None
            self._free.append(slot)

    # ------------------------------------------------------------------ internals

    def _ranks_of(self, worker_id: int) -> list[WorkerKey]:
        return sorted(k for k in self._slot_of if k[0] == worker_id)

    def _new_slot(self, key: WorkerKey) -> int:
        if self._free:
            slot = self._free.pop()
            self._keys[slot] = key
            self._lookup[slot] = self._new_hash_map()
        else:
            slot = len(self._keys)
            self._keys.append(key)
            self._lookup.append(self._new_hash_map())
            self._xext.append(None)
        self._slot_of[key] = slot
        return slot

    def _new_hash_map(self) -> HashMapLike:
        return HashMap() if self._maps is None else self._maps.HashMap()

    def _use_maps(self, maps: ModuleType | None) -> None:
        """Hold the per-block maps in ``maps``' tables (a ``kvemu._blockmap`` module) or in dicts (``None``);
        an empty index only (tests pick a build this way)."""
        if self._slot_of or len(self._blocks):
            raise ValueError("the per-block maps of a non-empty index cannot be swapped")
        self._maps = maps
        self._blocks = SegMap() if maps is None else maps.SegMap()

    def _to_dicts(self) -> None:
        """Move the per-block maps to the pure-Python dicts for good (a hash the native tables cannot hold)."""
        self._maps = None
        blocks: SegMap[_Seg] = SegMap()
        blocks.update(self._blocks.items())
        self._blocks = blocks
        for slot, lk in enumerate(self._lookup):
            if lk is not None:
                moved = HashMap()
                moved.update(lk.items())
                self._lookup[slot] = moved

    def _ext_of(self, slot: int, seg: _Seg, i: int) -> int:
        xext = self._xext[slot]
        if xext:
            return xext.get(seg.seqs[i], seg.exts[i])
        return seg.exts[i]

    def _check_restore(self, slot: int, seg: _Seg | None, off: int, locs: Sequence[int], exts: Sequence[int]) -> None:
        """Reject a store naming a hash the rank already holds anywhere but at that very block."""
        lk = self._lookup[slot]
        for i, (loc, ext) in enumerate(zip(locs, exts)):
            assert seg is not None  # (a None seg returned below)
            if off + 1 < len(seg.locs):
                if seg.locs[off + 1] != loc:
                    seg = None
                else:
                    off += 1
            else:
                child = seg.children.get(loc)
                seg, off = (child, 0) if child is not None else (None, 0)
            if seg is None or slot not in seg.workers:
                clash = [e for e in exts[i:] if e in lk]  # type: ignore[operator]
                if clash:
                    wid, rank = self._keys[slot]  # type: ignore[misc]
                    raise InvalidBlockSequence(
                        f"worker {wid} rank {rank}: block hash {clash[0]} is already held at another position; "
                        "engines must hash identical prefixes identically. Store rejected",
                        worker_id=wid, dp_rank=rank, block_hash=clash[0],
                    )
                return
            held = lk.get(ext)  # type: ignore[union-attr]
            if held is not None and held != seg.seqs[off]:
                wid, rank = self._keys[slot]  # type: ignore[misc]
                raise InvalidBlockSequence(
                    f"worker {wid} rank {rank}: block hash {ext} is already held at another position. Store rejected",
                    worker_id=wid, dp_rank=rank, block_hash=ext,
                )

    def _map(self, slot: int, seg: _Seg, i: int, ext: int) -> None:
        """Record that ``slot`` calls block ``seg[i]`` by ``ext`` (re-store or join of an existing block)."""
        lk = self._lookup[slot]
        seq = seg.seqs[i]
        canonical = seg.exts[i]
        xext = self._xext[slot]
        old = xext.get(seq, canonical) if xext else canonical
        if old == ext and lk.get(ext) == seq:  # type: ignore[union-attr]
            return
        if lk.get(old) == seq:  # type: ignore[union-attr]
            del lk[old]  # type: ignore[union-attr]
            self._size -= 1
        lk[ext] = seq  # type: ignore[index]
        self._size += 1
        if ext != canonical:
            if xext is None:
                xext = self._xext[slot] = {}
            xext[seq] = ext
        elif xext:
            xext.pop(seq, None)

    def _store(self, slot: int, seg: _Seg, off: int, locs: list[int], exts: list[int], hashed: bool = False) -> None:
        """Walk the chain from (``seg``, ``off``) a run of matching blocks at a time, then append the rest."""
        n = len(exts)
        i = 0
        while i < n:
            if off + 1 < len(seg.locs):
                m = _common_run(seg.locs, off + 1, locs, i)
                if m:  # blocks the rank already holds: a re-store
                    self._map_run(slot, seg, off + 1, exts, i, m, joined=False)
                    off += m
                    i += m
                    continue
                self._split(seg, off + 1)
            child = seg.children.get(locs[i])
            if child is None:
                self._append_new(slot, seg, locs[i:], exts[i:], hashed)
                return
            m = _common_run(child.locs, 0, locs, i)
            if slot in child.workers:
                self._map_run(slot, child, 0, exts, i, m, joined=False)
                seg, off = child, m - 1
                i += m
                continue
            if m < len(child.locs):
                self._split(child, m)
            child.workers.add(slot)
            self._map_run(slot, child, 0, exts, i, m, joined=True)
            i += m
            self._try_merge(seg)
            seg = child if child.parent is not None else seg  # absorbed into ``seg`` by the merge
            off = len(seg.locs) - 1

    def _map_run(self, slot: int, seg: _Seg, start: int, exts: list[int], i: int, m: int, *, joined: bool) -> None:
        """Map ``exts[i:i+m]`` onto blocks ``seg[start:start+m]`` for ``slot``; one bulk update when canonical."""
        part = exts[i : i + m]
        if not self._xext[slot] and part == seg.exts[start : start + m]:
            if joined:
                self._lookup[slot].update_pairs(part, seg.seqs[start : start + m])  # type: ignore[union-attr]
                self._size += m
            return  # a re-store under the canonical hashes is already mapped
        for j in range(m):
            self._map(slot, seg, start + j, exts[i + j])

    def _append_new(self, slot: int, seg: _Seg, locs: Sequence[int], exts: Sequence[int], hashed: bool = False) -> None:
        """Add blocks that exist nowhere yet below the end of ``seg``, held by ``slot`` alone."""
        parent_seq = seg.seqs[-1] if seg.seqs else None
        exts = list(exts)
        if hashed and extend_sequence_hashes(parent_seq, locs[:1])[0] == exts[0]:
            seqs = exts[:]  # the engine's hashes are the identities this chain would get
        else:
            seqs = extend_sequence_hashes(parent_seq, locs)
        if seg is not self._root and not seg.children and len(seg.workers) == 1:
            seg.locs.extend(locs)
            seg.seqs.extend(seqs)
            seg.exts.extend(exts)
            target = seg
        else:
            target = _Seg(list(locs), seqs, exts, {slot}, seg)
            seg.children[locs[0]] = target
        self._blocks.set_many(seqs, target)
        self._lookup[slot].update_pairs(exts, seqs)  # type: ignore[union-attr]
        self._size += len(seqs)

    def _split(self, seg: _Seg, k: int) -> _Seg:
        """Cut ``seg`` before block ``k``; the head stays in place, the returned tail is its only child."""
        tail = _Seg(seg.locs[k:], seg.seqs[k:], seg.exts[k:], set(seg.workers), seg)
        tail.children = seg.children
        for c in tail.children.values():
            c.parent = tail
        del seg.locs[k:], seg.seqs[k:], seg.exts[k:]
        seg.children = {tail.locs[0]: tail}
        self._blocks.set_many(tail.seqs, tail)
        return tail

    def _try_merge(self, seg: _Seg) -> None:
        """Join ``seg`` and its only child while both have the same holders (keeps runs maximal).

        The shorter run moves into the longer one, so only its blocks are re-mapped: evicting a shared run
        block by block (1-token pages) re-merges a long private tail each time otherwise."""
        if seg is self._root:
            return
        while len(seg.children) == 1:
            (child,) = seg.children.values()
            if child.workers != seg.workers:
                return
            if len(child.seqs) > len(seg.seqs):  # the child takes ``seg``'s place, ``seg``'s blocks first
                child.locs[:0] = seg.locs
                child.seqs[:0] = seg.seqs
                child.exts[:0] = seg.exts
                self._blocks.set_many(seg.seqs, child)
                parent = seg.parent
                parent.children[child.locs[0]] = child  # type: ignore[union-attr]  # (seg's key: its first block)
                child.parent = parent
                seg.parent = None
                seg.children = {}
                seg = child
                continue
            seg.locs.extend(child.locs)
            seg.seqs.extend(child.seqs)
            seg.exts.extend(child.exts)
            self._blocks.set_many(child.seqs, seg)
            seg.children = child.children
            for c in seg.children.values():
                c.parent = seg
            child.parent = None

    def _cut_first(self, slot: int, seg: _Seg, seqs: set[int]) -> None:
        """``_cut`` at the shallowest of ``seqs`` in ``seg`` (a no-op if an earlier cut dropped the segment).

        Engines evict leaf first, so the removed blocks are usually the run's tail: checked in bulk before
        scanning the run once."""
        first: int | None
        if len(seqs) == 1:
            first = next(iter(seqs))
        else:
            run = seg.seqs
            tail = run[-len(seqs):] if len(seqs) <= len(run) else None
            if tail is not None and seqs.issuperset(tail):
                first = tail[0]
            else:
                first = next((s for s in run if s in seqs), None)
                if first is None:
                    return
        self._cut(slot, first)

    def _cut(self, slot: int, seq: int) -> None:
        """Remove block ``seq`` and all its descendants from ``slot`` (no-op if already gone)."""
        seg = self._blocks.get(seq)
        if seg is None or slot not in seg.workers:
            return  # dropped by an earlier cascade of the same event
        off = _offset(seg.seqs, seq)
        if len(seg.workers) == 1:
            self._truncate(slot, seg, off)
            return
        if off:
            seg = self._split(seg, off)
        self._drop_subtree(slot, seg)

    def _unmap(self, slot: int, seg: _Seg, start: int) -> None:
        """Forget ``slot``'s external hashes for blocks ``seg[start:]``."""
        lk = self._lookup[slot]
        xext = self._xext[slot]
        if not xext:  # every hash is the canonical one, and maps to exactly this block
            exts = seg.exts if not start else seg.exts[start:]
            lk.delete_many(exts)  # type: ignore[union-attr]
            self._size -= len(exts)
            return
        for i in range(start, len(seg.seqs)):
            seq = seg.seqs[i]
            ext = xext.pop(seq, seg.exts[i])
            if lk.get(ext) == seq:  # type: ignore[union-attr]
                del lk[ext]  # type: ignore[union-attr]
                self._size -= 1

    def _truncate(self, slot: int, seg: _Seg, off: int) -> None:
        """Cut ``seg[off:]`` and its subtree, all held by ``slot`` alone, without splitting."""
        blocks = self._blocks
        stack = list(seg.children.values())
        while stack:
            child = stack.pop()
            self._unmap(slot, child, 0)
            blocks.delete_many(child.seqs)
            stack.extend(child.children.values())
            child.parent = None
        self._unmap(slot, seg, off)
        seg.children = {}
        if off:
            blocks.delete_many(seg.seqs[off:])
            del seg.locs[off:], seg.seqs[off:], seg.exts[off:]
            return
        parent = seg.parent
        self._detach(seg)
        self._try_merge(parent)  # type: ignore[arg-type]

    def _drop_subtree(self, slot: int, top: _Seg) -> None:
        """Remove ``slot`` from ``top`` and every descendant it holds; detach what nobody holds."""
        visited: list[_Seg] = []
        stack = [top]
        while stack:
            seg = stack.pop()
            visited.append(seg)
            seg.workers.discard(slot)
            self._unmap(slot, seg, 0)
            stack.extend(c for c in seg.children.values() if slot in c.workers)
        parent = top.parent
        if not top.workers:
            self._detach(top)
            self._try_merge(parent)  # type: ignore[arg-type]
            return
        for seg in visited:
            if not seg.workers and seg.parent is not None:
                self._detach(seg)
        for seg in visited:
            if seg.parent is not None:
                self._try_merge(seg)

    def _detach(self, top: _Seg) -> None:
        """Unlink an unheld subtree and forget its blocks."""
        parent = top.parent
        if parent is not None and parent.children.get(top.locs[0]) is top:
            del parent.children[top.locs[0]]
        blocks = self._blocks
        stack = [top]
        while stack:
            seg = stack.pop()
            blocks.discard_many(seg.seqs)
            stack.extend(seg.children.values())
            seg.parent = None
            seg.children = {}

    def _iter_segments(self) -> Iterator[_Seg]:
        stack = list(self._root.children.values())
        while stack:
            seg = stack.pop()
            yield seg
            stack.extend(seg.children.values())

    def check_invariants(self) -> None:
        """Assert the internal invariants (for tests): subset rule, maximal runs, maps in sync."""
        count = 0
        for seg in self._iter_segments():
            assert seg.workers, "unheld segment left in the tree"
            assert seg.parent is not None
            if seg.parent is not self._root:
                assert seg.workers <= seg.parent.workers, "child holders must be a subset of parent holders"
                assert not (len(seg.parent.children) == 1 and seg.parent.workers == seg.workers), "run not maximal"
            assert len(seg.locs) == len(seg.seqs) == len(seg.exts) > 0
            for seq in seg.seqs:
                assert self._blocks[seq] is seg
            count += len(seg.seqs)
        assert count == len(self._blocks)
        total = 0
        for slot, lk in enumerate(self._lookup):
            if lk is None:
                continue
            total += len(lk)
            for ext, seq in lk.items():
                seg = self._blocks[seq]
                assert slot in seg.workers
                assert self._ext_of(slot, seg, seg.seqs.index(seq)) == ext
        assert total == self._size
