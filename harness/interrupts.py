"""What SIGINT and SIGTERM do while a command or a run goes on: SIGTERM stops a run as Ctrl-C does (``Terminated``,
a ``KeyboardInterrupt`` naming the signal), or both are held for a block that must end (a report being written).

The runner, the load generators and the command line use them; the module imports nothing of the harness.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Terminated", "defer_signals", "held_signals", "release_signals", "terminate_as_interrupt"]

HANDED_OVER = {signal.SIGINT, signal.SIGTERM}
"""The signals a run hands from one handler to the next (``defer_signals``)."""


class Terminated(KeyboardInterrupt):
    """Raised by a signal handler to stop a run the way Ctrl-C does; ``reason`` names the signal."""

    def __init__(self, reason: str = "SIGTERM") -> None:
        super().__init__(reason)
        self.reason = reason


def defer_signals() -> None:
    """Keep SIGINT and SIGTERM pending (the kernel holds them) until ``release_signals``: for the hand-over from a
    run's own handler (an event loop's, which puts Python's default back as it closes) to ``held_signals``, so a
    second Ctrl-C then is neither lost nor a bare KeyboardInterrupt that skips the report. Main thread only."""
    if threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_BLOCK, HANDED_OVER)


def release_signals() -> None:
    """Deliver what ``defer_signals`` kept pending, to the handlers installed now (idempotent)."""
    if threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDED_OVER)


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
            print(f"{caught[-1]}: {say}", file=sys.stderr, flush=True)

    return _signal_handlers({signal.SIGINT: note, signal.SIGTERM: note})


def terminate_as_interrupt() -> contextlib.AbstractContextManager[None]:
    """While running, SIGTERM stops the run as Ctrl-C does: a partial report, marked with the signal."""

    def handler(signum: int, frame: object) -> None:
        raise Terminated("SIGTERM")

    return _signal_handlers({signal.SIGTERM: handler})
