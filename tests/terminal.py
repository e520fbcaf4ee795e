"""A kvemu command run as in a terminal: on a pseudo-terminal, as the leader of its own session, so that a test
sends Ctrl-C as a terminal does (SIGINT to the whole foreground process group, children included)."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


class Terminal:
    """``python -m harness.cli ARGS`` on a pty; ``output`` is everything it wrote (stdout and stderr), escapes
    removed and carriage returns as line ends."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        master, slave = os.openpty()
        self.proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *args], cwd=ROOT, stdin=slave,
                                     stdout=slave, stderr=slave, start_new_session=True,
                                     env={**(env or os.environ), "TERM": "xterm", "COLUMNS": "200"})
        os.close(slave)
        self._master = master
        self._raw = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._master, 65536)
            except OSError:  # EIO: every process holding the pty exited
                return
            if not data:
                return
            self._raw.extend(data)

    @property
    def output(self) -> str:
        return _ANSI.sub("", bytes(self._raw).decode(errors="replace")).replace("\r\n", "\n").replace("\r", "\n")

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """The first match of the regular expression ``pattern`` in the output, polled until ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(pattern, self.output)
            if found:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        found = re.search(pattern, self.output)
        assert found, f"no {pattern!r} within {timeout_s:g} s (exit {self.proc.poll()}): {self.output[-3000:]}"
        return found

    def ctrl_c(self) -> float:
        """SIGINT to the process group, as a terminal sends Ctrl-C (none if it is gone already); returns when
        (``time.monotonic``)."""
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        return time.monotonic()

    def interrupt_when(self, pattern: str, times: int = 1, timeout_s: float = 60.0) -> tuple[int, str]:
        """Once ``pattern`` shows (within ``timeout_s``), Ctrl-C ``times`` times; the exit code (within
        ``timeout_s``) and the whole output."""
        self.wait_for(pattern, timeout_s)
        for _ in range(times):
            self.ctrl_c()
        return self.wait(timeout_s), self.output

    def wait(self, timeout_s: float) -> int:
        """The exit code, once the command exited and its output is read."""
        try:
            code = self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(5)
        return code

    def close(self) -> None:
        """Kill whatever is left of its process group (a failed test) and close the pty."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._reader.join(5)
        os.close(self._master)

    def __enter__(self) -> "Terminal":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
