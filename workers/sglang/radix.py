"""SGLang-style radix prefix cache over KV pages, sans-IO: lookup, insert, lock, LRU tail eviction.

A page is ``page_size`` tokens named by its sequence hash (the chained hash of every token up to its
end), so two prompts share a page exactly when they share every token up to it: matching hashes is
matching tokens at page granularity. Nodes hold runs of pages; a node is split where a lookup that
locks it ends. Every page is either free or in the tree; the engine owns the pages it has not inserted.

Eviction follows the reference mocker: the least recently used unlocked leaf loses pages from its tail,
exactly as many as are needed (not whole nodes). Recency is an access counter, so ties cannot happen. With
``sglang_lru`` (``sglang.semantics: sglang-0.5.23``) it follows SGLang 0.5.23 instead: whole leaves go, least
recently used first, and a lookup that cuts a node refreshes the part below the cut too.
Stores and removals are logged as ``workers.blocks`` log entries for KV events.
"""

from __future__ import annotations

import heapq
from typing import Any

from workers.blocks import REMOVED, STORED

__all__ = ["RadixCache", "RadixNode"]


class RadixNode:
    """A run of cached pages below ``parent``; ``lock`` counts the requests whose path goes through it."""

    __slots__ = ("hashes", "parent", "children", "lock", "stamp")

    def __init__(self, hashes: list[int], parent: RadixNode | None, stamp: int) -> None:
        self.hashes = hashes
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.lock = 0
        self.stamp = stamp

    def __repr__(self) -> str:
        return f"RadixNode(pages={len(self.hashes)}, children={len(self.children)}, lock={self.lock})"


def _common(a: list[int], lo: int, b: list[int], limit: int) -> int:
    """How many of ``b`` match ``a[lo:]`` from the start, at most ``limit`` (chained hashes: a prefix)."""
    n = min(limit, len(b), len(a) - lo)
    if a[lo : lo + n] == b[:n]:
        return n
    left, right = 0, n  # the match is a prefix, so bisect on "page i matches"
    while left < right:
        mid = (left + right) // 2
        if a[lo + mid] == b[mid]:
            left = mid + 1
        else:
            right = mid
    return left


class RadixCache:
    """The cached pages of one rank (``capacity`` pages, of which the engine's own are outside the tree)."""

    def __init__(self, capacity: int) -> None:
        self.root = RadixNode([], None, 0)
        self.root.lock = 1  # never evicted
        self.capacity = capacity
        self.size = 0
        """Pages in the tree."""
        self.locked = 0
        """Pages in the tree on some locked path (not evictable)."""
        self.owned = 0
        """Pages held by requests outside the tree."""
        self.log: list[tuple] = []
        self._clock = 0
        self.sglang_lru = False
        """SGLang 0.5.23's recency and eviction (``sglang.semantics``): whole least recently used leaves go, not just
        the pages needed, and a node cut by a lookup is refreshed below the cut too."""
        self._heap: list[tuple[int, int, RadixNode]] = []  # (stamp, id, node): eviction candidates, lazily checked
        self._ids = 0

    # ----------------------------------------------------------------- figures

    @property
    def free(self) -> int:
        """Pages neither cached nor held by a request."""
        return self.capacity - self.size - self.owned

    @property
    def evictable(self) -> int:
        """Cached pages no request holds."""
        return self.size - self.locked

    # ----------------------------------------------------------------- lookup

    def match(self, hashes: list[int], limit: int) -> tuple[RadixNode, int]:
        """The deepest node on the path of ``hashes[:limit]`` and the pages matched (the node is split there).

        Touches the path (it becomes most recently used)."""
        self._clock += 1
        node, pos = self._walk(self.root, 0, hashes, limit, self._clock)
        self._touched(node)
        return node, pos

    def _walk(self, node: RadixNode, pos: int, hashes: list[int], limit: int, stamp: int) -> tuple[RadixNode, int]:
        """Follow ``hashes[pos:limit]`` down from ``node`` (which ends at page ``pos``), splitting the node where
        the match ends and stamping the path; the deepest node reached and the pages matched."""
        while pos < limit:
            child = node.children.get(hashes[pos])
            if child is None:
                break
            n = _common(hashes, pos, child.hashes, limit - pos)
            if n < len(child.hashes):
                lower = child
                child = self._split(child, n)
                if self.sglang_lru:  # SGLang refreshes the part it cut off too
                    lower.stamp = stamp
                    self._touched(lower)
            node = child
            node.stamp = stamp
            pos += n
        return node, pos

    def peek(self, hashes: list[int], limit: int) -> tuple[int, int]:
        """(pages of ``hashes[:limit]`` cached, how many of them no request holds), touching nothing."""
        node = self.root
        pos = free = 0
        while pos < limit:
            child = node.children.get(hashes[pos])
            if child is None:
                break
            n = _common(hashes, pos, child.hashes, limit - pos)
            pos += n
            if not child.lock:
                free += n
            if n < len(child.hashes):
                break
            node = child
        return pos, free

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut ``node`` after its first ``n`` pages; returns the new upper part."""
        upper = RadixNode(node.hashes[:n], node.parent, node.stamp)
        upper.lock = node.lock
        node.hashes = node.hashes[n:]
        node.parent.children[upper.hashes[0]] = upper  # type: ignore[union-attr]  # only the root has no parent
        upper.children[node.hashes[0]] = node
        node.parent = upper
        return upper

    # ----------------------------------------------------------------- locks

    def lock(self, node: RadixNode) -> None:
        """A request now holds the path to ``node``: none of it may be evicted."""
        while node is not self.root:
            if not node.lock:
                self.locked += len(node.hashes)
            node.lock += 1
            node = node.parent  # type: ignore[assignment]  # not the root: it has a parent

    def unlock(self, node: RadixNode) -> None:
        """A request let go of the path to ``node``; pages nobody holds become evictable."""
        while node is not self.root:
            node.lock -= 1
            if not node.lock:
                self.locked -= len(node.hashes)
                if not node.children:
                    self._candidate(node)
            node = node.parent  # type: ignore[assignment]  # not the root: it has a parent

    def _touched(self, node: RadixNode) -> None:
        if node is not self.root and not node.children and not node.lock:
            self._candidate(node)  # its old heap entry is stale now

    def _candidate(self, node: RadixNode) -> None:
        self._ids += 1
        heapq.heappush(self._heap, (node.stamp, self._ids, node))

    # ----------------------------------------------------------------- insert

    def insert(self, node: RadixNode, depth: int, hashes: list[int], upto: int, source: Any) -> RadixNode:
        """Cache pages ``hashes[depth:upto]`` below ``node`` (which ends at page ``depth`` of this sequence).

        Pages already cached (another request stored the same tokens) are walked, not duplicated; the
        caller gives back the pages it held for them. Returns the node ending at page ``upto``."""
        self._clock += 1
        node, depth = self._walk(node, depth, hashes, upto, self._clock)
        if depth < upto:
            new = RadixNode(hashes[depth:upto], node, self._clock)
            node.children[new.hashes[0]] = new
            self.size += upto - depth
            self.log.append((STORED, hashes[depth:upto], hashes[depth - 1] if depth else None, source, depth))
            self._candidate(new)
            return new
        self._touched(node)
        return node

    # ----------------------------------------------------------------- eviction

    def evict(self, pages: int) -> int:
        """Free ``pages`` pages (or as many as are evictable) from the least recently used leaves' tails."""
        heap = self._heap
        done = 0
        removed: list[int] = []
        while done < pages and heap:
            stamp, _, node = heap[0]
            if node.lock or node.children or node.stamp != stamp or not node.hashes or node.parent is None:
                heapq.heappop(heap)  # stale: locked, grown, touched since, or gone
                continue
            take = len(node.hashes) if self.sglang_lru else min(pages - done, len(node.hashes))
            hs = node.hashes
            key = hs[0]
            cut = len(hs) - take
            removed += reversed(hs[cut:])
            del hs[cut:]
            done += take
            if not hs:
                heapq.heappop(heap)
                parent = node.parent
                del parent.children[key]
                node.parent = None
                if parent is not self.root and not parent.children and not parent.lock:
                    self._candidate(parent)
        if done:
            self.size -= done
            self.log.append((REMOVED, removed))
        return done

    def reset(self) -> bool:
        """Drop every cached page (refused while a request holds a path)."""
        if self.locked or self.owned:
            return False
        self.root = RadixNode([], None, 0)
        self.root.lock = 1
        self.size = 0
        self._heap = []
        return True

    def cached_hashes(self) -> set[int]:
        """Every cached page's hash (tests)."""
        out: set[int] = set()
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.update(node.hashes)
            stack += node.children.values()
        return out

    def check(self) -> None:
        """Assert the counters match the tree (tests)."""
        size = locked = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            assert node.hashes, node
            assert node.parent is not None and node.parent.children.get(node.hashes[0]) is node
            size += len(node.hashes)
            if node.lock:
                locked += len(node.hashes)
                assert node.parent is self.root or node.parent.lock >= node.lock
            stack += node.children.values()
        assert size == self.size and locked == self.locked, (size, self.size, locked, self.locked)
        assert 0 <= self.free <= self.capacity, self.free

    def __repr__(self) -> str:
        return f"RadixCache(pages={self.size}/{self.capacity}, locked={self.locked}, owned={self.owned})"

