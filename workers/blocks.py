"""KV block manager of one DP rank: a fixed pool of blocks, prefix reuse, eviction and a KV event log.

A block is *free* (holds nothing reusable), *partial* (held by one running sequence, still filling,
not shared), *active* (a full block referenced by >= 1 running sequence; ref-counted) or *inactive*
(a full block nobody references, kept for prefix reuse and evicted on demand). Full blocks are
identified by their rolling sequence hash (the external block hash of the KV events), so a pool never
holds two full blocks with the same hash: a block that fills up with content already cached is
released and the cached one referenced instead ("dedupe").

Only the count of free and partial blocks matters; physical block ids are not modelled. (vLLM keeps
such a duplicate physical block until its request ends; releasing it at once differs only in the
capacity of that rare window and keeps one block per hash, which is what the router sees.)

One dict holds every cached full block: ``cached[hash] > 0`` is an active block's reference count and
``cached[hash] = -tick < 0`` marks an inactive block released at ``tick`` (a counter bumped per released
block), so a lookup, a release or a reactivation is one dict operation.

Native tables: with ``eviction="lru"`` (the default) and plain 64-bit keys, the compiled build keeps ``cached``
and the LRU queue in ``kvemu._blockpool.Table`` (``kvemu/_native/blockpool.c``: an open-addressing u64 -> i64
table and the queue, with one bulk method per request operation); the decisions, ``free``, ``version`` and the log
stay here, and this module's pure-Python tables are the reference and the fallback (``lineage``, hybrid KV group
keys, ``KVEMU_PURE_PYTHON=1``, no build). ``cached`` is then a snapshot (a new dict, in no promised order) for
checks and tests; nothing outside this module may write it.

Keys: ints in ``[0, groups << 64)`` (``groups`` > 1: hybrid KV group keys, ``workers.vllm.hybrid``). A block that
is stored (``promote``, ``promote_one``) is checked first: TypeError for a non-int, OverflowError outside the
range, IndexError for a position outside ``hashes``, nothing changed; a lookup of any other value finds nothing
(``take_hits`` / ``release``: KeyError).

Eviction: sequences always hold a prefix of their chain and release it tail first (as vLLM's free
queue does), so a parent is always released after its children and plain LRU already evicts leaves
before their parents. ``lineage`` additionally checks the leaf property explicitly; with this release
order both policies choose the same victims.
"""

from __future__ import annotations

import heapq
import importlib
from collections import deque
from collections.abc import Sequence
from itertools import islice
from types import ModuleType
from typing import Final, Protocol

from kvemu import _build
from kvemu.errors import InvalidArgument
from workers.config import EvictionPolicyName

__all__ = ["BlockPool", "TokenSource", "STORED", "REMOVED", "CLEARED", "HOST_STORED", "HOST_REMOVED"]

# Compact KV log entries (materialised into vLLM-style structs by ``workers.pass_events``):
#   (STORED, block_hashes, parent_hash_or_None, token_source, first_block_index)
#   (REMOVED, block_hashes)     one BlockRemoved per hash when materialised, as vLLM sends them
#   (CLEARED,)
STORED = 0
REMOVED = 1
CLEARED = 2
HOST_STORED = 3
"""KV log entry ``(HOST_STORED, block_hashes, parent_hash_or_None, token_source, first_block_index)``: the host
tier (``workers.vllm.host_tier``) stored them."""
HOST_REMOVED = 4
"""KV log entry ``(HOST_REMOVED, block_hashes)``: the host tier evicted them."""


class TokenSource(Protocol):
    """A sequence being computed: the token ids of its positions and the local hashes of its blocks."""

    def token_slice(self, lo: int, hi: int) -> list[int]:
        """Token ids at positions ``lo .. hi-1``."""
        ...

    def local_hashes(self, lo: int, hi: int) -> list[int]:
        """Local hashes of full blocks ``lo .. hi-1``."""
        ...


class _Table(Protocol):
    """``kvemu._blockpool.Table`` (its stub: ``kvemu/_blockpool.pyi``): the native cached blocks and LRU queue."""

    @property
    def n_inactive(self) -> int: ...

    def match(self, hashes: Sequence[int], limit: int, /) -> tuple[int, int]: ...

    def take(self, hashes: Sequence[int], n: int, /) -> None: ...

    def release(self, held: Sequence[int], n_full: int, /) -> None: ...

    def evict(self, n: int, /) -> list[int]: ...

    def promote(self, span: Sequence[int], /) -> list[int] | None: ...

    def promote_one(self, h: int, /) -> bool: ...

    def get(self, h: int, /) -> int | None: ...

    def items(self) -> list[tuple[int, int]]: ...

    def order(self) -> list[int]: ...

    def clear(self) -> None: ...

    def check(self) -> None: ...

    def __len__(self) -> int: ...

    def __contains__(self, h: object, /) -> bool: ...


def _native_module() -> ModuleType | None:
    """``kvemu._blockpool`` when kvemu._build says this install may use it (built, fresh, not forced pure)."""
    if not _build.use_native("kvemu._blockpool"):
        return None
    try:
        return importlib.import_module("kvemu._blockpool")
    except ImportError:
        return None


_NATIVE: Final[ModuleType | None] = _native_module()


def _check_keys(keys: Sequence[int], end: int) -> None:
    """Every block hash to store is an int in ``[0, end)`` (the native table's checks, same exception types)."""
    for i, h in enumerate(keys):
        if not isinstance(h, int):
            raise TypeError(f"block hash [{i}] must be an int in [0, 2**64), got {type(h).__name__}")
        if h < 0 or h >= end:
            raise OverflowError(f"block hash [{i}] must be in [0, {end:#x})")


class BlockPool:
    """Fixed pool of KV blocks with prefix reuse; evicts the least recently released (``lineage``: leaf) block.

    Every store, eviction and reset is appended to ``log`` in order; the owner drains it.
    """

    __slots__ = (
        "num_blocks",
        "block_size",
        "eviction",
        "free",
        "_cached",
        "num_inactive",
        "log",
        "version",
        "_tick",
        "_order",
        "_order_base",
        "_head",
        "_parent",
        "_children",
        "_leaves",
        "_key_end",
        "_t",
    )

    def __init__(self, num_blocks: int, block_size: int, eviction: EvictionPolicyName = "lru", *,
                 groups: int = 1, native: ModuleType | bool | None = None) -> None:
        """``groups``: keys are ints in ``[0, groups << 64)`` (hybrid KV group keys). ``native``: None, the native
        tables when this install may use them (``eviction="lru"``, ``groups == 1``); False, the pure-Python ones; a
        module (tests), its ``Table``."""
        if num_blocks < 1:
            raise InvalidArgument(f"num_gpu_blocks must be >= 1, got {num_blocks!r}", field="num_gpu_blocks")
        if block_size < 1:
            raise InvalidArgument(f"block_size must be >= 1, got {block_size!r}", field="block_size")
        if eviction not in ("lru", "lineage"):
            raise InvalidArgument(f"eviction_policy must be 'lru' or 'lineage', got {eviction!r}", field="eviction_policy")
        if groups < 1:
            raise InvalidArgument(f"groups must be >= 1, got {groups!r}", field="groups")
        module: ModuleType | None = None
        if isinstance(native, ModuleType):
            if eviction != "lru" or groups != 1:
                raise InvalidArgument("the native block tables need eviction='lru' and 64-bit keys (groups=1)",
                                      field="eviction_policy")
            module = native
        elif native is None and eviction == "lru" and groups == 1:
            module = _NATIVE
        self._t: _Table | None = module.Table() if module is not None else None
        """The native tables (``kvemu._blockpool.Table``), or None: the pure-Python ones below."""
        self._key_end = groups << 64
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.eviction = eviction
        self.free = num_blocks
        self._cached: dict[int, int] = {}
        self.num_inactive = 0
        self.log: list[tuple] = []
        self.version = 0
        """Bumped by every mutation, so an owner can tell that nothing changed between two instants."""
        self._tick = 0
        # LRU queue: hashes in release order; _order[i] was released with tick _order_base + i, and is
        # None once that block is referenced again. A list with a head index, not the dict's own
        # order: popping the front of a dict leaves dummies that every later scan walks over.
        self._order: list[int | None] = []
        self._order_base = 1
        self._head = 0
        # lineage bookkeeping (only maintained for eviction="lineage")
        self._parent: dict[int, int | None] = {}
        self._children: dict[int, int] = {}
        self._leaves: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ queries

    @property
    def cached(self) -> dict[int, int]:
        """Sequence hash -> reference count (active, > 0) or minus the release tick (inactive, < 0). The pure
        tables' own dict; with the native tables a snapshot (a copy, in no promised order)."""
        t = self._t
        if t is None:
            return self._cached
        return dict(t.items())

    @property
    def native(self) -> bool:
        """Whether this pool's tables are the native ones (``kvemu._blockpool``)."""
        return self._t is not None

    @property
    def num_active_blocks(self) -> int:
        """Blocks in use by running sequences (active full blocks + partial blocks)."""
        return self.num_blocks - self.free - self.num_inactive

    @property
    def available(self) -> int:
        """Blocks an allocation may take: free ones plus evictable inactive ones."""
        return self.free + self.num_inactive

    @property
    def active(self) -> dict[int, int]:
        """Active full blocks: sequence hash -> reference count (a copy, for checks and tests)."""
        return {h: v for h, v in self.cached.items() if v > 0}

    @property
    def inactive(self) -> dict[int, int]:
        """Inactive full blocks: sequence hash -> release tick (a copy, for checks and tests)."""
        return {h: -v for h, v in self.cached.items() if v < 0}

    def is_cached(self, block_hash: int) -> bool:
        """Whether a full block with this sequence hash is in the pool (active or inactive)."""
        t = self._t
        if t is not None:
            return block_hash in t
        return block_hash in self._cached

    def cached_hashes(self) -> set[int]:
        """Sequence hashes of every cached full block (for checks; not used to decide anything)."""
        return set(self.cached)

    def _num_cached(self) -> int:
        t = self._t
        return len(t) if t is not None else len(self._cached)

    def match_prefix(self, hashes: Sequence[int], limit: int) -> tuple[int, int]:
        """Length of the cached prefix of ``hashes[:limit]`` and how many of those blocks are inactive."""
        t = self._t
        if t is not None:
            return t.match(hashes, limit)
        get = self._cached.get
        n = 0
        n_inactive = 0
        for h in islice(hashes, limit):
            v = get(h)
            if v is None:
                break
            n += 1
            if v < 0:
                n_inactive += 1
        return n, n_inactive

    # ---------------------------------------------------------------- mutations

    def take_hits(self, hashes: Sequence[int], n: int) -> None:
        """Reference the first ``n`` blocks of ``hashes`` (all cached), reactivating inactive ones."""
        self.version += 1
        t = self._t
        if t is not None:
            try:
                t.take(hashes, n)
            finally:
                self.num_inactive = t.n_inactive
            return
        cached = self._cached
        for h in islice(hashes, n):
            v = cached[h]  # KeyError here means the caller skipped match_prefix
            if v > 0:
                cached[h] = v + 1
            else:
                self._reactivate(h, v)

    def _reactivate(self, h: int, v: int) -> None:
        """An inactive block (marked ``v = -tick``) is referenced again: it leaves the LRU queue."""
        self._cached[h] = 1
        self.num_inactive -= 1
        if self.eviction == "lru":
            self._order[-v - self._order_base] = None

    def allocate(self, n: int) -> None:
        """Take ``n`` blocks as partial blocks, from the free ones first, then by eviction."""
        if n <= 0:
            return
        self.version += 1
        if n <= self.free:
            self.free -= n
            return
        if n > self.free + self.num_inactive:
            self.version -= 1
            raise InvalidArgument(f"allocate: {n} blocks requested, only {self.available} available")
        n -= self.free
        self.free = 0
        self._evict(n)

    def _evict(self, n: int) -> None:
        t = self._t
        if t is not None:
            removed = t.evict(n)
            self.num_inactive = t.n_inactive
            self.log.append((REMOVED, removed))
            return
        cached = self._cached
        get = cached.get
        self.num_inactive -= n
        if self.eviction == "lru":
            order = self._order
            head = self._head
            victims: list[int] = []
            while n:  # the oldest releases first; entries of blocks reactivated since are None
                span = order[head : head + n]
                head += len(span)
                if None in span:
                    span = [h for h in span if h is not None]
                victims += span  # type: ignore[arg-type]  # no None left in span (filtered just above)
                n -= len(span)
            deque(map(cached.__delitem__, victims), maxlen=0)
            self.log.append((REMOVED, victims))
            if head > 4096 and head * 2 > len(order):
                del order[:head]
                self._order_base += head
                head = 0
            self._head = head
            return
        leaves = self._leaves
        children = self._children
        parent_of = self._parent
        log = self.log
        for _ in range(n):
            while True:
                tick, h = heapq.heappop(leaves)
                if get(h) == -tick and not children.get(h):
                    break
            del cached[h]
            log.append((REMOVED, [h]))
            parent = parent_of.pop(h)
            children.pop(h, None)
            if parent is not None and parent in parent_of:
                left = children[parent] - 1
                if left:
                    children[parent] = left
                else:
                    del children[parent]
                    v = get(parent)
                    if v is not None and v < 0:
                        heapq.heappush(leaves, (-v, parent))

    def promote(self, hashes: Sequence[int], lo: int, hi: int, source: TokenSource) -> int:
        """Blocks ``lo .. hi-1`` of a sequence became full: new ones are stored (logged), cached ones deduplicated.

        Returns how many partial blocks went back to the free pool (their content was already cached).
        """
        if lo >= hi:
            return 0
        if lo < 0 or hi > len(hashes):
            raise IndexError(f"promote: blocks {lo}..{hi - 1} outside the {len(hashes)} hashes")
        span = hashes[lo:hi]
        t = self._t
        if t is not None:
            return self._promote_native(t, hashes, lo, hi, span, source)
        _check_keys(span, self._key_end)
        self.version += 1
        cached = self._cached
        lineage = self.eviction == "lineage"
        if not lineage and cached.keys().isdisjoint(span):
            cached.update(dict.fromkeys(span, 1))
            self.log.append((STORED, span, hashes[lo - 1] if lo else None, source, lo))
            return 0
        released = 0
        run_start = -1
        log = self.log
        for i in range(lo, hi):
            h = hashes[i]
            v = cached.get(h)
            if v is not None:
                if v > 0:
                    cached[h] = v + 1
                else:
                    self._reactivate(h, v)
                released += 1
                if run_start >= 0:
                    parent = hashes[run_start - 1] if run_start else None
                    log.append((STORED, hashes[run_start:i], parent, source, run_start))
                    run_start = -1
                continue
            cached[h] = 1
            if lineage:
                parent = hashes[i - 1] if i else None
                self._parent[h] = parent
                if parent is not None and parent in self._parent:
                    self._children[parent] = self._children.get(parent, 0) + 1
            if run_start < 0:
                run_start = i
        if run_start >= 0:
            log.append((STORED, hashes[run_start:hi], hashes[run_start - 1] if run_start else None, source, run_start))
        self.free += released
        return released

    def _promote_native(self, t: _Table, hashes: Sequence[int], lo: int, hi: int, span: Sequence[int],
                        source: TokenSource) -> int:
        """``promote`` on the native tables: they store the blocks and say which were cached; the STORED entries
        (runs split at the cached blocks) are built here, as the pure path builds them."""
        hits = t.promote(span)
        self.version += 1
        log = self.log
        if hits is None:
            log.append((STORED, span, hashes[lo - 1] if lo else None, source, lo))
            return 0
        self.num_inactive = t.n_inactive
        run_start = lo
        for j in hits:
            i = lo + j
            if i > run_start:
                log.append((STORED, hashes[run_start:i], hashes[run_start - 1] if run_start else None, source,
                            run_start))
            run_start = i + 1
        if run_start < hi:
            log.append((STORED, hashes[run_start:hi], hashes[run_start - 1] if run_start else None, source, run_start))
        released = len(hits)
        self.free += released
        return released

    def promote_one(self, hashes: Sequence[int], i: int, source: TokenSource) -> int:
        """``promote(hashes, i, i + 1, source)``, with a short path for the usual new block."""
        if i < 0 or i >= len(hashes):
            raise IndexError(f"promote_one: block {i} outside the {len(hashes)} hashes")
        h = hashes[i]
        t = self._t
        if t is not None:
            new = t.promote_one(h)
            self.version += 1
            if new:
                self.log.append((STORED, [h], hashes[i - 1] if i else None, source, i))
                return 0
            self.num_inactive = t.n_inactive
            self.free += 1
            return 1
        if h in self._cached or self.eviction == "lineage":
            return self.promote(hashes, i, i + 1, source)
        _check_keys([h], self._key_end)
        self.version += 1
        self._cached[h] = 1
        self.log.append((STORED, [h], hashes[i - 1] if i else None, source, i))
        return 0

    def release(self, hashes: Sequence[int], n_full: int, n_partial: int) -> None:
        """A sequence drops its ``n_full`` full blocks (``hashes[:n_full]``) and ``n_partial`` partial ones.

        Tail first, so under LRU its last blocks go before its prefix, which others are likelier to share.
        """
        self.version += 1
        self.free += n_partial
        if n_full <= 0:
            return
        held = hashes[n_full - 1 :: -1]  # tail first
        t = self._t
        if t is not None:
            try:
                t.release(held, n_full)
            finally:
                self.num_inactive = t.n_inactive
            return
        cached = self._cached
        tick = self._tick
        if self.eviction == "lru" and sum(map(cached.__getitem__, held)) == n_full:
            # nobody else holds any of them: all go inactive, marked with consecutive ticks
            cached.update(zip(held, range(-tick - 1, -tick - 1 - n_full, -1)))
            self._order += held
            self._tick = tick + n_full
            self.num_inactive += n_full
            return
        lineage = self.eviction == "lineage"
        order = self._order
        for h in held:
            v = cached[h]
            if v > 1:
                cached[h] = v - 1
                continue
            tick += 1
            cached[h] = -tick
            self.num_inactive += 1
            if lineage:
                if not self._children.get(h):
                    heapq.heappush(self._leaves, (tick, h))
            else:
                order.append(h)
        self._tick = tick

    def reset(self) -> bool:
        """Drop every inactive block and log ``CLEARED``; refused (False, nothing changed) while blocks are in use."""
        if self.num_active_blocks:
            return False
        self.version += 1
        self.free = self.num_blocks
        t = self._t
        if t is not None:
            t.clear()
        self._cached.clear()
        self.num_inactive = 0
        self._parent.clear()
        self._children.clear()
        self._leaves.clear()
        self._order.clear()
        self._head = 0
        self._order_base = self._tick + 1
        self.log.append((CLEARED,))
        return True

    def check(self) -> None:
        """Assert the pool's internal invariants (tests and debugging)."""
        assert self.free >= 0, self.free
        t = self._t
        if t is not None:
            t.check()
            assert self.num_inactive == t.n_inactive, (self.num_inactive, t.n_inactive)
            assert self.num_active_blocks >= len(t) - self.num_inactive
            return
        assert self.num_inactive == sum(1 for v in self.cached.values() if v < 0)
        assert 0 not in self.cached.values()
        assert self.num_active_blocks >= len(self.cached) - self.num_inactive
        if self.eviction == "lineage":
            assert set(self._parent) == self.cached_hashes()
            counts: dict[int, int] = {}
            for parent in self._parent.values():
                if parent is not None and parent in self._parent:
                    counts[parent] = counts.get(parent, 0) + 1
            assert counts == self._children, (counts, self._children)
        else:
            live = [h for h in self._order[self._head :] if h is not None]
            assert len(live) == self.num_inactive, "LRU queue out of step with the inactive blocks"
            for h, v in self.cached.items():
                if v < 0:
                    assert self._order[-v - self._order_base] == h, "LRU queue lost a block"

    def __repr__(self) -> str:
        n_active = self._num_cached() - self.num_inactive
        return (
            f"BlockPool(blocks={self.num_blocks}, free={self.free}, active={n_active}, "
            f"inactive={self.num_inactive}, partial={self.num_active_blocks - n_active})"
        )
