"""The hand-over of SIGINT and SIGTERM between a run's own handler and the report's: a signal in between is kept
pending, then said by ``held_signals``; never a bare KeyboardInterrupt that skips the report."""

from __future__ import annotations

import os
import signal

from harness.interrupts import defer_signals, held_signals, release_signals


def test_a_signal_deferred_during_the_hand_over_reaches_held_signals_not_the_default() -> None:
    caught: list[str] = []
    defer_signals()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # Python's default handler would raise KeyboardInterrupt here
        os.kill(os.getpid(), signal.SIGTERM)  # and this one would end the process
        with held_signals(caught):
            release_signals()
            assert sorted(caught) == ["SIGINT", "SIGTERM"]
    finally:
        release_signals()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_release_is_idempotent_and_nothing_stays_blocked() -> None:
    release_signals()
    release_signals()
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGINT, signal.SIGTERM}
