"""Mooncake-style traces: prompt tokens synthesised from ``hash_ids``, and trace records turned into requests.

A trace block of ``trace_block_size`` tokens (default 512) is the token ``hash_id`` repeated; the prompt
is the concatenation, truncated to ``input_length``, which is first clamped to
``len(hash_ids) * trace_block_size``. Equal hash ids therefore mean equal prompt blocks.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping, Sequence
from itertools import islice
from typing import Any, overload

import xxhash

from kvemu.errors import InvalidArgument
from kvemu.hashing import BASE_SEED, local_block_hashes
from workers.request import Request

__all__ = [
    "DEFAULT_TRACE_BLOCK_SIZE",
    "clamped_input_length",
    "expand_hash_ids",
    "HashIdTokens",
    "mooncake_request",
    "iter_jsonl",
]

DEFAULT_TRACE_BLOCK_SIZE = 512
_U32_LIMIT = 1 << 32


def _check_trace(hash_ids: Sequence[int], input_length: int, trace_block_size: int) -> None:
    if not isinstance(trace_block_size, int) or trace_block_size < 1:
        raise InvalidArgument(f"trace_block_size must be an integer >= 1, got {trace_block_size!r}")
    if not isinstance(input_length, int) or isinstance(input_length, bool) or input_length < 0:
        raise InvalidArgument(f"input_length must be an integer >= 0, got {input_length!r}")


def clamped_input_length(
    hash_ids: Sequence[int], input_length: int, trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE
) -> int:
    """``input_length`` clamped to what the hash ids can describe (``len(hash_ids) * trace_block_size``)."""
    _check_trace(hash_ids, input_length, trace_block_size)
    return min(input_length, len(hash_ids) * trace_block_size)


def expand_hash_ids(
    hash_ids: Sequence[int], input_length: int, trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE
) -> list[int]:
    """Prompt token ids of a trace request: each hash id repeated ``trace_block_size`` times, truncated."""
    n = clamped_input_length(hash_ids, input_length, trace_block_size)
    out: list[int] = []
    full, rest = divmod(n, trace_block_size)
    for h in islice(hash_ids, full):
        out += [h] * trace_block_size
    if rest:
        out += [hash_ids[full]] * rest
    return out


class HashIdTokens(Sequence[int]):
    """The expanded prompt of a trace request as a lazy sequence equal to ``expand_hash_ids(...)``.

    Hashes its blocks without expanding them when ``block_size`` divides ``trace_block_size``.
    """

    __slots__ = ("hash_ids", "trace_block_size", "_len", "_u32")

    def __init__(
        self, hash_ids: Sequence[int], input_length: int, trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE
    ) -> None:
        self._len = clamped_input_length(hash_ids, input_length, trace_block_size)
        used = -(-self._len // trace_block_size)
        self.hash_ids = tuple(islice(hash_ids, used))
        self.trace_block_size = trace_block_size
        self._u32 = all(type(h) is int and 0 <= h < _U32_LIMIT for h in self.hash_ids)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            lo, hi, step = i.indices(self._len)
            if step != 1:
                return self.to_list()[i]
            return self._range(lo, hi)
        n = self._len
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("HashIdTokens index out of range")
        return self.hash_ids[i // self.trace_block_size]

    def _range(self, lo: int, hi: int) -> list[int]:
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

    def __iter__(self) -> Iterator[int]:
        return iter(self._range(0, self._len))

    def to_list(self) -> list[int]:
        """The expanded token ids (equal to ``expand_hash_ids`` of the same record)."""
        return self._range(0, self._len)

    def check_u32(self) -> bool:
        """Whether every token id (hash id in use) is an integer in ``[0, 2**32)``."""
        return self._u32

    def local_block_hashes(self, block_size: int) -> list[int]:
        """Local block hashes (seed 1337), equal to ``kvemu.hashing.local_block_hashes(self.to_list(), block_size)``."""
        if block_size < 1:
            raise InvalidArgument(f"block_size must be a positive integer, got {block_size!r}")
        tbs = self.trace_block_size
        if tbs % block_size:
            return local_block_hashes(self.to_list(), block_size)
        if not self.check_u32():
            raise InvalidArgument("tokens: every token id must be an integer in [0, 2**32)")
        per = tbs // block_size
        n_blocks = self._len // block_size
        out: list[int] = []
        ids = self.hash_ids
        for b in range(-(-n_blocks // per)):
            h = xxhash.xxh3_64_intdigest(struct.pack("<I", ids[b]) * block_size, BASE_SEED)
            out += [h] * min(per, n_blocks - b * per)
        return out

    def __eq__(self, other: object) -> bool:
        if isinstance(other, HashIdTokens):
            return self._len == other._len and self.to_list() == other.to_list()
        if isinstance(other, list):
            return self.to_list() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"HashIdTokens(len={self._len}, hash_ids={len(self.hash_ids)}, trace_block_size={self.trace_block_size})"


def mooncake_request(
    record: Mapping[str, Any],
    *,
    request_id: str,
    arrival_ns: int | None = None,
    trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE,
    priority: int = 0,
) -> Request:
    """A ``Request`` from one Mooncake trace record; arrival defaults to its ``timestamp`` (ms) in ns.

    Multi-turn ``delay`` records need the caller to resolve their absolute time.
    """
    try:
        hash_ids = record["hash_ids"]
        input_length = record["input_length"]
        output_length = record["output_length"]
    except KeyError as exc:
        raise InvalidArgument(f"trace record {request_id!r}: missing field {exc.args[0]!r}") from None
    if arrival_ns is None:
        ts = record.get("timestamp")
        if ts is None:
            raise InvalidArgument(f"trace record {request_id!r}: no timestamp and no arrival_ns given")
        arrival_ns = round(ts * 1_000_000)
    tokens = HashIdTokens(hash_ids, input_length, trace_block_size)
    out_ids = record.get("output_token_ids")
    return Request(
        request_id=request_id,
        token_ids=tokens,
        max_tokens=output_length,
        arrival_ns=arrival_ns,
        priority=priority,
        output_token_ids=out_ids,
    )


def iter_jsonl(path: str, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """The first ``limit`` (all if None) JSON objects of a JSONL trace file, read lazily."""
    with open(path, encoding="utf-8") as fh:
        for line in islice(fh, limit):
            line = line.strip()
            if line:
                yield json.loads(line)
