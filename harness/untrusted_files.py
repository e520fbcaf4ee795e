"""Opening the files kvemu is given to read (traces) within bounds: a regular file only (a FIFO, socket or device
is refused before it is opened for good: its open or its reading could wait forever), lines of bounded length and
UTF-8. The scenario checks a trace's path with it; every trace reader reads its lines with it."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from kvemu.errors import InvalidArgument

__all__ = ["MAX_TRACE_LINE_BYTES", "open_trace_file", "trace_file_problem", "trace_lines"]

MAX_TRACE_LINE_BYTES = 16 << 20
"""Longest trace line read (16 MiB, about two million hash ids)."""


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
