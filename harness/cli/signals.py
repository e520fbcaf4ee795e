"""What SIGINT and SIGTERM do while a command runs: a run stopped as Ctrl-C stops it, or signals held for a block."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["held_signals", "terminate_as_interrupt"]


@contextlib.contextmanager
def _signal_handlers(handlers: dict[int, Callable[[int, Any], None]]) -> Iterator[None]:
    """Install ``handlers`` (signal number -> handler) for the block, then put the previous ones back; outside
    the main thread, where signals cannot be set, the block runs with them left alone."""
    import signal

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
    import signal
    import sys

    def note(signum: int, frame: object) -> None:
        caught.append(signal.Signals(signum).name)
        if hurry is not None:
            hurry.set()
        if say is not None:
            print(f"{caught[-1]}: {say}", file=sys.stderr, flush=True)

    return _signal_handlers({signal.SIGINT: note, signal.SIGTERM: note})


def terminate_as_interrupt() -> contextlib.AbstractContextManager[None]:
    """While running, SIGTERM stops the run as Ctrl-C does: a partial report, marked with the signal."""
    import signal

    from harness.runner import Terminated

    def handler(signum: int, frame: object) -> None:
        raise Terminated("SIGTERM")

    return _signal_handlers({signal.SIGTERM: handler})
