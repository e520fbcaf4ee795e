"""Interpolated timing: pass latencies read from profile data measured on a real GPU (the reference mocker's
``dynamo_profile`` provider).

Prefill time is a 1-D linear interpolation over the new prompt tokens of the pass, extrapolated past both
ends with the end segment's slope and clamped at 0. Decode time is a bilinear interpolation over
(active KV tokens, mean context length = active // batch size), extrapolated past every edge with the end
cell (cross term included) and floored at 1 ms. The pool's capacity plays no part. (Measured against
ai-dynamo-runtime 1.6.1; see docs/profiles.md for the file formats and how to measure a GPU.)

Profile files are untrusted input: sizes are bounded before anything is read, NPZ arrays are read without
pickles, and every error is an ``InvalidArgument`` naming the field, array or CSV line at fault.
"""

from __future__ import annotations

import csv
import inspect
import math
import numbers
import os
import tempfile
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, cast

from kvemu.errors import InvalidArgument

__all__ = [
    "ProfileData",
    "ProfileTiming",
    "load_profile",
    "save_profile",
    "profile_from_model",
    "PROFILE_KEYS",
    "CSV_HEADER",
    "MAX_AXIS_POINTS",
    "MAX_GRID_CELLS",
    "MAX_FILE_BYTES",
]

PROFILE_KEYS = ("prefill_isl", "prefill_ttft_ms", "decode_active_kv_tokens", "decode_context_length", "decode_itl")
"""The arrays of a profile, by the names the reference's NPZ uses."""
CSV_HEADER = ("kind", "x", "y", "ms")
"""Header of kvemu's long CSV format: ``prefill,<isl>,,<ttft_ms>`` and ``decode,<active_kv>,<context>,<itl_ms>``."""
MAX_AXIS_POINTS = 100_000
"""Most points one axis may have (profile files are untrusted)."""
MAX_GRID_CELLS = 10_000_000
"""Most cells the decode grid may have."""
MAX_FILE_BYTES = 64 * 1024 * 1024
"""Largest profile file read (checked before reading)."""

_AXES = ("prefill_isl", "decode_active_kv_tokens", "decode_context_length")
_PREFILL_MEMO = 1 << 16
"""Prefill results kept per model (by token count); past it the memo starts afresh."""


# ------------------------------------------------------------------------------------------- the data


def _fmt(v: float) -> str:
    """A number as a user wrote it: ``1000`` rather than ``1000.0``."""
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def _floats(field: str, value: Any, limit: int, where: str = "") -> tuple[float, ...]:
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
            raise InvalidArgument(f"{field}{where}[{i}] is {_fmt(v)}: {what}s must be >= 0", field=field)


def _check_axis(field: str, axis: tuple[float, ...]) -> None:
    if len(axis) < 2:
        raise InvalidArgument(f"{field} needs at least 2 points to interpolate, got {len(axis)}", field=field)
    _check_values(field, axis, "axis value")
    for i in range(1, len(axis)):
        if not axis[i] > axis[i - 1]:
            raise InvalidArgument(
                f"{field} must be strictly increasing: {field}[{i}] = {_fmt(axis[i])} follows "
                f"{field}[{i - 1}] = {_fmt(axis[i - 1])}", field=field)


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
            put(self, name, _floats(name, getattr(self, name), MAX_AXIS_POINTS))
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
        out = tuple(_floats(field, r, cols, f"[{i}]") for i, r in enumerate(raw))
        for i, r in enumerate(out):
            _check_values(field, r, "time", f"[{i}]")
        return out

    @property
    def grid_shape(self) -> tuple[int, int]:
        """``(len(decode_active_kv_tokens), len(decode_context_length))``."""
        return len(self.decode_active_kv_tokens), len(self.decode_context_length)


# ----------------------------------------------------------------------------------------- the model


class ProfileTiming:
    """Timing model interpolating a ``ProfileData`` (the reference's ``dynamo_profile`` provider)."""

    __slots__ = ("data", "_px", "_py", "_pslope", "_prefill_memo", "_dx", "_dy", "_grid")

    batch_aware = True
    """``decode_ms`` takes the number of decoding requests (``PassTimer`` passes it)."""

    def __init__(self, data: ProfileData) -> None:
        if not isinstance(data, ProfileData):
            raise InvalidArgument(f"ProfileTiming needs a ProfileData, got {type(data).__name__}", field="data")
        self.data = data
        xs, ys = list(data.prefill_isl), list(data.prefill_ttft_ms)
        self._px, self._py = xs, ys
        self._pslope = [(ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1)]
        self._prefill_memo: dict[int, float] = {}
        self._dx = list(data.decode_active_kv_tokens)
        self._dy = list(data.decode_context_length)
        self._grid = [list(r) for r in data.decode_itl]

    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> ProfileTiming:
        """The model of the profile file at ``path`` (``.npz`` or ``.csv``; see ``load_profile``)."""
        return cls(load_profile(path))

    def prefill_ms(self, new_tokens: int) -> float:
        """Pass time for ``new_tokens`` new prompt tokens: linear in between points, end slopes beyond; >= 0."""
        if new_tokens <= 0:
            return 0.0
        memo = self._prefill_memo
        t = memo.get(new_tokens)
        if t is None:
            t = self._prefill(new_tokens)
            if len(memo) >= _PREFILL_MEMO:
                memo.clear()
            memo[new_tokens] = t
        return t

    def _prefill(self, n: float) -> float:
        xs, ys, slope = self._px, self._py, self._pslope
        # anchored on the point at or below n (the last point past the end, the first before the start) so
        # that every measured point is reproduced exactly
        if n >= xs[-1]:
            t = ys[-1] + (n - xs[-1]) * slope[-1]
        elif n < xs[0]:
            t = ys[0] + (n - xs[0]) * slope[0]
        else:
            i = bisect_right(xs, n) - 1
            a, b = ys[i], ys[i + 1]
            t = a + (n - xs[i]) * slope[i]
            # never past a neighbour through rounding
            t = (a if t < a else b if t > b else t) if a <= b else (b if t < b else a if t > a else t)
        return t if t > 0.0 else 0.0  # also maps a NaN (an overflowing slope) to 0, as the reference does

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int, batch_size: int) -> float:
        """Pass time for ``batch_size`` decodes holding ``active_kv_tokens``: bilinear on (active, active //
        batch) with the end cells extended beyond the grid; floored at 1 ms. ``total_kv_tokens`` is unused."""
        if batch_size < 1:
            raise InvalidArgument(f"batch_size must be >= 1, got {batch_size!r}", field="batch_size")
        return self.decode_at(active_kv_tokens, active_kv_tokens // batch_size)

    def decode_at(self, active_kv_tokens: float, context_length: float) -> float:
        """Decode pass time at an explicit grid coordinate (``decode_ms`` with the mean context given)."""
        x, y = active_kv_tokens, context_length
        xs, ys = self._dx, self._dy
        i = bisect_right(xs, x) - 1
        i = 0 if i < 0 else len(xs) - 2 if i > len(xs) - 2 else i
        j = bisect_right(ys, y) - 1
        j = 0 if j < 0 else len(ys) - 2 if j > len(ys) - 2 else j
        tx = (x - xs[i]) / (xs[i + 1] - xs[i])
        ty = (y - ys[j]) / (ys[j + 1] - ys[j])
        r0, r1 = self._grid[i], self._grid[i + 1]
        ux, uy = 1.0 - tx, 1.0 - ty
        t = (r0[j] * ux + r1[j] * tx) * uy + (r0[j + 1] * ux + r1[j + 1] * tx) * ty
        return t if t > 1.0 else 1.0  # a NaN is floored too, as the reference does

    def __repr__(self) -> str:
        rows, cols = self.data.grid_shape
        return (f"ProfileTiming(prefill: {len(self._px)} points, "
                f"decode: {rows}x{cols} grid of active_kv_tokens x context_length)")


# ------------------------------------------------------------------------------------------- files


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".npz", ".csv"):
        raise InvalidArgument(f"profile {path}: unknown file type {path.suffix or '(no extension)'!r}; "
                              "expected .npz or .csv", field="path")
    return suffix


def load_profile(path: str | os.PathLike[str]) -> ProfileData:
    """The profile in ``path``: an ``.npz`` with the reference's five arrays or a ``.csv`` in kvemu's long format."""
    path = Path(path)
    suffix = _suffix(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise InvalidArgument(f"profile {path} cannot be read: {exc.strerror or exc}", field="path") from None
    if not path.is_file():
        raise InvalidArgument(f"profile {path} is not a file", field="path")
    if size > MAX_FILE_BYTES:
        raise InvalidArgument(f"profile {path} is {size:,} bytes, more than the {MAX_FILE_BYTES:,} allowed",
                              field="path")
    try:
        return _load_npz(path) if suffix == ".npz" else _load_csv(path)
    except InvalidArgument as exc:
        raise InvalidArgument(f"profile {path}: {exc}", field=exc.field) from None
    except OSError as exc:
        raise InvalidArgument(f"profile {path} cannot be read: {exc.strerror or exc}", field="path") from None


_NDIM = {"prefill_isl": 1, "prefill_ttft_ms": 1, "decode_active_kv_tokens": 1, "decode_context_length": 1,
         "decode_itl": 2}


def _load_npz(path: Path) -> ProfileData:
    import zipfile
    import zlib

    import numpy as np
    from numpy.lib import format as npy

    if not zipfile.is_zipfile(path):
        raise InvalidArgument("not an NPZ file (not a zip archive)", field="path")
    arrays: dict[str, Any] = {}
    try:
        with zipfile.ZipFile(path) as zf:
            members = {n.removesuffix(".npy"): n for n in zf.namelist() if n.endswith(".npy")}
            for key in PROFILE_KEYS:
                if key not in members:
                    has = ", ".join(sorted(members)) or "no arrays"
                    raise InvalidArgument(f"missing array {key!r} (the file has: {has})", field=key)
                with zf.open(members[key]) as f:  # read the header only: shape and dtype before any data
                    version = npy.read_magic(f)
                    if version == (1, 0):
                        shape, _, dtype = npy.read_array_header_1_0(f)
                    elif version == (2, 0):
                        shape, _, dtype = npy.read_array_header_2_0(f)
                    else:
                        raise InvalidArgument(f"{key}: unsupported .npy format version {version}", field=key)
                _check_header(key, shape, dtype)
        with np.load(path, allow_pickle=False) as npz:
            for key in PROFILE_KEYS:
                arrays[key] = npz[members[key].removesuffix(".npy")].astype(np.float64).tolist()
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise InvalidArgument(f"not a readable NPZ file ({exc})", field="path") from None
    except ValueError as exc:
        if isinstance(exc, InvalidArgument):
            raise
        raise InvalidArgument(f"not a readable NPZ file ({exc})", field="path") from None
    return ProfileData(**arrays)


def _check_header(key: str, shape: tuple[int, ...], dtype: Any) -> None:
    if dtype.hasobject or dtype.kind not in "iuf":
        raise InvalidArgument(f"{key} has dtype {dtype}; it must hold real numbers (float64 for the reference)",
                              field=key)
    want = _NDIM[key]
    if len(shape) != want:
        raise InvalidArgument(f"{key} must be {want}-D, got shape {tuple(shape)}", field=key)
    if any(n > MAX_AXIS_POINTS for n in shape) or math.prod(shape) > MAX_GRID_CELLS:
        raise InvalidArgument(f"{key} has shape {tuple(shape)}, more than the {MAX_AXIS_POINTS:,} points per axis "
                              f"or {MAX_GRID_CELLS:,} cells allowed", field=key)


def _csv_rows(path: Path) -> Iterable[tuple[int, str, float, float | None, float]]:
    """``(line, kind, x, y, ms)`` of each data row of a profile CSV (blank and ``#`` lines skipped), checked."""
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = None
        for row in reader:
            line = reader.line_num
            if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
                continue
            cells = [c.strip() for c in row]
            if header is None:
                header = tuple(c.lower() for c in cells)
                if header != CSV_HEADER:
                    raise InvalidArgument(f"line {line}: the header must be {','.join(CSV_HEADER)}, "
                                          f"got {','.join(cells)}", field="kind")
                continue
            if len(cells) != 4:
                raise InvalidArgument(f"line {line}: expected 4 columns ({','.join(CSV_HEADER)}), got {len(cells)}",
                                      field="kind")
            kind = cells[0].lower()
            if kind not in ("prefill", "decode"):
                raise InvalidArgument(f"line {line}: kind must be prefill or decode, got {cells[0]!r}", field="kind")
            x = _csv_number(line, "x", cells[1])
            if kind == "prefill":
                if cells[2]:
                    raise InvalidArgument(f"line {line}: a prefill row leaves y empty (prefill,<isl>,,<ttft_ms>), "
                                          f"got {cells[2]!r}", field="y")
                y = None
            else:
                if not cells[2]:
                    raise InvalidArgument(f"line {line}: a decode row needs y, the context length "
                                          "(decode,<active_kv_tokens>,<context_length>,<itl_ms>)", field="y")
                y = _csv_number(line, "y", cells[2])
            yield line, kind, x, y, _csv_number(line, "ms", cells[3])
        if header is None:
            raise InvalidArgument(f"empty file: expected the header {','.join(CSV_HEADER)}", field="kind")


def _csv_number(line: int, column: str, text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise InvalidArgument(f"line {line}: {column} must be a number, got {text!r}", field=column) from None
    if not math.isfinite(v) or v < 0:
        raise InvalidArgument(f"line {line}: {column} must be a finite number >= 0, got {text!r}", field=column)
    return v


def _load_csv(path: Path) -> ProfileData:
    import numpy as np

    px, pm, pl = array("d"), array("d"), array("q")
    dx, dy, dm, dl = array("d"), array("d"), array("d"), array("q")
    try:
        for line, kind, xv, yv, ms in _csv_rows(path):
            if yv is None:
                px.append(xv)
                pm.append(ms)
                pl.append(line)
            else:
                dx.append(xv)
                dy.append(yv)
                dm.append(ms)
                dl.append(line)
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"not a UTF-8 text file ({exc.reason} at byte {exc.start})", field="path") from None
    except csv.Error as exc:
        raise InvalidArgument(f"not a readable CSV file ({exc})", field="path") from None
    if not px:
        raise InvalidArgument("no prefill rows (prefill,<isl>,,<ttft_ms>)", field="prefill_isl")
    if not dx:
        raise InvalidArgument("no decode rows (decode,<active_kv_tokens>,<context_length>,<itl_ms>)",
                              field="decode_itl")
    # prefill: sort by isl, refuse a repeated point
    x, m, lines = np.frombuffer(px), np.frombuffer(pm), np.frombuffer(pl, dtype=np.int64)
    order = np.argsort(x, kind="stable")
    x, m, lines = x[order], m[order], lines[order]
    dup = np.flatnonzero(x[1:] == x[:-1])
    if dup.size:
        k = int(dup[np.argmin(lines[dup + 1])])
        raise InvalidArgument(f"line {lines[k + 1]}: duplicate prefill point isl={_fmt(float(x[k]))} "
                              f"(also on line {lines[k]})", field="prefill_isl")
    # decode: sort by (active, context), refuse a repeated cell, then every cell of the grid must be present
    a, c, t, lines = np.frombuffer(dx), np.frombuffer(dy), np.frombuffer(dm), np.frombuffer(dl, dtype=np.int64)
    order = np.lexsort((lines, c, a))
    a, c, t, lines = a[order], c[order], t[order], lines[order]
    dup = np.flatnonzero((a[1:] == a[:-1]) & (c[1:] == c[:-1]))
    if dup.size:
        k = int(dup[np.argmin(lines[dup + 1])])
        raise InvalidArgument(f"line {lines[k + 1]}: duplicate decode point active_kv_tokens={_fmt(float(a[k]))}, "
                              f"context_length={_fmt(float(c[k]))} (also on line {lines[k]})", field="decode_itl")
    rows, cols = np.unique(a), np.unique(c)
    for name, axis in (("decode_active_kv_tokens", rows), ("decode_context_length", cols)):
        if axis.size > MAX_AXIS_POINTS:
            raise InvalidArgument(f"{name} has {axis.size:,} distinct values, more than {MAX_AXIS_POINTS:,}",
                                  field=name)
    if rows.size * cols.size > MAX_GRID_CELLS:
        raise InvalidArgument(f"the decode rows span {rows.size:,} x {cols.size:,} cells, more than "
                              f"{MAX_GRID_CELLS:,}", field="decode_itl")
    if rows.size * cols.size != a.size:
        present = np.zeros(rows.size * cols.size, dtype=bool)
        present[np.searchsorted(rows, a) * cols.size + np.searchsorted(cols, c)] = True
        i, j = divmod(int(np.argmin(present)), cols.size)
        raise InvalidArgument(
            f"the decode rows do not form a full grid ({rows.size} active_kv_tokens x {cols.size} context_length "
            f"values need {rows.size * cols.size} rows, found {a.size}); missing active_kv_tokens="
            f"{_fmt(float(rows[i]))}, context_length={_fmt(float(cols[j]))}", field="decode_itl")
    return ProfileData(prefill_isl=x.tolist(), prefill_ttft_ms=m.tolist(), decode_active_kv_tokens=rows.tolist(),
                       decode_context_length=cols.tolist(),
                       decode_itl=t.reshape(rows.size, cols.size).tolist())  # type: ignore[arg-type]  # rows: tuples in __post_init__


def save_profile(data: ProfileData, path: str | os.PathLike[str]) -> None:
    """Write ``data`` to ``path``: ``.npz`` (float64 arrays under the reference's names, loadable by Dynamo's
    mocker) or ``.csv`` (kvemu's long format). The file is replaced atomically."""
    if not isinstance(data, ProfileData):
        raise InvalidArgument(f"save_profile needs a ProfileData, got {type(data).__name__}", field="data")
    path = Path(path)
    suffix = _suffix(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if suffix == ".npz":
            import numpy as np

            with os.fdopen(fd, "wb") as fb:
                # (numpy's stub lets a ** mapping fill allow_pickle; the keys are PROFILE_KEYS)
                np.savez(fb, **{k: np.asarray(getattr(data, k), dtype=np.float64) for k in PROFILE_KEYS})  # type: ignore[arg-type]
        else:
            with os.fdopen(fd, "w", newline="", encoding="utf-8") as ft:
                out = csv.writer(ft, lineterminator="\n")
                out.writerow(CSV_HEADER)
                for x, ms in zip(data.prefill_isl, data.prefill_ttft_ms):
                    out.writerow(("prefill", _fmt(x), "", _fmt(ms)))
                for a, row in zip(data.decode_active_kv_tokens, data.decode_itl):
                    for c, ms in zip(data.decode_context_length, row):
                        out.writerow(("decode", _fmt(a), _fmt(c), _fmt(ms)))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ------------------------------------------------------------------------------- sampling a model


def _token_points(field: str, points: Iterable[int]) -> list[int]:
    out = []
    for i, p in enumerate(_floats(field, points, MAX_AXIS_POINTS)):
        if not p.is_integer():
            raise InvalidArgument(f"{field}[{i}] must be a whole number of tokens, got {p!r}", field=field)
        out.append(int(p))
    return out


def _takes_batch(decode_ms: Any) -> bool:
    """Whether ``decode_ms`` accepts ``(active, total, batch_size)`` (the 2-argument form is the older one)."""
    try:
        inspect.signature(decode_ms).bind(0, 1, 1)
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): assume the current protocol
        return True
    return True


def profile_from_model(model: Any, *, prefill_points: Iterable[int], active_kv_points: Iterable[int],
                       context_points: Iterable[int], total_kv_tokens: int) -> ProfileData:
    """``ProfileData`` sampled from another timing model at the given token counts.

    Decode cell (a, c) is ``model.decode_ms(a, total_kv_tokens, max(1, a // c))``, so the batch's mean context
    is about ``c`` (a batch of ``max(1, a)`` for ``c`` = 0); a model whose ``decode_ms`` takes only
    ``(active, total)`` is called that way. The benchmark writes such a profile to run kvemu and the
    reference mocker side by side on the same timings.
    """
    if isinstance(total_kv_tokens, bool) or not isinstance(total_kv_tokens, numbers.Integral) or total_kv_tokens < 1:
        raise InvalidArgument(f"total_kv_tokens must be an integer >= 1, got {total_kv_tokens!r}",
                              field="total_kv_tokens")
    prefill = _token_points("prefill_isl", prefill_points)
    active = _token_points("decode_active_kv_tokens", active_kv_points)
    context = _token_points("decode_context_length", context_points)
    if len(active) * len(context) > MAX_GRID_CELLS:
        raise InvalidArgument(f"the decode grid would have {len(active) * len(context):,} cells, more than "
                              f"{MAX_GRID_CELLS:,}", field="decode_itl")
    decode = model.decode_ms
    with_batch = _takes_batch(decode)
    total = int(total_kv_tokens)

    def cell(a: int, c: int) -> float:
        if not with_batch:
            return decode(a, total)
        return decode(a, total, max(1, a // c) if c > 0 else max(1, a))

    return ProfileData(
        prefill_isl=prefill,
        prefill_ttft_ms=[model.prefill_ms(n) for n in prefill],
        decode_active_kv_tokens=active,
        decode_context_length=context,
        decode_itl=[[cell(a, c) for c in context] for a in active],
    )


_CACHE: dict[tuple[str, int, int], ProfileTiming] = {}
_CACHE_KEPT = 8


def cached_profile_timing(path: str | os.PathLike[str]) -> ProfileTiming:
    """``ProfileTiming.from_path(path)``, read once per file version (every rank of a cluster shares it)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise InvalidArgument(f"profile {p}: cannot read it: {exc.strerror}", field="path") from None
    key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    model = _CACHE.get(key)
    if model is None:
        if len(_CACHE) >= _CACHE_KEPT:
            _CACHE.clear()
        model = _CACHE[key] = ProfileTiming.from_path(p)
    return model
