"""The per-block maps of ``kvemu.index.PrefixIndex``: dicts with bulk operations over one event's hashes.

``HashMap`` maps a rank's external block hashes to sequence hashes, ``SegMap`` sequence hashes to the segment
holding the block. The classes here are dict subclasses, the pure-Python reference; ``kvemu._blockmap``
(``kvemu/_native/blockmap.c``) is their native form: open-addressing tables of u64s, used when
``kvemu._build`` allows it (``NATIVE_MAPS``). The native tables only store ints in [0, 2**64); the index checks
each event's hashes with the native ``all_u64`` (``all_u64_py`` here) first and moves to these dicts for good
when one is anything else. Nothing observable depends on either map's iteration order.
"""

from __future__ import annotations

import importlib
from collections import deque
from collections.abc import Iterable
from types import ModuleType
from typing import Final, Protocol, TypeVar

from kvemu import _build

__all__ = ["HashMap", "SegMap", "HashMapLike", "SegMapLike", "all_u64_py", "distinct_u64_py", "NATIVE_MAPS"]

_U64_LIMIT = 1 << 64
V = TypeVar("V")


class HashMapLike(Protocol):
    """What the index uses of a u64 -> u64 map (``HashMap`` or the native ``kvemu._blockmap.HashMap``)."""

    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    def __getitem__(self, key: int) -> int: ...
    def __setitem__(self, key: int, value: int) -> None: ...
    def __delitem__(self, key: int) -> None: ...
    def get(self, key: int, default: None = None, /) -> int | None: ...
    def get_many(self, keys: list[int], /) -> list[int | None]: ...
    def delete_many(self, keys: list[int], /) -> None: ...
    def isdisjoint(self, keys: list[int], /) -> bool: ...
    def update_pairs(self, keys: list[int], values: list[int], /) -> None: ...
    def values(self) -> Iterable[int]: ...
    def items(self) -> Iterable[tuple[int, int]]: ...
    def clear(self) -> None: ...


class SegMapLike(Protocol[V]):
    """What the index uses of a u64 -> object map (``SegMap`` or the native ``kvemu._blockmap.SegMap``)."""

    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    def __getitem__(self, key: int) -> V: ...
    def get(self, key: int, default: None = None, /) -> V | None: ...
    def get_many(self, keys: list[int], /) -> list[V]: ...
    def delete_many(self, keys: list[int], /) -> None: ...
    def discard_many(self, keys: list[int], /) -> None: ...
    def set_many(self, keys: list[int], value: V, /) -> None: ...
    def keys(self) -> Iterable[int]: ...
    def items(self) -> Iterable[tuple[int, V]]: ...


class HashMap(dict[int, int]):
    """u64 -> u64 (a rank's external block hash -> the block's sequence hash); the reference."""

    __slots__ = ()

    def get_many(self, keys: list[int], /) -> list[int | None]:
        """Each key's value, None where absent."""
        return list(map(self.get, keys))

    def delete_many(self, keys: list[int], /) -> None:
        """Delete every key in order; KeyError at the first absent one (the keys before it are deleted)."""
        deque(map(self.__delitem__, keys), maxlen=0)

    def isdisjoint(self, keys: list[int], /) -> bool:
        """Whether no key of the list is present."""
        return self.keys().isdisjoint(keys)

    def update_pairs(self, keys: list[int], values: list[int], /) -> None:
        """``self[keys[i]] = values[i]`` for every i, in order (lists of equal length, ValueError otherwise)."""
        if len(keys) != len(values):
            raise ValueError(f"update_pairs: {len(keys)} keys but {len(values)} values")
        self.update(zip(keys, values))


class SegMap(dict[int, V]):
    """u64 -> object (a block's sequence hash -> the segment holding it); the reference."""

    __slots__ = ()

    def get_many(self, keys: list[int], /) -> list[V]:
        """Each key's value; KeyError at the first absent key."""
        return list(map(self.__getitem__, keys))

    def delete_many(self, keys: list[int], /) -> None:
        """Delete every key in order; KeyError at the first absent one (the keys before it are deleted)."""
        deque(map(self.__delitem__, keys), maxlen=0)

    def discard_many(self, keys: list[int], /) -> None:
        """Delete every key present; absent keys are skipped."""
        pop = self.pop
        for key in keys:
            pop(key, None)

    def set_many(self, keys: list[int], value: V, /) -> None:
        """``self[key] = value`` for every key of the list."""
        self.update(dict.fromkeys(keys, value))


def all_u64_py(items: list[object]) -> bool:
    """Whether every item is an exact int in [0, 2**64): what the native maps may be handed."""
    return all(type(x) is int and 0 <= x < _U64_LIMIT for x in items)


def distinct_u64_py(items: list[object], extra: object = None) -> bool | None:
    """None when an item, or ``extra`` (unless None), is not an exact int in [0, 2**64); else whether the items are
    pairwise distinct and ``extra`` is none of them (a store's chain and its parent)."""
    if not all_u64_py(items) or (extra is not None and not all_u64_py([extra])):
        return None
    return len(set(items)) == len(items) and extra not in items


def _native() -> ModuleType | None:
    if not _build.use_native("kvemu._blockmap"):
        return None
    try:
        return importlib.import_module("kvemu._blockmap")
    except ImportError:
        return None


NATIVE_MAPS: Final[ModuleType | None] = _native()
"""The ``kvemu._blockmap`` module when this install may use it (built, fresh, not forced pure), else None."""
