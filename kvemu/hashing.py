"""Dynamo-compatible block hashing: position-independent local hashes and rolling sequence hashes.

Local hash of a block = XXH3-64 (seed 1337, optionally mixed with a LoRA name and a cache namespace)
over its tokens as little-endian u32 values; a trailing partial block has no hash. The sequence hash
chains them so that equal values mean equal prefixes.
"""

from __future__ import annotations

import importlib
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final, cast

import xxhash

from kvemu import _build
from kvemu.errors import InvalidArgument
from kvemu.hashing_protocol import SelfHashingTokens  # runtime_checkable: not compilable, kept apart

__all__ = [
    "BASE_SEED",
    "U64_MASK",
    "block_seed",
    "local_block_hashes",
    "sequence_hashes",
    "extend_sequence_hashes",
    "extend_sequence_hashes_py",
    "mm_hash_from_identifier",
    "to_u64",
    "SelfHashingTokens",
]

BASE_SEED = 1337
"""Seed of the XXH3 local block hash of a request with no LoRA and no cache namespace (Dynamo's value)."""
U64_MASK = (1 << 64) - 1
"""Keeps a hash in 64 unsigned bits, as the wire and the index carry it."""

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack
_BIG_ENDIAN = sys.byteorder == "big"


def to_u64(value: int) -> int:
    """Reinterpret a signed or unsigned 64-bit integer as u64 (two's complement), as wire hashes need."""
    return value & U64_MASK


def block_seed(lora_name: str | None = None, cache_namespace: str | None = None) -> int:
    """Seed for local hashes of one request: 1337, plus the LoRA and namespace mixes (empty = absent)."""
    seed = BASE_SEED
    if lora_name:
        seed = (seed + _xxh3(lora_name.encode(), 0)) & U64_MASK
    if cache_namespace:
        seed = (seed + _xxh3(cache_namespace.encode(), 1)) & U64_MASK
    return seed


def mm_hash_from_identifier(identifier: str) -> int:
    """Map a multimodal object identifier to its u64 hash (64 hex chars: first 16; else XXH3 seed 0)."""
    if len(identifier) == 64:
        try:
            return int(identifier[:16], 16)
        except ValueError:
            pass
    return _xxh3(identifier.encode(), 0)


def _token_bytes(tokens: Sequence[int], count: int) -> bytes:
    packed = getattr(tokens, "u32_bytes", None)  # PackedTokens: the bytes are there, every id a u32
    if packed is not None:
        data: bytes = packed()
        return data if len(data) == count * 4 else data[: count * 4]
    try:
        buf = array("I", tokens)  # every token is validated, also those of a trailing partial block
    except (OverflowError, TypeError) as exc:
        raise InvalidArgument(f"tokens: every token id must be an integer in [0, 2**32): {exc}", field="tokens") from None
    if buf.itemsize != 4:  # pragma: no cover - exotic platforms
        buf = array("L", buf)
    if _BIG_ENDIAN:  # pragma: no cover
        buf.byteswap()
    if len(buf) != count:
        del buf[count:]
    return buf.tobytes()


def local_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_namespace: str | None = None,
    seed: int | None = None,
    block_mm_hashes: Mapping[int, Iterable[int]] | None = None,
    eagle: bool = False,
) -> list[int]:
    """Local (chunk) hashes of the full blocks of ``tokens``.

    ``block_mm_hashes`` maps a block index to the u64 hashes of the multimodal objects in it; they are
    appended (sorted ascending, little-endian u64) to that block's token bytes. ``eagle`` hashes windows
    of ``block_size + 1`` tokens with stride ``block_size``.
    """
    if block_size <= 0:
        raise InvalidArgument(f"block_size must be a positive integer, got {block_size!r}", field="block_size")
    if seed is None:
        seed = block_seed(lora_name, cache_namespace)
    if eagle:
        n = max(0, (len(tokens) - 1) // block_size)
        window = block_size + 1
        data = _token_bytes(tokens, n * block_size + 1 if n else 0)
        step = block_size * 4
        width = window * 4
        out = [_xxh3(data[i * step : i * step + width], seed) for i in range(n)]
    else:
        n = len(tokens) // block_size
        data = _token_bytes(tokens, n * block_size)
        step = block_size * 4
        out = [_xxh3(data[i : i + step], seed) for i in range(0, n * step, step)]
    if block_mm_hashes:
        for idx, mm in block_mm_hashes.items():
            if 0 <= idx < n:
                lo = idx * block_size * 4
                width = (block_size + 1) * 4 if eagle else block_size * 4
                extra = b"".join(struct.pack("<Q", to_u64(h)) for h in sorted(to_u64(h) for h in mm))
                if extra:
                    out[idx] = _xxh3(data[lo : lo + width] + extra, seed)
    return out


def sequence_hashes(local_hashes: Sequence[int]) -> list[int]:
    """Rolling sequence hashes: ``seq[0] = local[0]``, ``seq[i] = XXH3(le(seq[i-1]) || le(local[i]), 1337)``."""
    return extend_sequence_hashes(None, local_hashes)


def _check_u64(value: object, what: str) -> None:
    """TypeError (not an int) or OverflowError (outside [0, 2**64)), the types the native function raises."""
    if not isinstance(value, int):
        raise TypeError(f"{what} must be an int in [0, 2**64), got {type(value).__name__}")
    if not 0 <= value <= U64_MASK:
        raise OverflowError(f"{what} must be in [0, 2**64) (an unsigned 64-bit hash)")


def extend_sequence_hashes_py(parent: int | None, local_hashes: Sequence[int]) -> list[int]:
    """Sequence hashes of ``local_hashes`` continuing a chain whose last sequence hash is ``parent``.

    The reference (and the fallback) for the native ``kvemu._blockhash``; every value must be a u64, and the
    first one that is not raises, as there. The checks cost nothing on valid input: struct.pack checks all
    but the first local hash, which is checked at the end.
    """
    if parent is not None:
        _check_u64(parent, "parent")
    out: list[int] = []
    append = out.append
    prev = parent
    try:
        for h in local_hashes:
            prev = h if prev is None else _xxh3(_pack_pair(prev, h), BASE_SEED)
            append(prev)
    except (struct.error, TypeError):  # TypeError: the compiled build unboxes each item as an int
        for i, item in enumerate(cast("Sequence[object]", local_hashes)):
            _check_u64(item, f"local_hashes[{i}]")
        raise
    if parent is None and out:
        _check_u64(out[0], "local_hashes[0]")
    return out


def _native_extend() -> Callable[[int | None, Sequence[int]], list[int]] | None:
    """The native function when kvemu._build says this install may use it (built, fresh, not forced pure)."""
    if not _build.use_native("kvemu._blockhash"):
        return None
    try:
        module = importlib.import_module("kvemu._blockhash")
    except ImportError:
        return None
    native: Callable[[int | None, Sequence[int]], list[int]] = module.extend_sequence_hashes
    return native


extend_sequence_hashes: Final[Callable[[int | None, Sequence[int]], list[int]]] = (
    _native_extend() or extend_sequence_hashes_py)
"""Sequence hashes of ``local_hashes`` continuing a chain whose last sequence hash is ``parent``: the native
``kvemu._blockhash`` when built, else ``extend_sequence_hashes_py`` (the reference; bit-exact, same errors)."""
