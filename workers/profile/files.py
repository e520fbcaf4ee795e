"""Profile files: an ``.npz`` with the reference's five arrays or a ``.csv`` in kvemu's long format, read and
written (docs/profiles.md). Files are untrusted input: sizes are bounded before anything is read, NPZ arrays are
read without pickles, and every error is an ``InvalidArgument`` naming the field, array or CSV line at fault."""

from __future__ import annotations

import csv
import math
import os
import tempfile
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvemu.errors import InvalidArgument
from workers.profile.data import MAX_AXIS_POINTS, MAX_GRID_CELLS, ProfileData, fmt_number

__all__ = ["load_profile", "save_profile", "PROFILE_KEYS", "CSV_HEADER", "MAX_FILE_BYTES"]

PROFILE_KEYS = ("prefill_isl", "prefill_ttft_ms", "decode_active_kv_tokens", "decode_context_length", "decode_itl")
"""The arrays of a profile, by the names the reference's NPZ uses."""
CSV_HEADER = ("kind", "x", "y", "ms")
"""Header of kvemu's long CSV format: ``prefill,<isl>,,<ttft_ms>`` and ``decode,<active_kv>,<context>,<itl_ms>``."""
MAX_FILE_BYTES = 64 * 1024 * 1024
"""Largest profile file read (checked before reading)."""


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
        for line, _kind, xv, yv, ms in _csv_rows(path):
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
        raise InvalidArgument(f"line {lines[k + 1]}: duplicate prefill point isl={fmt_number(float(x[k]))} "
                              f"(also on line {lines[k]})", field="prefill_isl")
    # decode: sort by (active, context), refuse a repeated cell, then every cell of the grid must be present
    a, c, t, lines = np.frombuffer(dx), np.frombuffer(dy), np.frombuffer(dm), np.frombuffer(dl, dtype=np.int64)
    order = np.lexsort((lines, c, a))
    a, c, t, lines = a[order], c[order], t[order], lines[order]
    dup = np.flatnonzero((a[1:] == a[:-1]) & (c[1:] == c[:-1]))
    if dup.size:
        k = int(dup[np.argmin(lines[dup + 1])])
        raise InvalidArgument(f"line {lines[k + 1]}: duplicate decode point "
                              f"active_kv_tokens={fmt_number(float(a[k]))}, context_length={fmt_number(float(c[k]))} "
                              f"(also on line {lines[k]})", field="decode_itl")
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
            f"{fmt_number(float(rows[i]))}, context_length={fmt_number(float(cols[j]))}", field="decode_itl")
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
                    out.writerow(("prefill", fmt_number(x), "", fmt_number(ms)))
                for a, row in zip(data.decode_active_kv_tokens, data.decode_itl):
                    for c, ms in zip(data.decode_context_length, row):
                        out.writerow(("decode", fmt_number(a), fmt_number(c), fmt_number(ms)))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
