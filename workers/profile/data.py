"""``ProfileData``: the measured pass latencies of one GPU and model, converted and validated on construction, and
the bounds on its size (profile files are untrusted input)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, cast

from kvemu.errors import InvalidArgument

__all__ = ["ProfileData", "MAX_AXIS_POINTS", "MAX_GRID_CELLS", "float_tuple", "fmt_number"]

MAX_AXIS_POINTS = 100_000
"""Most points one axis may have (profile files are untrusted)."""
MAX_GRID_CELLS = 10_000_000
"""Most cells the decode grid may have."""

_AXES = ("prefill_isl", "decode_active_kv_tokens", "decode_context_length")


def fmt_number(v: float) -> str:
    """A number as a user wrote it: ``1000`` rather than ``1000.0``."""
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def float_tuple(field: str, value: Any, limit: int, where: str = "") -> tuple[float, ...]:
    """``value`` (a sequence of real numbers) as a tuple of floats, at most ``limit`` long."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgument(f"{field}{where} must be a sequence of numbers, got {type(value).__name__}", field=field)
    if hasattr(value, "tolist"):  # a numpy array: its own conversion is fast and yields Python numbers
        value = value.tolist()
        if not isinstance(value, list):
            raise InvalidArgument(f"{field}{where} must be a sequence of numbers, got a scalar", field=field)
    items = tuple(islice(value, limit + 1))
    if len(items) > limit:
        raise InvalidArgument(f"{field}{where} has more than {limit:,} points", field=field)
    if all(type(v) is float for v in items):
        return items
    out = []
    for i, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise InvalidArgument(f"{field}{where}[{i}] must be a number, got {v!r}", field=field)
        out.append(float(v))
    return tuple(out)


def _check_values(field: str, values: tuple[float, ...], what: str, where: str = "") -> None:
    """Every value finite and >= 0; the first one that is not is named by its index."""
    total = sum(values)  # NaN and inf propagate; an overflow to inf just takes the slow path
    if math.isfinite(total) and (not values or min(values) >= 0):
        return
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise InvalidArgument(f"{field}{where}[{i}] is {v!r}: every {what} must be finite", field=field)
        if v < 0:
            raise InvalidArgument(f"{field}{where}[{i}] is {fmt_number(v)}: {what}s must be >= 0", field=field)


def _check_axis(field: str, axis: tuple[float, ...]) -> None:
    if len(axis) < 2:
        raise InvalidArgument(f"{field} needs at least 2 points to interpolate, got {len(axis)}", field=field)
    _check_values(field, axis, "axis value")
    for i in range(1, len(axis)):
        if not axis[i] > axis[i - 1]:
            raise InvalidArgument(
                f"{field} must be strictly increasing: {field}[{i}] = {fmt_number(axis[i])} follows "
                f"{field}[{i - 1}] = {fmt_number(axis[i - 1])}", field=field)


@dataclass(frozen=True, slots=True)
class ProfileData:
    """Measured pass latencies of one GPU and model: prefill time by new tokens, decode time on a grid.

    ``decode_itl[i][j]`` is the decode pass time (ms) at ``decode_active_kv_tokens[i]`` KV tokens in the
    batch and a mean context length of ``decode_context_length[j]``. Sequences of numbers (numpy arrays
    too) are converted to tuples of floats and validated on construction.
    """

    prefill_isl: tuple[float, ...]
    """New prompt tokens computed in a pass (strictly increasing, >= 2 points)."""
    prefill_ttft_ms: tuple[float, ...]
    """Prefill pass time (ms) at each ``prefill_isl``."""
    decode_active_kv_tokens: tuple[float, ...]
    """Summed context of the decoding requests (rows of ``decode_itl``; strictly increasing)."""
    decode_context_length: tuple[float, ...]
    """Mean context length per decoding request (columns of ``decode_itl``; strictly increasing)."""
    decode_itl: tuple[tuple[float, ...], ...]
    """Decode pass time (ms), shape ``len(decode_active_kv_tokens) x len(decode_context_length)``."""

    def __post_init__(self) -> None:
        put = object.__setattr__
        for name in _AXES + ("prefill_ttft_ms",):
            put(self, name, float_tuple(name, getattr(self, name), MAX_AXIS_POINTS))
        for name in _AXES:
            _check_axis(name, getattr(self, name))
        isl, ttft = self.prefill_isl, self.prefill_ttft_ms
        if len(ttft) != len(isl):
            raise InvalidArgument(f"prefill_ttft_ms has {len(ttft)} values but prefill_isl has {len(isl)} points; "
                                  "they must match", field="prefill_ttft_ms")
        _check_values("prefill_ttft_ms", ttft, "time")
        put(self, "decode_itl", self._grid(self.decode_itl))

    def _grid(self, grid: Any) -> tuple[tuple[float, ...], ...]:
        rows, cols = len(self.decode_active_kv_tokens), len(self.decode_context_length)
        field = "decode_itl"
        expected = f"expected shape ({rows}, {cols}) = (len(decode_active_kv_tokens), len(decode_context_length))"
        if rows * cols > MAX_GRID_CELLS:
            raise InvalidArgument(f"decode_itl would have {rows * cols:,} cells, more than {MAX_GRID_CELLS:,}",
                                  field=field)
        if isinstance(grid, (str, bytes)) or not isinstance(grid, Iterable):
            raise InvalidArgument(f"decode_itl must be a 2-D grid of numbers, got {type(grid).__name__}", field=field)
        if hasattr(grid, "tolist"):
            grid = grid.tolist()
        raw = list(islice(grid, MAX_AXIS_POINTS + 1))
        shape = [len(r) if isinstance(r, Sequence) and not isinstance(r, (str, bytes)) else None for r in raw]
        if None in shape:
            raise InvalidArgument(f"decode_itl must be 2-D ({expected}); row {shape.index(None)} is not a sequence",
                                  field=field)
        if len(raw) != rows or any(n != cols for n in shape):
            found = ("(0,)" if not raw else f"({len(raw)}, {shape[0]})" if len(set(shape)) == 1
                     else f"{len(raw)} rows of lengths {sorted(cast('set[int]', set(shape)))}")  # (no None: refused)
            hint = ""
            if rows != cols and len(raw) == cols and all(n == rows for n in shape):
                hint = ("; the grid looks transposed: rows must follow decode_active_kv_tokens and columns "
                        "decode_context_length")
            raise InvalidArgument(f"decode_itl has shape {found}, {expected}{hint}", field=field)
        out = tuple(float_tuple(field, r, cols, f"[{i}]") for i, r in enumerate(raw))
        for i, r in enumerate(out):
            _check_values(field, r, "time", f"[{i}]")
        return out

    @property
    def grid_shape(self) -> tuple[int, int]:
        """``(len(decode_active_kv_tokens), len(decode_context_length))``."""
        return len(self.decode_active_kv_tokens), len(self.decode_context_length)
