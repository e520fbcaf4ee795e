"""Importing matplotlib costs about as much as drawing the five plots. ``kvemu run`` therefore opens a
``background_renderer()`` around the run: a child process that imports matplotlib while the scenario
runs, then draws the plots from the arrays it is sent (in two processes, given two CPUs) while the
report's other files are written. Without one (a library caller, a single CPU, a renderer that failed)
the plots are drawn in process, the same way: the files are the same either way.

Opened with ``wait=False`` (an interactive ``kvemu run``), the renderer is handed the job and left drawing: the
command ends without waiting, and each plot appears, whole, when it is drawn (written under a temporary name,
then renamed). A renderer that fails then leaves ``PLOTS_ERROR`` in the report's directory instead.
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

__all__ = ["PLOTS_ERROR", "background_renderer", "submit_to_renderer"]

_RENDER_TIMEOUT_S = 120
"""How long a renderer may draw: the parent stops waiting then, and a renderer left drawing kills itself."""

PLOTS_ERROR = "plots-error.txt"
"""Written into the report's directory by a renderer left drawing (``wait=False``) that could not draw a plot."""


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

    def __init__(self, wait: bool = True) -> None:
        # A new session: the terminal's Ctrl-C goes to the run, which still writes its (partial) report; and a
        # renderer left drawing (``wait=False``) outlives this process.
        self.proc = subprocess.Popen(_renderer_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.wait = wait
        self._sender: threading.Thread | None = None
        self._sent = False
        self._released = False
        self._ok: bool | None = None

    def submit(self, job: PlotJob) -> bool:
        """Send the job (once, from a thread: the child may still be importing); False if it cannot take it."""
        if self._sender is not None or self.proc.poll() is not None:
            return False
        payload = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        self._sender = threading.Thread(target=self._send, args=(payload,), daemon=True)
        self._sender.start()
        return True

    def _send(self, payload: bytes) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            stdin.write(payload)
            stdin.close()  # the end of the job
        except (OSError, ValueError):
            return
        self._sent = True

    def result(self) -> bool:
        """Wait for the submitted job; True if the child wrote every plot."""
        assert self._sender is not None
        if self._ok is None:
            self._ok = self._wait_for_job()
        return self._ok

    def _wait_for_job(self) -> bool:
        assert self._sender is not None
        self._sender.join(_RENDER_TIMEOUT_S)
        if not self._sent:
            return False
        try:
            self.proc.wait(_RENDER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return False
        stdout = self.proc.stdout
        assert stdout is not None
        return self.proc.returncode == 0 and stdout.read() == b"ok\n"

    def release(self) -> bool:
        """Leave the child drawing the submitted job after this process ends; False (nothing changed) if the
        job could not be handed over whole."""
        assert self._sender is not None
        self._sender.join(_RENDER_TIMEOUT_S)  # the child reads its job while it imports matplotlib
        if not self._sent:
            return False
        if self.proc.poll() is not None:  # done already: whether it drew them is its result
            return self.result()
        self._released = True
        return True

    def close(self) -> None:
        """Kill the child (and its fork) if it is still running (no job, or interrupted) and reap it; a released
        child is left drawing."""
        if self._released:
            _LEFT_DRAWING.append(self.proc)  # (reaped by a later renderer, if this process lives on)
        elif self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own process group (a new session)
            except (AttributeError, OSError):
                self.proc.kill()
        if not self._released:
            self.proc.wait()
        if self._sender is not None:
            self._sender.join()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError, ValueError):
                    stream.close()


_LEFT_DRAWING: list[subprocess.Popen[bytes]] = []
"""Renderers released by this process: reaped once they end (a long-lived caller must not collect zombies)."""


def _reap_released() -> None:
    _LEFT_DRAWING[:] = [proc for proc in _LEFT_DRAWING if proc.poll() is None]


_RENDERER: _Renderer | None = None


def submit_to_renderer(job: PlotJob) -> Callable[[], bool] | None:
    """Hand ``job`` to the active ``background_renderer()``. The result ends the hand-over: True when every plot
    is written (``wait=True``) or the renderer took the whole job to draw on its own (``wait=False``); False when
    it failed, and the plots must be drawn here. None if there is no renderer, or it cannot take the job."""
    renderer = _RENDERER
    if renderer is not None and renderer.submit(job):
        return renderer.result if renderer.wait else renderer.release
    return None


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def background_renderer(wait: bool = True) -> Iterator[None]:
    """Within this block, the first ``write_plots``/``start_plots`` job goes to a child process that has
    imported matplotlib meanwhile.

    Only with at least two usable CPUs (on one, the child would only slow down the run it overlaps). With
    ``wait``, writing the report waits for the plots, and the child is killed on exit if it is still running;
    without, the report names the plots and the child is left drawing them (see ``PLOTS_ERROR``).
    """
    global _RENDERER
    _reap_released()
    if _RENDERER is not None or _usable_cpus() < 2 or not sys.executable:
        yield
        return
    try:
        renderer = _Renderer(wait)
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


_JOB: PlotJob | None = None
"""The job this renderer process draws (for ``_out_of_time``)."""


def _read_job(into: list[bytes]) -> None:
    into.append(sys.stdin.buffer.read())


def _out_of_time(signum: int, frame: object) -> None:
    if _JOB is not None:
        _say_why(_JOB, TimeoutError(f"still drawing after {_RENDER_TIMEOUT_S} s"))
    os._exit(1)


def _serve() -> None:
    """The renderer process: import matplotlib while reading the job from stdin, draw it, print ``ok`` when done.

    With a second CPU, a fork (matplotlib already imported) draws half of the plots meanwhile. Left drawing by a
    parent that has ended, it gives up after ``_RENDER_TIMEOUT_S`` and says why in ``PLOTS_ERROR``.
    """
    global _JOB
    signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(_RENDER_TIMEOUT_S)
    received: list[bytes] = []
    reader = threading.Thread(target=_read_job, args=(received,), daemon=True)
    reader.start()  # the parent's hand-over ends as soon as the job is read, not once matplotlib is imported
    with contextlib.suppress(Exception):
        _preload()  # an error shows when drawing (then the parent draws again, in process)
    reader.join()
    try:
        job: PlotJob = pickle.loads(received[0])
    except (EOFError, pickle.UnpicklingError, IndexError):  # the run ended without a report
        return
    _JOB = job
    try:
        _draw_job(job)
    except BaseException as exc:
        _say_why(job, exc)
        raise
    with contextlib.suppress(OSError):  # (a parent that has ended reads nothing)
        sys.stdout.write("ok\n")
        sys.stdout.flush()


def _draw_job(job: PlotJob) -> None:
    mine, theirs = _HALVES
    pid = -1
    if hasattr(os, "fork") and _usable_cpus() >= 2:
        with contextlib.suppress(OSError):
            pid = os.fork()
    if pid == 0:  # the fork: draw its half, exit without running the parent's cleanup
        code = 1
        try:
            signal.alarm(_RENDER_TIMEOUT_S)
            render(job, theirs)
            code = 0
        finally:
            os._exit(code)
    if pid < 0:
        mine = tuple(plot_names(job))
    render(job, mine)
    if pid > 0 and os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        render(job, theirs)  # the fork failed: draw its half here (an error then shows)


def _say_why(job: PlotJob, exc: BaseException) -> None:
    """``PLOTS_ERROR`` in the report's directory: what failed, for a reader the parent can no longer tell; written
    under a temporary name, then renamed, as the plots are (a reader never sees it empty or half written)."""
    path = Path(job.outdir) / PLOTS_ERROR
    part = path.with_name(f".{path.name}.{os.getpid()}.part")  # (both renderer processes may fail)
    with contextlib.suppress(OSError):
        part.write_text(f"kvemu: the plots could not be drawn: {type(exc).__name__}: {exc}\n")
        os.replace(part, path)
    with contextlib.suppress(OSError):
        part.unlink(missing_ok=True)
