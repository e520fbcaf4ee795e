"""A prompt that is not a list: the read-only ``Sequence[int]`` behaviour packed and lazy prompts share.

A subclass says how long it is, what token sits at a position and what a run of positions holds; this base
gives it indexing (negative indices, slices as lists), iteration, equality with lists and other prompts, and
``check_u32`` (every token of such a prompt is a u32 by construction, so admission need not scan it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

from mypy_extensions import mypyc_attr

__all__ = ["TokenSequence"]


@mypyc_attr(allow_interpreted_subclasses=True)  # subclassed outside the compiled build (workers.hash_id_prompt)
class TokenSequence(Sequence[int]):
    """Indexing, iteration and equality over ``_token(i)`` and ``_run(lo, hi)``; not hashable (as a list)."""

    __slots__ = ()

    def _token(self, i: int) -> int:
        """The token at position ``0 <= i < len(self)``."""
        raise NotImplementedError

    def _run(self, lo: int, hi: int) -> list[int]:
        """The tokens at positions ``lo .. hi-1`` (``0 <= lo <= hi <= len(self)``)."""
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        n = len(self)
        if isinstance(i, slice):
            lo, hi, step = i.indices(n)
            if step != 1:
                return self._run(0, n)[i]
            return self._run(lo, hi) if lo < hi else []
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"{type(self).__name__} index out of range")
        return self._token(i)

    def __iter__(self) -> Iterator[int]:
        return iter(self._run(0, len(self)))

    def to_list(self) -> list[int]:
        """The token ids as a list."""
        return self._run(0, len(self))

    def check_u32(self) -> bool:
        """Always true: every token is a u32 by construction (admission asks before scanning tokens)."""
        return True

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenSequence):
            return len(self) == len(other) and self.to_list() == other.to_list()
        if isinstance(other, list):
            return self.to_list() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]
