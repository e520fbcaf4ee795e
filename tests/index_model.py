"""A deliberately simple reference model of the prefix index (dicts of sets keyed by full paths)."""

from __future__ import annotations


class ModelIndex:
    """Nodes are identified by their full tuple of local hashes; nothing clever anywhere."""

    def __init__(self) -> None:
        self.holders: dict[tuple[int, ...], set[tuple[int, int]]] = {}
        self.lookup: dict[tuple[int, int], dict[int, tuple[int, ...]]] = {}

    def store(self, key, parent, locs, exts) -> str | None:
        lk = self.lookup.get(key, {})
        if parent is None:
            base: tuple[int, ...] = ()
        elif parent in lk:
            base = lk[parent]
        else:
            return "ParentBlockNotFound"
        if not exts:
            return None
        if len(set(exts)) != len(exts) or parent in exts:
            return "InvalidBlockSequence"
        for i, e in enumerate(exts):
            path = base + tuple(locs[: i + 1])
            if e in lk and lk[e] != path:
                return "InvalidBlockSequence"
        lk = self.lookup.setdefault(key, {})
        for i, e in enumerate(exts):
            path = base + tuple(locs[: i + 1])
            for other in [x for x, p in lk.items() if p == path and x != e]:
                del lk[other]
            lk[e] = path
            self.holders.setdefault(path, set()).add(key)
        return None

    def remove(self, key, exts) -> str | None:
        lk = self.lookup.get(key, {})
        missing = any(e not in lk for e in exts)
        for p in [lk[e] for e in exts if e in lk]:
            n = len(p)
            for path in list(self.holders):
                if path[:n] == p:
                    self.holders[path].discard(key)
                    if not self.holders[path]:
                        del self.holders[path]
            for x in [x for x, q in lk.items() if q[:n] == p]:
                del lk[x]
        return "BlockNotFound" if missing else None

    def clear(self, key) -> None:
        for path in list(self.holders):
            self.holders[path].discard(key)
            if not self.holders[path]:
                del self.holders[path]
        self.lookup[key] = {}

    def keys_of(self, worker_id):
        return [k for k in self.lookup if k[0] == worker_id]

    def clear_all_blocks(self, worker_id) -> None:
        for k in self.keys_of(worker_id):
            self.clear(k)

    def remove_worker(self, worker_id) -> None:
        for k in self.keys_of(worker_id):
            self.clear(k)
            del self.lookup[k]

    def find_matches(self, locs) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = {}
        for key in self.lookup:
            d = 0
            while d < len(locs) and key in self.holders.get(tuple(locs[: d + 1]), ()):
                d += 1
            if d:
                out[key] = d
        return out

    def tree_size(self, key) -> int:
        return len(self.lookup.get(key, {}))
