"""A prompt held packed: its token ids as little-endian u32 in one ``bytes``, hashed a slice at a time.

A list of 4M token ids is ~150 MB of Python objects and a second or so of work to decode, check and hash in
one go; packed it is 16 MB, moves over the wire as one msgpack ``bin`` (a copy, no object per token), needs
no range check (every 4 bytes are a u32) and hashes straight from its bytes. ``hash_ahead`` hashes at most a
given number of blocks per call, so that an async shell can spread a huge prompt over many loop turns; the
hashes are memoized (a ``SelfHashingTokens``), so the router's and an engine's ``prepare`` find them done.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

import xxhash

from kvemu.errors import InvalidArgument
from kvemu.hashing import BASE_SEED, extend_sequence_hashes
from kvemu.token_sequence import TokenSequence

__all__ = ["PackedTokens", "HASH_BLOCKS_PER_TURN"]

HASH_BLOCKS_PER_TURN = 16_384
"""Blocks an async shell hashes per loop turn (a few milliseconds), so that a 4M-token prompt never holds the
loop for the whole of its hashing."""

_BIG_ENDIAN = sys.byteorder == "big"
_xxh3 = xxhash.xxh3_64_intdigest


class PackedTokens(TokenSequence):
    """Token ids as little-endian u32 bytes: a read-only ``Sequence[int]`` that hashes its own blocks."""

    __slots__ = ("_data", "_ids", "_block_size", "_locals", "_seqs")

    def __init__(self, data: bytes) -> None:
        if len(data) % 4:
            raise InvalidArgument(f"tokens: {len(data)} bytes is not a whole number of 4-byte (u32) token ids",
                                  field="tokens")
        self._data = bytes(data)
        ids = memoryview(self._data).cast("I")
        if _BIG_ENDIAN:  # pragma: no cover - the bytes are little-endian; the view must be native
            swapped = array("I", self._data)
            swapped.byteswap()
            ids = memoryview(swapped)
        self._ids = ids
        self._block_size = 0  # the block size of the memoized hashes (0: none yet)
        self._locals: list[int] = []
        self._seqs: list[int] = []

    @classmethod
    def from_ids(cls, ids: Iterable[int], field: str = "tokens") -> PackedTokens:
        """Pack token ids, checking in C that each is an integer in ``[0, 2**32)`` (``InvalidArgument`` naming
        ``field`` if not)."""
        if isinstance(ids, PackedTokens):
            return ids
        try:
            buf = array("I", ids)
        except (OverflowError, TypeError) as exc:
            raise InvalidArgument(f"{field}: every token id must be an integer in [0, 2**32): {exc}",
                                  field=field) from None
        if buf.itemsize != 4:  # pragma: no cover - exotic platforms
            raise InvalidArgument("this platform's array('I') is not 32-bit")
        if _BIG_ENDIAN:  # pragma: no cover
            buf.byteswap()
        return cls(buf.tobytes())

    def u32_bytes(self) -> bytes:
        """The token ids as little-endian u32 bytes: the wire form, and the bytes block hashes are taken over."""
        return self._data

    def __len__(self) -> int:
        return len(self._ids)

    def _token(self, i: int) -> int:
        return self._ids[i]

    def _run(self, lo: int, hi: int) -> list[int]:
        return self._ids[lo:hi].tolist()

    def __contains__(self, value: object) -> bool:
        return value in self._ids.tolist()

    def hash_ahead(self, block_size: int, max_blocks: int) -> bool:
        """Hash up to ``max_blocks`` more full blocks of ``block_size`` tokens; True once all are hashed.

        The local hash of a block is XXH3-64 (seed 1337) of its bytes, as ``kvemu.hashing.local_block_hashes``."""
        if block_size < 1:
            raise InvalidArgument(f"block_size must be a positive integer, got {block_size!r}", field="block_size")
        if block_size != self._block_size:
            self._block_size, self._locals, self._seqs = block_size, [], []
        locs = self._locals
        have = len(locs)
        total = len(self._ids) // block_size
        upto = min(total, have + max(1, max_blocks))
        if upto > have:
            width = block_size * 4
            view = memoryview(self._data)
            new = [_xxh3(view[i : i + width], BASE_SEED) for i in range(have * width, upto * width, width)]
            self._seqs += extend_sequence_hashes(self._seqs[-1] if self._seqs else None, new)
            locs += new
        return upto == total

    def local_block_hashes(self, block_size: int) -> list[int]:
        """Local hashes of the full blocks (memoized: do not mutate the list)."""
        self.hash_ahead(block_size, len(self._ids))
        return self._locals

    def sequence_hashes(self, block_size: int) -> list[int]:
        """Sequence hashes of the full blocks (memoized with ``local_block_hashes``: do not mutate the list)."""
        self.hash_ahead(block_size, len(self._ids))
        return self._seqs

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedTokens):
            return self._data == other._data
        return super().__eq__(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"PackedTokens(len={len(self._ids)})"
