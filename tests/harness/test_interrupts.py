"""SIGINT and SIGTERM over a live run's whole life (``RunSignals``): the first stops the run once, every other is
noted and said, whenever it comes (while the run plays, while its loop closes, while its report is written) and
whichever thread the kernel hands it to; never a bare KeyboardInterrupt that skips the report. Each case runs in
a process of its own (signals are the main thread's, and a test runner's worker may not run tests there)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STORM = """
import os, signal, threading, time
import anyio
from harness.run.interrupts import RunSignals
from kvemu.runtime.loop import run_live

stops, storm_over = [], threading.Event()

def storm():  # another thread, signals unblocked (a progress ticker's): the kernel may deliver them there
    for i in range(40):
        os.kill(os.getpid(), signal.SIGTERM if i % 2 else signal.SIGINT)
        time.sleep(0.002)
    storm_over.set()

async def main():
    async with anyio.create_task_group() as play:
        signals.arm(lambda: (stops.append(1), play.cancel_scope.cancel()))
        threading.Thread(target=storm, daemon=True).start()
        await anyio.sleep(60)
    return "stopped"

with RunSignals(say="the report is being written") as signals:
    result = run_live(main)     # the storm goes on while the loop closes
    storm_over.wait(10)
    time.sleep(0.05)
    print(result, len(stops), sorted(set(signals.caught)))
    print(len(signals.caught))
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def test_a_storm_of_signals_from_another_thread_stops_the_run_once_and_every_one_is_noted() -> None:
    proc = subprocess.run([sys.executable, "-c", STORM], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    outcome, caught, default_back = proc.stdout.splitlines()
    assert (outcome, default_back) == ("stopped 1 ['SIGINT', 'SIGTERM']", "True"), proc.stdout + proc.stderr
    said = proc.stderr.splitlines()  # (the kernel merges a signal sent while the same one is pending)
    assert 2 <= int(caught) <= 40 and len(said) == int(caught) - 1 and set(said) == {"SIGINT: the report is being written",
                                             "SIGTERM: the report is being written"}, proc.stderr[-2000:]


EARLY = """
import os, signal
from harness.run.interrupts import RunSignals, Terminated
from kvemu.runtime.loop import run_live

async def main():
    signals.arm(lambda: stops.append(1))  # a signal came before the run could be stopped: it is stopped at once
    return len(stops)

stops = []
with RunSignals() as signals:
    os.kill(os.getpid(), signal.SIGTERM)
    print(run_live(main), signals.caught)
"""


def test_a_signal_before_the_run_is_armed_stops_it_as_it_arms() -> None:
    proc = subprocess.run([sys.executable, "-c", EARLY], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["1 ['SIGTERM']"], proc.stdout + proc.stderr


def test_a_signal_said_during_another_signals_line_leaves_both_lines_whole(monkeypatch) -> None:
    """The storm above once glued two lines together (``print`` writes the text and its newline apart, and a
    handler can run between the two): each line now goes out in one write to stderr's descriptor."""
    import os
    import signal

    from harness.run import interrupts

    read_end, write_end = os.pipe()
    writes: list[bytes] = []
    real_write = os.write
    signals = interrupts.RunSignals(say="the report is being written")
    signals.caught.append("SIGINT")  # the run was stopped already: every later signal is said

    def write_then_signal(fd: int, data: bytes) -> int:
        writes.append(data)
        if len(writes) == 1:  # a second signal lands while the first line is going out
            signals._note(signal.SIGTERM, None)
        return real_write(fd, data)

    class Stderr:
        def fileno(self) -> int:
            return write_end

        def flush(self) -> None:
            pass

        def write(self, text: str) -> int:
            raise AssertionError("a signal's line went through stderr's buffer")

    monkeypatch.setattr(interrupts.sys, "stderr", Stderr())
    monkeypatch.setattr(interrupts.os, "write", write_then_signal)
    signals._note(signal.SIGINT, None)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as said:
        lines = said.read().decode().splitlines()
    assert all(w.endswith(b"written\n") and w.count(b"\n") == 1 for w in writes)
    assert sorted(lines) == ["SIGINT: the report is being written", "SIGTERM: the report is being written"]
