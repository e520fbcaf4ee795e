"""Mooncake-style traces, read in one place: rows validated, prompt tokens synthesised from ``hash_ids``.

A trace block of ``trace_block_size`` tokens (default 512) is the token ``hash_id`` repeated; the prompt
is the concatenation, truncated to ``input_length``, which is first clamped to
``len(hash_ids) * trace_block_size``. Equal hash ids therefore mean equal prompt blocks. Hash ids are
unsigned 64-bit integers and a token is the id's low 32 bits, as in the reference's replay.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Iterator, Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import IO, Annotated, Any, NamedTuple

import msgspec
import xxhash

from kvemu.errors import InvalidArgument
from kvemu.limits import MAX_ID_CHARS, MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, U64, Count, I64
from kvemu.token_sequence import TokenSequence
from kvemu.hashing import BASE_SEED, local_block_hashes, sequence_hashes
from workers.request import Request

__all__ = [
    "DEFAULT_TRACE_BLOCK_SIZE",
    "MAX_PROMPT_TOKENS",
    "MAX_OUTPUT_TOKENS",
    "MAX_TRACE_MS",
    "MAX_TRACE_LINE_BYTES",
    "MAX_TRACE_ROWS",
    "MooncakeRow",
    "mooncake_row",
    "open_trace_file",
    "read_mooncake",
    "trace_file_problem",
    "trace_lines",
    "clamped_input_length",
    "expand_hash_ids",
    "HashIdTokens",
    "mooncake_request",
]

DEFAULT_TRACE_BLOCK_SIZE = 512
_U32_MASK = (1 << 32) - 1
_U64_LIMIT = 1 << 64


MAX_TRACE_MS = 3.2e11
"""Latest ``timestamp`` and longest ``delay`` (ms): ten years of scenario time."""
MAX_TRACE_LINE_BYTES = 16 << 20
"""Longest trace line read (16 MiB, about two million hash ids)."""


MAX_TRACE_ROWS = 10_000_000
"""Most rows a trace may hold (the requests a scenario may send): reading stops at the row past it."""


def _is_int(value: object) -> bool:
    return type(value) is int


def _check_trace(hash_ids: Sequence[int], input_length: int, trace_block_size: int) -> None:
    if not _is_int(trace_block_size) or trace_block_size < 1:
        raise InvalidArgument(f"trace_block_size must be an integer >= 1, got {trace_block_size!r}",
                              field="trace_block_size")
    if not _is_int(input_length) or input_length < 0:
        raise InvalidArgument(f"input_length must be an integer >= 0, got {input_length!r}", field="input_length")
    for i, h in enumerate(hash_ids):
        if not _is_int(h) or not 0 <= h < _U64_LIMIT:
            raise InvalidArgument(f"hash_ids[{i}] must be an integer in [0, 2**64), got {h!r}", field="hash_ids")


class MooncakeRow(NamedTuple):
    """One validated trace row (``timestamp``/``delay`` in ms; ``None`` where the row has none).

    ``output_length`` is at least 1: a request always produces one token, even where the trace says 0.
    """

    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int
    timestamp: float | None = None
    delay: float | None = None
    session_id: str | None = None
    output_token_ids: Sequence[int] | None = None


def _number(row: Mapping[str, Any], key: str) -> float | None:
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_TRACE_MS:
        raise InvalidArgument(f"{key} must be a number of ms in [0, {MAX_TRACE_MS:.0e}] (ten years), got {value!r}",
                              field=key)
    return float(value)


def mooncake_row(row: object, trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE) -> MooncakeRow:
    """Validate one decoded trace row; ``InvalidArgument`` names the field (nothing else reads raw rows)."""
    if not isinstance(row, Mapping):
        raise InvalidArgument(f"a trace row must be a JSON object, got {type(row).__name__}")
    for key in ("hash_ids", "input_length", "output_length"):
        if key not in row:
            raise InvalidArgument(f"missing field {key!r}", field=key)
    hash_ids, input_length, output_length = row["hash_ids"], row["input_length"], row["output_length"]
    if not isinstance(hash_ids, (list, tuple)):
        raise InvalidArgument(f"hash_ids must be a list of integers, got {type(hash_ids).__name__}", field="hash_ids")
    _check_trace(hash_ids, input_length, trace_block_size)
    prompt = min(input_length, len(hash_ids) * trace_block_size)
    if prompt < 1:
        raise InvalidArgument(f"empty prompt (input_length {input_length}, {len(hash_ids)} hash ids)",
                              field="input_length")
    if prompt > MAX_PROMPT_TOKENS:
        raise InvalidArgument(f"a prompt of {prompt:,} tokens is longer than kvemu simulates "
                              f"({MAX_PROMPT_TOKENS:,})", field="input_length")
    if not _is_int(output_length) or not 0 <= output_length <= MAX_OUTPUT_TOKENS:
        raise InvalidArgument(f"output_length must be an integer in [0, {MAX_OUTPUT_TOKENS:,}], got {output_length!r}",
                              field="output_length")
    sid = row.get("session_id")
    if sid is not None and len(str(sid).encode()) > MAX_ID_CHARS:
        raise InvalidArgument(f"session_id is {len(str(sid).encode()):,} bytes long, more than the {MAX_ID_CHARS} a "
                              "router takes", field="session_id")
    out_ids = row.get("output_token_ids")
    if out_ids is not None and not (isinstance(out_ids, (list, tuple)) and all(_is_int(t) and 0 <= t <= _U32_MASK for t in out_ids)):
        raise InvalidArgument("output_token_ids must be a list of integers in [0, 2**32)", field="output_token_ids")
    return MooncakeRow(tuple(hash_ids), input_length, max(1, output_length), _number(row, "timestamp"), _number(row, "delay"),
                       None if sid is None else str(sid), out_ids)


_Ms = Annotated[float, msgspec.Meta(ge=0, le=MAX_TRACE_MS)]


class _DecodedRow(msgspec.Struct):
    """A trace row as msgspec decodes it, types and ranges checked in C: the fast path of ``read_mooncake``."""

    hash_ids: Annotated[tuple[U64, ...], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]  # (below 2**64: checked after)
    input_length: Count
    output_length: Annotated[int, msgspec.Meta(ge=0, le=MAX_OUTPUT_TOKENS)]
    timestamp: _Ms | None = None
    delay: _Ms | None = None
    session_id: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)] | I64 | None = None
    output_token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=_U32_MASK)]],
                                msgspec.Meta(max_length=MAX_OUTPUT_TOKENS)] | None = None


_decode_row = msgspec.json.Decoder(_DecodedRow).decode


def _fast_row(line: str, trace_block_size: int) -> MooncakeRow | None:
    """The row of a JSON line that ``mooncake_row(json.loads(line))`` accepts, equal to what it gives; None for
    any other line (that path then names the error), so a valid row skips the per-field Python checks."""
    try:
        r = _decode_row(line)
    except msgspec.MsgspecError:
        return None
    ids = r.hash_ids
    prompt = min(r.input_length, len(ids) * trace_block_size)
    if not 1 <= prompt <= MAX_PROMPT_TOKENS or max(ids) >= _U64_LIMIT:
        return None
    sid = r.session_id
    if type(sid) is str and len(sid) > MAX_ID_CHARS // 4 and len(sid.encode()) > MAX_ID_CHARS:
        return None  # (more bytes than characters: the full path names it)
    return MooncakeRow(ids, r.input_length, max(1, r.output_length), r.timestamp, r.delay,
                       None if sid is None else str(sid), r.output_token_ids)


def read_mooncake(path: str | Path, limit: int | None = None,
                  trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE, *,
                  max_rows: int = MAX_TRACE_ROWS) -> Iterator[tuple[int, MooncakeRow]]:
    """``(line number, row)`` for the first ``limit`` rows (blank lines skipped, not counted), read lazily.

    A bad line raises ``InvalidArgument`` naming the file, the line and the field; so does the row past
    ``max_rows`` when no ``limit`` (at most ``max_rows``) stops the reading first — before it is parsed,
    so that a huge trace is refused at its bound, not after it was all read.
    """
    if limit is None or limit > max_rows:
        limit, bounded = max_rows, True
    else:
        bounded = False
    if limit is not None and limit <= 0:
        return
    n = 0
    fast = _is_int(trace_block_size) and trace_block_size >= 1  # (else every row gets the full path's error)
    with open_trace_file(path) as fh:
        if bounded and fh.seekable():  # refused before any row is parsed and kept (a pipe: at the row past it)
            past = _row_past(fh, max_rows)
            if past is not None:
                raise InvalidArgument(_too_many_rows(path, past, max_rows), field="max_requests")
            fh.seek(0)
        for lineno, line in trace_lines(fh, path):
            if n >= limit:  # (the file grew after the count)
                raise InvalidArgument(_too_many_rows(path, lineno, max_rows), field="max_requests")
            row = _fast_row(line, trace_block_size) if fast else None
            try:
                if row is None:
                    row = mooncake_row(json.loads(line), trace_block_size)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            except InvalidArgument as exc:
                raise InvalidArgument(f"{path}:{lineno}: not a Mooncake trace row: {exc}", field=exc.field) from None
            yield lineno, row
            n += 1
            if n >= limit and not bounded:
                return


_NOT_FILES = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
              (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _not_a_file(mode: int) -> str | None:
    """What a file of ``mode`` is when it is not a regular file or a directory (None: it is one of those)."""
    kind = next((name for test, name in _NOT_FILES if test(mode)), None)
    return None if kind is None else f"{kind}, not a file: kvemu reads a trace from a regular file"


def trace_file_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be a trace (``file not found``; a FIFO, socket or device), without opening it (a FIFO's
    open waits for a writer); None for a regular file or a directory (a corpus of them)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "file not found"
    except OSError as exc:
        return f"cannot read it: {exc.strerror}"
    return _not_a_file(mode)


def open_trace_file(path: str | Path) -> IO[bytes]:
    """``path`` opened for reading if it is a regular file, else ``InvalidArgument`` saying what it is: opened
    without waiting (a FIFO's open would wait for a writer, and its rows could not be counted before reading),
    checked, then read as usual. A missing file raises ``FileNotFoundError``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        problem = "a directory, not a file" if stat.S_ISDIR(mode) else _not_a_file(mode)
        if problem is not None:
            raise InvalidArgument(f"{path}: {problem}", field="trace")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def trace_lines(fh: Any, path: str | Path) -> Iterator[tuple[int, str]]:
    """``(line number, stripped text)`` of each non-blank line of a binary file; a line longer than
    ``MAX_TRACE_LINE_BYTES`` or not UTF-8 is refused naming the file and line (every trace reader's lines)."""
    for lineno, raw in enumerate(iter(lambda: fh.readline(MAX_TRACE_LINE_BYTES + 1), b""), 1):
        if len(raw) > MAX_TRACE_LINE_BYTES:
            raise InvalidArgument(f"{path}:{lineno}: line longer than {MAX_TRACE_LINE_BYTES:,} bytes")
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"{path}:{lineno}: not UTF-8 text (byte {raw[exc.start]:#04x} at column "
                                  f"{exc.start + 1})") from None
        if line:
            yield lineno, line


def _too_many_rows(path: str | Path, lineno: int, max_rows: int) -> str:
    return (f"{path}:{lineno}: more than {max_rows:,} rows, the most a trace may hold (the requests a scenario may "
            "send); set run.max_requests to read the first ones, or split the trace")


def _row_past(fh: Any, max_rows: int, chunk: int = 1 << 20) -> int | None:
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
        out += [h & _U32_MASK] * trace_block_size
    if rest:
        out += [hash_ids[full] & _U32_MASK] * rest
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
        self.hash_ids = tuple(h & _U32_MASK for h in islice(hash_ids, used))
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


def mooncake_request(
    record: MooncakeRow | Mapping[str, Any],
    *,
    request_id: str,
    arrival_ns: int | None = None,
    trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE,
    priority: int = 0,
) -> Request:
    """A ``Request`` from one trace row (validated first if raw); arrival defaults to its ``timestamp`` (ms) in ns.

    Multi-turn ``delay`` records need the caller to resolve their absolute time.
    """
    if not isinstance(record, MooncakeRow):
        try:
            record = mooncake_row(record, trace_block_size)
        except InvalidArgument as exc:
            raise InvalidArgument(f"trace record {request_id!r}: {exc}", field=exc.field) from None
    if arrival_ns is None:
        if record.timestamp is None:
            raise InvalidArgument(f"trace record {request_id!r}: no timestamp and no arrival_ns given")
        arrival_ns = round(record.timestamp * 1_000_000)
    return Request(
        request_id=request_id,
        token_ids=HashIdTokens(record.hash_ids, record.input_length, trace_block_size),
        max_tokens=record.output_length,
        arrival_ns=arrival_ns,
        priority=priority,
        output_token_ids=record.output_token_ids,
    )
