"""Reading trace files within bounds, and checking one row's fields: every error names file, line and field.

``json_lines`` reads JSON Lines (or gzip-compressed JSON Lines) within its bounds: line
bytes, rows (``open_trace_file``, ``trace_lines``: every trace reader's file and lines). ``Row`` wraps one decoded object; its getters check a field's type and range (integers bounded,
floats finite) and raise ``InvalidArgument`` as ``FILE:LINE: FIELD: what is wrong; what to do``.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from kvemu.errors import InvalidArgument
from kvemu.limits import MAX_ID_CHARS, MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, MAX_TRACE_MS

from harness.untrusted_files import MAX_TRACE_LINE_BYTES, open_trace_file, trace_file_problem, trace_lines

__all__ = ["MAX_ID_BYTES", "MAX_HASH_IDS", "MAX_TRACE_NS", "Row", "json_lines", "line_count", "open_text", "ms_to_ns",
           "ns_to_ms", "MAX_PROMPT_TOKENS", "MAX_OUTPUT_TOKENS", "MAX_TRACE_MS", "MAX_TRACE_LINE_BYTES", "MAX_TRACE_ROWS",
           "error", "open_trace_file", "trace_file_problem", "trace_lines", "too_many_rows", "row_past"]

MAX_TRACE_ROWS = 10_000_000
"""Most rows a trace may hold (the requests a scenario may send): reading stops at the row past it."""
MAX_ID_BYTES = MAX_ID_CHARS
"""Longest request, session, play or model id (bytes): what a router takes over ZeroMQ or HTTP (``kvemu.limits``),
so a trace row's ids travel to it unchanged."""
MAX_HASH_IDS = MAX_PROMPT_TOKENS
"""Most hash ids a row may hold (one per block of the longest prompt kvemu simulates)."""
MAX_TRACE_NS = round(MAX_TRACE_MS * 1_000_000)
"""Latest time and longest delay a trace may give (ten years, in ns)."""
_U64 = 1 << 64


def too_many_rows(path: str | Path, lineno: int, max_rows: int) -> str:
    """The error for a trace with more than ``max_rows`` rows, at ``lineno`` (the row past them)."""
    return (f"{path}:{lineno}: more than {max_rows:,} rows, the most a trace may hold (the requests a scenario may "
            "send); set run.max_requests to read the first ones, or split the trace")


def row_past(fh: Any, max_rows: int, chunk: int = 1 << 20) -> int | None:
    """The line number of the row past ``max_rows`` in ``fh`` (None if it has no more rows): newlines are
    counted in chunks (no row parsed or kept; about a second for 10^7 lines), and only a file with more
    lines than that is scanned for its non-blank ones."""
    lines = 0
    while block := fh.read(chunk):
        lines += block.count(b"\n")
    if lines + 1 <= max_rows:  # (a last line may lack its newline)
        return None
    fh.seek(0)
    rows = 0
    for lineno, raw in enumerate(iter(lambda: fh.readline(MAX_TRACE_LINE_BYTES + 1), b""), 1):
        if raw.strip():
            rows += 1
            if rows > max_rows:
                return lineno
    return None


def error(file: str, line: int, field: str, what: str) -> InvalidArgument:
    """A bad value's error: ``FILE:LINE: FIELD: what`` (``field`` also as the attribute)."""
    return InvalidArgument(f"{file}:{line}: {field}: {what}", field=field)


def ms_to_ns(ms: float) -> int:
    """Milliseconds (a trace's float) as integer nanoseconds: the whole part exactly (unix times in ms are
    beyond a float's nanoseconds), the fraction rounded."""
    whole = math.floor(ms)
    return int(whole) * 1_000_000 + round((ms - whole) * 1_000_000)


def ns_to_ms(ns: int) -> float | int:
    """Integer nanoseconds as the milliseconds a trace writes (an int when whole, so files stay short)."""
    whole, rest = divmod(ns, 1_000_000)
    return whole if not rest else ns / 1_000_000


def open_text(path: Path) -> IO[bytes]:
    """The file's bytes, decompressed when it is gzip (by its magic number, not its name); a FIFO, socket or
    device is refused (``open_trace_file``)."""
    fh = open_trace_file(path)
    if fh.read(2) == b"\x1f\x8b":
        fh.close()
        return gzip.open(path, "rb")  # type: ignore[return-value]
    fh.seek(0)
    return fh


def line_count(path: Path, chunk: int = 1 << 20) -> int:
    """The lines of a trace file (decompressed), counted without parsing any: about a second for 10^7."""
    lines, last = 0, b"\n"
    with open_text(path) as fh:
        while block := fh.read(chunk):
            lines, last = lines + block.count(b"\n"), block[-1:]
    return lines + (last != b"\n")


def json_lines(path: Path, *, max_rows: int = MAX_TRACE_ROWS, what: str = "JSON object") -> Iterator[Row]:
    """Each non-blank line of a JSON Lines file as a ``Row`` (1-based line numbers); a line too long, not
    UTF-8, not JSON or not an object, or the row past ``max_rows``, is refused naming the file and line."""
    file = str(path)
    rows = 0
    with open_text(path) as fh:
        for lineno, text in trace_lines(fh, file):
            rows += 1
            if rows > max_rows:
                raise InvalidArgument(f"{file}:{lineno}: more than {max_rows:,} rows, the most a trace may hold; "
                                      "split the trace", field="max_requests")
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{file}:{lineno}: not JSON ({exc.msg}); each line must be one {what}") \
                    from None
            except RecursionError:
                raise InvalidArgument(f"{file}:{lineno}: JSON nested too deeply") from None
            if not isinstance(data, dict):
                raise InvalidArgument(f"{file}:{lineno}: a row must be a {what}, got {type(data).__name__}")
            yield Row(file, lineno, data)


class Row:
    """One decoded object of a trace, with typed, bounded getters (``prefix`` names nested fields)."""

    __slots__ = ("file", "line", "data", "prefix")

    def __init__(self, file: str, line: int, data: Mapping[str, Any], prefix: str = "") -> None:
        self.file = file
        self.line = line
        self.data = data
        self.prefix = prefix

    def name(self, key: str) -> str:
        """The full field name of ``key`` (with the nesting prefix)."""
        return f"{self.prefix}{key}"

    def error(self, key: str, what: str) -> InvalidArgument:
        """The error of field ``key`` of this row."""
        return error(self.file, self.line, self.name(key), what)

    def has(self, key: str) -> bool:
        """Whether the row sets ``key`` (to anything but null)."""
        return self.data.get(key) is not None

    def alias(self, key: str, other: str) -> str:
        """Which of two names of one field the row uses (``key`` when neither); both is refused."""
        if self.has(key) and self.has(other):
            raise self.error(other, f"sets both {key!r} and {other!r}, two names of one field; keep one")
        return other if self.has(other) else key

    def sub(self, key: str, required: bool = False) -> Row | None:
        """The nested object at ``key`` as a ``Row`` (None when absent and not required)."""
        value = self.data.get(key)
        if value is None:
            if required:
                raise self.error(key, "missing; it is required")
            return None
        if not isinstance(value, dict):
            raise self.error(key, f"must be an object, got {type(value).__name__}")
        return Row(self.file, self.line, value, self.name(key) + ".")

    def items(self, key: str, *, required: bool = False, limit: int = MAX_HASH_IDS) -> list[Any]:
        """The list at ``key`` (empty when absent and not required), at most ``limit`` long."""
        value = self.data.get(key)
        if value is None:
            if required:
                raise self.error(key, "missing; it is required")
            return []
        if not isinstance(value, list):
            raise self.error(key, f"must be a list, got {type(value).__name__}")
        if len(value) > limit:
            raise self.error(key, f"holds {len(value):,} items, more than the {limit:,} kvemu reads")
        return value

    def objects(self, key: str, *, required: bool = False) -> list[Row]:
        """The list of objects at ``key`` as ``Row``s named ``key[i].``."""
        out = []
        for i, value in enumerate(self.items(key, required=required)):
            if not isinstance(value, dict):
                raise self.error(f"{key}[{i}]", f"must be an object, got {type(value).__name__}")
            out.append(Row(self.file, self.line, value, f"{self.name(key)}[{i}]."))
        return out

    def string(self, key: str, *, required: bool = True, default: str = "", numbers: bool = False) -> str:
        """A non-empty string of at most ``MAX_ID_BYTES`` bytes (``numbers``: an integer is taken as its text)."""
        value = self.data.get(key)
        if value is None:
            if required:
                raise self.error(key, "missing; it is required")
            return default
        if numbers and type(value) is int:
            value = str(value)
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {type(value).__name__}")
        if not value:
            raise self.error(key, "is empty; give a non-empty id")
        if len(value.encode()) > MAX_ID_BYTES:
            raise self.error(key, f"is {len(value.encode())} bytes long, more than {MAX_ID_BYTES}")
        return value

    def integer(self, key: str, *, low: int = 0, high: int = _U64 - 1, required: bool = True,
                default: int = 0) -> int:
        """An integer in ``[low, high]`` (a JSON float with no fraction is not one)."""
        value = self.data.get(key)
        if value is None:
            if required:
                raise self.error(key, "missing; it is required")
            return default
        if type(value) is not int or not low <= value <= high:
            raise self.error(key, f"must be an integer in [{low:,}, {high:,}], got {value!r}")
        return value

    def number(self, key: str, *, required: bool = False, default: float = 0.0, high: float = MAX_TRACE_MS,
               unit: str = "ms") -> float:
        """A finite number in ``[0, high]`` (a time or a delay, in ``unit``)."""
        value = self.data.get(key)
        if value is None:
            if required:
                raise self.error(key, f"missing; it is required ({unit})")
            return default
        if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= high:
            raise self.error(key, f"must be a finite number of {unit} in [0, {high:.3g}], got {value!r}")
        return float(value)

    def ms(self, key: str, *, required: bool = False, default_ns: int = 0) -> int:
        """A time or delay given in milliseconds, as ns."""
        if not self.has(key) and not required:
            return default_ns
        return ms_to_ns(self.number(key, required=required))

    def seconds(self, key: str, *, required: bool = False, default_ns: int = 0) -> int:
        """A time or delay given in seconds, as ns."""
        if not self.has(key) and not required:
            return default_ns
        return round(self.number(key, required=required, high=MAX_TRACE_MS / 1000, unit="s") * 1_000_000_000)

    def hash_ids(self, key: str = "hash_ids", *, required: bool = True) -> list[int]:
        """Unsigned 64-bit hash ids (at most ``MAX_HASH_IDS``)."""
        if required and not self.has(key):
            raise self.error(key, "missing; each row needs the hash id of every block of its prompt")
        ids = self.items(key)
        for j, h in enumerate(ids):
            if type(h) is not int or not 0 <= h < _U64:
                raise self.error(f"{key}[{j}]", f"must be an integer in [0, 2**64), got {h!r}")
        return ids

    def token_ids(self, key: str, output_length: int) -> list[int] | None:
        """``output_token_ids``: u32 token ids, exactly ``output_length`` of them (None when absent)."""
        if not self.has(key):
            return None
        ids = self.items(key, limit=MAX_OUTPUT_TOKENS)
        if any(type(t) is not int or not 0 <= t < 1 << 32 for t in ids):
            raise self.error(key, "must be a list of integers in [0, 2**32)")
        if len(ids) != output_length:
            raise self.error(key, f"holds {len(ids)} ids but output_length is {output_length}; they must match")
        return ids

    def input_length(self, key: str = "input_length", alias: str = "input_tokens", *, required: bool = True,
                     default: int = 0) -> int:
        """The prompt length (``input_length`` or its alias ``input_tokens``), in [1, MAX_PROMPT_TOKENS]."""
        key = self.alias(key, alias)
        return self.integer(key, low=1, high=MAX_PROMPT_TOKENS, required=required, default=default)

    def output_length(self, key: str = "output_length", alias: str = "output_tokens", *, required: bool = True
                      ) -> int:
        """The output length (``output_length`` or ``output_tokens``), in [0, MAX_OUTPUT_TOKENS]."""
        key = self.alias(key, alias)
        return self.integer(key, high=MAX_OUTPUT_TOKENS, required=required)


def check_capacity(row: Row, hash_ids: Sequence[int], input_length: int, block_size: int, *, exact: bool,
                   key: str = "hash_ids") -> None:
    """``len(hash_ids)`` against ``ceil(input_length / block_size)``: equal (``exact``) or at least it."""
    need = -(-input_length // block_size)
    if not hash_ids:
        raise row.error(key, "is empty; a request needs at least one block of prompt")
    if exact and len(hash_ids) != need:
        raise row.error(key, f"requires exactly {need} hash_ids (ceil(input_length {input_length} / block_size "
                             f"{block_size})), got {len(hash_ids)}")
    if not exact and len(hash_ids) < need:
        raise row.error("input_length", f"{input_length} tokens need {need} hash_ids of {block_size} tokens, the "
                                        f"row has {len(hash_ids)}; lower input_length or add hash ids")
