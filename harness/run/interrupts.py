"""What SIGINT and SIGTERM do while a command or a run goes on: SIGTERM stops a run as Ctrl-C does (``Terminated``,
a ``KeyboardInterrupt`` naming the signal), or both are held for a block that must end (a report being written).

The runner, the load generators and the command line use them; the module imports nothing of the harness.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["RunSignals", "Terminated", "held_signals", "terminate_as_interrupt"]


class Terminated(KeyboardInterrupt):
    """Raised by a signal handler to stop a run the way Ctrl-C does; ``reason`` names the signal."""

    def __init__(self, reason: str = "SIGTERM") -> None:
        super().__init__(reason)
        self.reason = reason


def _say_line(text: str) -> None:
    """Say ``text`` on stderr as one whole line from a signal handler: one ``write`` to the descriptor, so a
    handler run in the middle of another (a signal during a signal's line) cannot split or glue lines, nor
    re-enter stderr's buffer; a stderr without a descriptor (a test's capture) gets the line in one call."""
    line = text + "\n"
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        sys.stderr.write(line)
        return
    with contextlib.suppress(RuntimeError, OSError, ValueError):  # (re-entered while the main thread writes)
        sys.stderr.flush()
    with contextlib.suppress(OSError):  # a closed or broken stderr loses the line, never the run
        os.write(fd, line.encode("utf-8", "replace"))


@contextlib.contextmanager
def _signal_handlers(handlers: dict[int, Callable[[int, Any], None]]) -> Iterator[None]:
    """Install ``handlers`` (signal number -> handler) for the block, then put the previous ones back; outside
    the main thread, where signals cannot be set, the block runs with them left alone."""
    try:
        previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def held_signals(caught: list[str], say: str | None = None,
                 hurry: threading.Event | None = None) -> contextlib.AbstractContextManager[None]:
    """While in this block, SIGINT and SIGTERM are noted in ``caught`` (by name) instead of stopping the process,
    so that what they interrupt (planning a sweep, writing a report, stopping child processes) ends and the caller
    can stop cleanly; with ``say``, each is also said on stderr as ``SIGNAL: SAY``; with ``hurry``, each sets it
    (the block may then cut a wait short: kill its children instead of letting them stop)."""

    def note(signum: int, frame: object) -> None:
        caught.append(signal.Signals(signum).name)
        if hurry is not None:
            hurry.set()
        if say is not None:
            _say_line(f"{caught[-1]}: {say}")

    return _signal_handlers({signal.SIGINT: note, signal.SIGTERM: note})


def terminate_as_interrupt() -> contextlib.AbstractContextManager[None]:
    """While running, SIGTERM stops the run as Ctrl-C does: a partial report, marked with the signal."""

    def handler(signum: int, frame: object) -> None:
        raise Terminated("SIGTERM")

    return _signal_handlers({signal.SIGTERM: handler})


class RunSignals:
    """SIGINT and SIGTERM for the whole life of a live run, the closing of its loop and its report included: the
    first stops the run (``stop``, called in the run's loop), any other is said with ``say`` and otherwise waits
    for the block to end. Python's own handler throughout, never the loop's: a loop's handler is removed as
    the loop closes (into Python's default, which raises anywhere), and blocking the signals in the main thread
    does not keep them from another thread (a progress ticker's) where the kernel may deliver them."""

    def __init__(self, say: str | None = None) -> None:
        self.caught: list[str] = []
        self._say = say
        self._stop: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._installed: contextlib.AbstractContextManager[None] | None = None

    def arm(self, stop: Callable[[], None]) -> None:
        """From inside the run's loop: the first signal calls ``stop`` there (now, if one came already)."""
        self._loop, self._stop = asyncio.get_running_loop(), stop
        if self.caught:
            stop()

    def disarm(self) -> None:
        """The run is over: later signals are only noted and said."""
        self._stop = self._loop = None

    def _note(self, signum: int, frame: object) -> None:
        self.caught.append(signal.Signals(signum).name)
        if len(self.caught) == 1 and self._stop is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop)  # (a handler runs between any two bytecodes of the loop's)
        elif self._say is not None:
            _say_line(f"{self.caught[-1]}: {self._say}")

    def __enter__(self) -> RunSignals:
        self._installed = _signal_handlers({signal.SIGINT: self._note, signal.SIGTERM: self._note})
        self._installed.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._installed is not None
        self._installed.__exit__(None, None, None)
