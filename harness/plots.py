"""The PNG plots of ``kvemu run``'s report, drawn from compact arrays with matplotlib's object API.

Importing this module costs nothing: numpy and matplotlib are imported when plotting only. The plots use
``matplotlib.figure.Figure`` and ``FigureCanvasAgg`` directly (no pyplot, no backend selection), the
default style whatever the user's matplotlibrc says, a fixed size and dpi (800×450 px) and fixed margins
(a layout engine measures every text first and costs as much as the drawing). The records are first
reduced to numpy arrays of at most a few thousand points a line, plenty for 800 px. The same data gives
identical PNG files on the same matplotlib.

Importing matplotlib costs about as much as drawing the five plots. ``kvemu run`` therefore opens a
``background_renderer()`` around the run: a child process that imports matplotlib while the scenario
runs, then draws the plots from the arrays it is sent (in two processes, given two CPUs) while the
report's other files are written. Without one (a library caller, a single CPU, a renderer that failed)
the plots are drawn in process, the same way: the files are the same either way.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvemu.records import RequestRecord

    from harness.report import RunData

__all__ = ["PLOTS", "write_plots", "start_plots", "background_renderer"]

PLOTS = ("ttft_cdf.png", "e2e_cdf.png", "active_requests.png", "kv_usage.png", "cache_reuse.png")

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000

_FIGSIZE = (8.0, 4.5)
_DPI = 100
_MARGINS = {"left": 0.12, "right": 0.96, "bottom": 0.115, "top": 0.92}
"""Room for the titles and 6-digit tick labels (matplotlib writes 1e6 and beyond with an offset)."""
_PNG_COMPRESS_LEVEL = 3
"""zlib level of the PNG files: about 9% larger than the default level 6, a quarter faster to encode."""
_RENDER_TIMEOUT_S = 120.0
_MAX_POINTS = 2000
_MAX_SERIES_POINTS = 800
_MAX_LEGEND = 16


def _decimate(xs: Any, ys: Any, limit: int = _MAX_POINTS) -> tuple[Any, Any]:
    """Every k-th point (and the last) so that at most about ``limit`` remain: plenty for an 800 px plot."""
    import numpy as np

    n = len(xs)
    if n <= limit:
        return xs, ys
    step = math.ceil(n / limit)
    idx = np.arange(0, n, step)
    if idx[-1] != n - 1:
        idx = np.append(idx, n - 1)
    return xs[idx], ys[idx]


def _first_token(rec: RequestRecord) -> int | None:
    if rec.first_token_ns is not None:
        return rec.first_token_ns
    return rec.token_times_ns[0] if rec.token_times_ns else None


# ---------------------------------------------------------------------------------- compact data


def _cdf_points(values_ns: Iterable[int], count: int) -> tuple[Any, Any] | None:
    """A decimated empirical CDF of ``values_ns`` as (sorted values in ms, fractions), starting at 0."""
    import numpy as np

    if not count:
        return None
    xs = np.sort(np.fromiter(values_ns, dtype=np.int64, count=count)) / NS_PER_MS
    ys = np.arange(1, count + 1, dtype=np.float64) / count
    xs, ys = _decimate(xs, ys)
    return np.concatenate((xs[:1], xs)), np.concatenate(([0.0], ys))  # the step up from 0 at the smallest value


def _rank_series(data: RunData, field: str) -> dict[tuple[int, int], tuple[Any, Any]]:
    """Per (worker, rank): sample times (s) and ``field`` values, by time, decimated."""
    import numpy as np

    by_rank: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for s in sorted(data.samples, key=lambda s: (s.worker_id, s.dp_rank, s.time_ns)):
        ts, vs = by_rank.setdefault((s.worker_id, s.dp_rank), ([], []))
        ts.append(s.time_ns)
        vs.append(getattr(s, field))
    return {key: _decimate(np.array(ts, dtype=np.int64) / NS_PER_S, np.array(vs, dtype=np.int64),
                           _MAX_SERIES_POINTS)
            for key, (ts, vs) in sorted(by_rank.items())}


def _autoscale_marks(data: RunData) -> dict[str, Any] | None:
    """An autoscaled run's applied decisions (time in s, action) and its pool's running and provisioned
    (running + starting + draining) workers as step series, or None without an autoscaler."""
    log = data.autoscale
    if log is None:
        return None
    points = [(p.time_ns, p.running, p.provisioned) for p in log.series if p.pool == log.pool][:_MAX_SERIES_POINTS]
    end = max((s.time_ns for s in data.samples), default=0)
    if points and end > points[-1][0]:  # the last counts hold until the run's last sample
        points.append((end, *points[-1][1:]))
    return {
        "pool": log.pool,
        "decisions": [(d.time_ns / NS_PER_S, d.action) for d in log.decisions if d.applied][:_MAX_SERIES_POINTS],
        "times": [t / NS_PER_S for t, _, _ in points],
        "running": [r for _, r, _ in points],
        "provisioned": [p for _, _, p in points],
    }


def _reuse_curves(done: list[RequestRecord]) -> tuple[int, Any, Any, Any, Any] | None:
    """Engine-found cached / prompt tokens by completion: (window, x1, rolling, x2, cumulative), decimated."""
    import numpy as np

    n = len(done)
    if not n:
        return None
    ordered = sorted(done, key=lambda r: (r.completion_ns, r.request_id))
    window = max(1, min(200, n // 20))
    xs = np.fromiter((r.completion_ns for r in ordered), dtype=np.int64, count=n) / NS_PER_S
    cached = np.cumsum(np.fromiter((r.engine_cached_tokens or 0 for r in ordered), dtype=np.int64, count=n))
    prompt = np.cumsum(np.fromiter((r.isl for r in ordered), dtype=np.int64, count=n))
    win_c, win_i = cached.copy(), prompt.copy()
    win_c[window:] -= cached[:-window]  # the last ``window`` completions
    win_i[window:] -= prompt[:-window]
    rolling = np.divide(win_c, win_i, out=np.zeros(n), where=win_i != 0)
    cumulative = np.divide(cached, prompt, out=np.zeros(n), where=prompt != 0)
    return (window, *_decimate(xs, rolling), *_decimate(xs, cumulative))


# ---------------------------------------------------------------------------------- drawing


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=_FIGSIZE, dpi=_DPI)
    fig.subplots_adjust(**_MARGINS)
    ax = fig.add_subplot()
    ax.set_title(title, y=1.0)  # where matplotlib puts it anyway, without measuring every tick label first
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig: Any, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).print_png(path, metadata={"Software": None},
                                   pil_kwargs={"compress_level": _PNG_COMPRESS_LEVEL})


def _no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _draw_cdf(points: tuple[Any, Any] | None, title: str, xlabel: str, path: Path) -> None:
    fig, ax = _figure(title, xlabel, "fraction of completed requests")
    if points is not None:
        ax.step(*points, where="post")
        ax.set_ylim(0, 1.02)
    else:
        _no_data(ax)
    _save(fig, path)


def _draw_series(series: dict[tuple[int, int], tuple[Any, Any]], title: str, ylabel: str, path: Path,
                 marks: dict[str, Any] | None = None) -> None:
    fig, ax = _figure(title, "scenario time (s)", ylabel)
    if series:
        for (w, r), (xs, ys) in series.items():
            ax.step(xs, ys, where="post", label=f"w{w}/r{r}", linewidth=1)
        if len(series) <= _MAX_LEGEND:
            ax.legend(loc="upper right", fontsize="small", ncols=2 if len(series) > 8 else 1)
    else:
        _no_data(ax)
    if marks is not None:
        _draw_marks(ax, marks)
    _save(fig, path)


def _draw_marks(ax: Any, marks: dict[str, Any]) -> None:
    """Autoscaler decisions as vertical lines (green: add, red: remove) and the pool's workers on a right axis."""
    ax.figure.subplots_adjust(right=0.91)  # room for the right axis' label
    for t, action in marks["decisions"]:
        ax.axvline(t, color="tab:green" if action == "add" else "tab:red", linewidth=0.8, alpha=0.6, linestyle=":")
    if marks["times"]:
        right = ax.twinx()
        right.step(marks["times"], marks["running"], where="post", color="black", linewidth=1.5,
                   label=f"{marks['pool']} workers running")
        right.step(marks["times"], marks["provisioned"], where="post", color="grey", linewidth=1, linestyle="--",
                   label="incl. starting and draining")
        right.set_ylabel("workers")
        right.set_ylim(0, max(marks["provisioned"]) + 1)
        right.legend(loc="upper left", fontsize="small")


def _draw_reuse(curves: tuple[int, Any, Any, Any, Any] | None, path: Path) -> None:
    fig, ax = _figure("Prefix cache reuse (engine-found cached tokens / prompt tokens)",
                      "completion time (s)", "reused fraction")
    if curves is not None:
        window, x1, y1, x2, y2 = curves
        ax.plot(x1, y1, linewidth=1, label=f"rolling, last {window} completions")
        ax.plot(x2, y2, linewidth=1.5, linestyle="--", label="cumulative")
        ax.set_ylim(0, 1.02)
        ax.legend(loc="lower right", fontsize="small")
    else:
        _no_data(ax)
    _save(fig, path)


# ---------------------------------------------------------------------------------- jobs


def _plot_job(data: RunData, outdir: Path) -> dict[str, Any]:
    """Everything the plots show, as compact arrays (picklable, to hand to a renderer process)."""
    done = sorted((r for r in data.records if r.done), key=lambda r: (r.arrival_ns, r.request_id))
    ttft = [f - r.arrival_ns for r in done if (f := _first_token(r)) is not None]
    return {
        "outdir": str(Path(outdir).absolute()),
        "ttft": _cdf_points(ttft, len(ttft)),
        "e2e": _cdf_points((r.completion_ns - r.arrival_ns for r in done), len(done)),  # type: ignore[operator]
        "active": _rank_series(data, "active_requests"),
        "blocks": _rank_series(data, "kv_blocks"),
        "reuse": _reuse_curves(done),
        "autoscale": _autoscale_marks(data),
    }


_HALVES = (("ttft_cdf.png", "e2e_cdf.png", "cache_reuse.png"), ("active_requests.png", "kv_usage.png"))
"""The plots in two sets of about equal drawing time (the renderer process draws one, its fork the other)."""


def _draw(job: dict[str, Any], name: str, path: Path) -> None:
    if name == "ttft_cdf.png":
        _draw_cdf(job["ttft"], "TTFT CDF", "time to first token (ms)", path)
    elif name == "e2e_cdf.png":
        _draw_cdf(job["e2e"], "End-to-end latency CDF", "end-to-end latency (ms)", path)
    elif name == "active_requests.png":
        _draw_series(job["active"], "Active requests per rank (router's view)", "active requests", path,
                     job.get("autoscale"))
    elif name == "kv_usage.png":
        _draw_series(job["blocks"], "KV blocks per rank (router's view)", "KV blocks", path, job.get("autoscale"))
    elif name == "cache_reuse.png":
        _draw_reuse(job["reuse"], path)
    else:
        raise ValueError(f"no plot named {name!r}")


def _render(job: dict[str, Any], names: Iterable[str] = PLOTS) -> list[str]:
    """Draw the plots ``names`` of a job (all by default) into its directory; return every plot's name."""
    import matplotlib.style

    outdir = Path(job["outdir"])
    with matplotlib.style.context("default"):
        for name in names:
            _draw(job, name, outdir / name)
    return list(PLOTS)


def start_plots(data: RunData, outdir: Path) -> Callable[[], list[str]]:
    """Start writing the plots of ``data`` into ``outdir``; call the result to finish (returns their names).

    With an active ``background_renderer()`` the plots are drawn by its process meanwhile; otherwise (or if
    that process fails) the returned function draws them.
    """
    job = _plot_job(data, Path(outdir))
    renderer = _RENDERER
    if renderer is not None and renderer.submit(job):
        def finish() -> list[str]:
            if not renderer.result():
                return _render(job)  # the renderer failed: draw here, so a real error shows
            return list(PLOTS)
        return finish
    return lambda: _render(job)


def write_plots(data: RunData, outdir: Path) -> list[str]:
    """Write the PNG plots of ``PLOTS`` (fixed size and dpi, default style, no timestamps); return their names."""
    return start_plots(data, outdir)()


# ---------------------------------------------------------------------------------- renderer process


def _renderer_command() -> list[str]:
    """This very module (whatever put it on sys.path), not the current directory's files (-P: a stray
    ``timeit.py`` there must not shadow the stdlib)."""
    root = str(Path(__file__).absolute().parents[1])
    code = f"import sys; sys.path.insert(0, {root!r}); from harness.plots import _serve; _serve()"
    return [sys.executable, "-P", "-c", code]


class _Renderer:
    """A child process that imports matplotlib now, then draws the one plot job sent to it."""

    def __init__(self) -> None:
        # A new session: the terminal's Ctrl-C goes to the run, which still writes its (partial) report.
        self.proc = subprocess.Popen(_renderer_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self._exchange: threading.Thread | None = None
        self._ok = False

    def submit(self, job: dict[str, Any]) -> bool:
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
        job = pickle.load(sys.stdin.buffer)
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
            _render(job, theirs)
            code = 0
        finally:
            os._exit(code)
    if pid < 0:
        mine = PLOTS
    _render(job, mine)
    if pid > 0 and os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        _render(job, theirs)  # the fork failed: draw its half here (an error then shows)
    sys.stdout.write("ok\n")
    sys.stdout.flush()
