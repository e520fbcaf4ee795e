"""The hand-over of SIGINT and SIGTERM between a run's own handler and the report's: a signal in between is kept
pending, then said by ``held_signals``; never a bare KeyboardInterrupt that skips the report. Each case runs in a
process of its own (signals are the main thread's, and a test runner's worker may not run tests there)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HAND_OVER = """
import os, signal
from harness.interrupts import defer_signals, held_signals, release_signals
caught = []
defer_signals()
os.kill(os.getpid(), signal.SIGINT)   # Python's default handler would raise KeyboardInterrupt here
os.kill(os.getpid(), signal.SIGTERM)  # and this one would end the process
with held_signals(caught):
    release_signals()
    print(sorted(caught))
release_signals()
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      bool(signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGINT, signal.SIGTERM}))
"""


def test_a_signal_deferred_during_the_hand_over_reaches_held_signals_not_the_default() -> None:
    proc = subprocess.run([sys.executable, "-c", HAND_OVER], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["['SIGINT', 'SIGTERM']", "True False"], proc.stdout + proc.stderr
