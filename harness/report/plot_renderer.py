"""Importing matplotlib costs about as much as drawing the five plots. ``kvemu run`` therefore opens a
``background_renderer()`` around the run: a child process that imports matplotlib while the scenario
runs, then draws the plots from the arrays it is sent (in two processes, given two CPUs) while the
report's other files are written. Without one (a library caller, a single CPU, a renderer that failed)
the plots are drawn in process, the same way: the files are the same either way.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from harness.report.plot_drawing import REGRET_PLOT, PlotJob, plot_names, render

__all__ = ["background_renderer", "submit_to_renderer"]

_RENDER_TIMEOUT_S = 120.0


_HALVES: tuple[tuple[str, ...], tuple[str, ...]] = (("ttft_cdf.png", "e2e_cdf.png", "cache_reuse.png", REGRET_PLOT),
                                                    ("active_requests.png", "kv_usage.png"))
"""The plots in two sets of about equal drawing time (the renderer process draws one, its fork the other; a plot
the job has not is skipped)."""


def _renderer_command() -> list[str]:
    """This very module (whatever put it on sys.path), not the current directory's files (-P: a stray
    ``timeit.py`` there must not shadow the stdlib)."""
    root = str(Path(__file__).absolute().parents[2])
    code = f"import sys; sys.path.insert(0, {root!r}); from harness.report.plot_renderer import _serve; _serve()"
    return [sys.executable, "-P", "-c", code]


class _Renderer:
    """A child process that imports matplotlib now, then draws the one plot job sent to it."""

    def __init__(self) -> None:
        # A new session: the terminal's Ctrl-C goes to the run, which still writes its (partial) report.
        self.proc = subprocess.Popen(_renderer_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self._exchange: threading.Thread | None = None
        self._ok = False

    def submit(self, job: PlotJob) -> bool:
        """Send the job (once, from a thread: the child may still be importing); False if it cannot take it."""
        if self._exchange is not None or self.proc.poll() is not None:
            return False
        payload = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        self._exchange = threading.Thread(target=self._communicate, args=(payload,), daemon=True)
        self._exchange.start()
        return True

    def _communicate(self, payload: bytes) -> None:
        try:
            out, _ = self.proc.communicate(payload, timeout=_RENDER_TIMEOUT_S)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return
        self._ok = self.proc.returncode == 0 and out == b"ok\n"

    def result(self) -> bool:
        """Wait for the submitted job; True if the child wrote every plot."""
        assert self._exchange is not None
        self._exchange.join()
        return self._ok

    def close(self) -> None:
        """Kill the child (and its fork) if it is still running (no job, or interrupted) and reap it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own process group (a new session)
            except (AttributeError, OSError):
                self.proc.kill()
        self.proc.wait()
        if self._exchange is not None:
            self._exchange.join()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError, ValueError):
                    stream.close()


_RENDERER: _Renderer | None = None


def submit_to_renderer(job: PlotJob) -> Callable[[], bool] | None:
    """Hand ``job`` to the active ``background_renderer()``; the result waits for it (True: every plot written).
    None if there is no renderer, or it cannot take the job."""
    renderer = _RENDERER
    if renderer is not None and renderer.submit(job):
        return renderer.result
    return None


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def background_renderer() -> Iterator[None]:
    """Within this block, the first ``write_plots``/``start_plots`` job goes to a child process that has
    imported matplotlib meanwhile.

    Only with at least two usable CPUs (on one, the child would only slow down the run it overlaps); the
    child is killed on exit if it is still running.
    """
    global _RENDERER
    if _RENDERER is not None or _usable_cpus() < 2 or not sys.executable:
        yield
        return
    try:
        renderer = _Renderer()
    except (OSError, ValueError):  # no interpreter to start: draw in process
        yield
        return
    _RENDERER = renderer
    try:
        yield
    finally:
        _RENDERER = None
        renderer.close()


def _preload() -> None:
    """Import what drawing needs: most of the cost of a first plot (drawing a throwaway one saves nothing more)."""
    for name in ("numpy", "matplotlib.figure", "matplotlib.backends.backend_agg", "matplotlib.style"):
        importlib.import_module(name)


def _serve() -> None:
    """The renderer process: import matplotlib, then draw the one job read from stdin; print ``ok`` when done.

    With a second CPU, a fork (matplotlib already imported) draws half of the plots meanwhile.
    """
    with contextlib.suppress(Exception):
        _preload()  # an error shows when drawing (then the parent draws again, in process)
    try:
        job: PlotJob = pickle.load(sys.stdin.buffer)
    except EOFError:  # the run ended without a report
        return
    mine, theirs = _HALVES
    pid = -1
    if hasattr(os, "fork") and _usable_cpus() >= 2:
        with contextlib.suppress(OSError):
            pid = os.fork()
    if pid == 0:  # the fork: draw its half, exit without running the parent's cleanup
        code = 1
        try:
            render(job, theirs)
            code = 0
        finally:
            os._exit(code)
    if pid < 0:
        mine = tuple(plot_names(job))
    render(job, mine)
    if pid > 0 and os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        render(job, theirs)  # the fork failed: draw its half here (an error then shows)
    sys.stdout.write("ok\n")
    sys.stdout.flush()
