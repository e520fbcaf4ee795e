"""A trace request's prompt synthesised from its ``hash_ids``: what an engine sees of a Mooncake-style row.

A trace block of ``trace_block_size`` tokens (default 512) is the token ``hash_id`` repeated; the prompt
is the concatenation, truncated to ``input_length``, which is first clamped to
``len(hash_ids) * trace_block_size``. Equal hash ids therefore mean equal prompt blocks. Hash ids are
unsigned 64-bit integers and a token is the id's low 32 bits, as in the reference's replay. Reading trace
files is the harness's (``harness.workload.traces``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from itertools import islice

import xxhash

from kvemu.errors import InvalidArgument
from kvemu.hashing import BASE_SEED, local_block_hashes, sequence_hashes
from kvemu.token_sequence import TokenSequence

__all__ = ["DEFAULT_TRACE_BLOCK_SIZE", "U32_MASK", "HashIdTokens", "check_hash_ids", "clamped_input_length",
           "expand_hash_ids"]

DEFAULT_TRACE_BLOCK_SIZE = 512
"""Tokens per trace block when a trace does not say (the Mooncake traces' 512)."""
U32_MASK = (1 << 32) - 1
"""A token is its hash id's low 32 bits."""
_U64_LIMIT = 1 << 64


def _is_int(value: object) -> bool:
    return type(value) is int


def check_hash_ids(hash_ids: Sequence[int], input_length: int, trace_block_size: int) -> None:
    """Refuse (``InvalidArgument`` naming the field) hash ids outside [0, 2**64), a negative ``input_length`` or a
    ``trace_block_size`` below 1: what every prompt built from a trace row is checked against."""
    if not _is_int(trace_block_size) or trace_block_size < 1:
        raise InvalidArgument(f"trace_block_size must be an integer >= 1, got {trace_block_size!r}",
                              field="trace_block_size")
    if not _is_int(input_length) or input_length < 0:
        raise InvalidArgument(f"input_length must be an integer >= 0, got {input_length!r}", field="input_length")
    for i, h in enumerate(hash_ids):
        if not _is_int(h) or not 0 <= h < _U64_LIMIT:
            raise InvalidArgument(f"hash_ids[{i}] must be an integer in [0, 2**64), got {h!r}", field="hash_ids")


def clamped_input_length(
    hash_ids: Sequence[int], input_length: int, trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE
) -> int:
    """``input_length`` clamped to what the hash ids can describe (``len(hash_ids) * trace_block_size``)."""
    check_hash_ids(hash_ids, input_length, trace_block_size)
    return min(input_length, len(hash_ids) * trace_block_size)


def expand_hash_ids(
    hash_ids: Sequence[int], input_length: int, trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE
) -> list[int]:
    """Prompt token ids of a trace request: each hash id repeated ``trace_block_size`` times, truncated."""
    n = clamped_input_length(hash_ids, input_length, trace_block_size)
    out: list[int] = []
    full, rest = divmod(n, trace_block_size)
    for h in islice(hash_ids, full):
        out += [h & U32_MASK] * trace_block_size
    if rest:
        out += [hash_ids[full] & U32_MASK] * rest
    return out


class HashIdTokens(TokenSequence):
    """The expanded prompt of a trace request as a lazy sequence equal to ``expand_hash_ids(...)``.

    Hashes its blocks without expanding them when ``block_size`` divides ``trace_block_size``.
    """

    __slots__ = ("hash_ids", "trace_block_size", "_len", "_memo")

    def __init__(
        self, hash_ids: Sequence[int], input_length: int, trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE
    ) -> None:
        self._len = clamped_input_length(hash_ids, input_length, trace_block_size)
        used = -(-self._len // trace_block_size)
        self.hash_ids = tuple(h & U32_MASK for h in islice(hash_ids, used))
        """The token of each used trace block (the id's low 32 bits)."""
        self.trace_block_size = trace_block_size
        self._memo: tuple[int, list[int], list[int]] | None = None  # (block_size, local, sequence hashes)

    def __len__(self) -> int:
        return self._len

    def _token(self, i: int) -> int:
        return self.hash_ids[i // self.trace_block_size]

    def _run(self, lo: int, hi: int) -> list[int]:
        out: list[int] = []
        tbs = self.trace_block_size
        ids = self.hash_ids
        pos = lo
        while pos < hi:
            b = pos // tbs
            end = min(hi, (b + 1) * tbs)
            out += [ids[b]] * (end - pos)
            pos = end
        return out

    def u32_bytes(self) -> bytes:
        """The expanded token ids as little-endian u32 bytes (the packed wire form), a trace block at a time."""
        tbs = self.trace_block_size
        data = b"".join([struct.pack("<I", h) * tbs for h in self.hash_ids])
        return data[: self._len * 4]

    def local_block_hashes(self, block_size: int) -> list[int]:
        """Local block hashes (seed 1337), equal to ``kvemu.hashing.local_block_hashes(self.to_list(), block_size)``.

        Memoized with ``sequence_hashes`` (do not mutate the list)."""
        memo = self._memo
        if memo is not None and memo[0] == block_size:
            return memo[1]
        return self._hash(block_size)[1]

    def sequence_hashes(self, block_size: int) -> list[int]:
        """Sequence hashes of the full blocks, memoized per block size so that a router and an engine in
        one process hash a prompt once (do not mutate the list)."""
        memo = self._memo
        if memo is not None and memo[0] == block_size:
            return memo[2]
        return self._hash(block_size)[2]

    def _hash(self, block_size: int) -> tuple[int, list[int], list[int]]:
        local = self._local_block_hashes(block_size)
        memo = self._memo = (block_size, local, sequence_hashes(local))
        return memo

    def _local_block_hashes(self, block_size: int) -> list[int]:
        if block_size < 1:
            raise InvalidArgument(f"block_size must be a positive integer, got {block_size!r}")
        tbs = self.trace_block_size
        if tbs % block_size:
            return local_block_hashes(self.to_list(), block_size)
        per = tbs // block_size
        n_blocks = self._len // block_size
        out: list[int] = []
        ids = self.hash_ids
        for b in range(-(-n_blocks // per)):
            h = xxhash.xxh3_64_intdigest(struct.pack("<I", ids[b]) * block_size, BASE_SEED)
            out += [h] * min(per, n_blocks - b * per)
        return out

    def __repr__(self) -> str:
        return f"HashIdTokens(len={self._len}, hash_ids={len(self.hash_ids)}, trace_block_size={self.trace_block_size})"
