"""The PNG plots of ``kvemu run``'s report, drawn from compact arrays with matplotlib's object API.

Importing this module costs nothing: numpy and matplotlib are imported when plotting only. The plots use
``matplotlib.figure.Figure`` and ``FigureCanvasAgg`` directly (no pyplot, no backend selection), the
default style whatever the user's matplotlibrc says, fixed sizes and dpi (800×450 px; wider with a legend,
which sits right of the axes, never over the data; per-rank plots grow a panel per pool) and fixed margins
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
    from matplotlib.axes import Axes

    from kvemu.records import RequestRecord

    from harness.report.run_data import RunData

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
_LOG_SPAN = 30.0
"""A value axis spanning more than this ratio (max / min) is drawn on a log scale."""


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


_MAX_LINES = 8
"""Ranks a pool's plot draws as lines, each in its own colour (tab10's first 8); past that, a heatmap."""
_MAX_COLUMNS = 400
"""Time columns of a heatmap at most (samples are merged, keeping each column's maximum)."""


def series_form(ranks: int) -> str:
    """How a pool's per-rank series are drawn: ``lines`` (legible up to ``_MAX_LINES`` ranks) or ``heatmap``
    (rank x time, with the pool's mean and max per rank as lines above it)."""
    return "lines" if ranks <= _MAX_LINES else "heatmap"


def _heatmap(series: dict[tuple[int, int], tuple[Any, Any]]) -> tuple[Any, Any]:
    """Ranks x time columns (at most ``_MAX_COLUMNS``; each cell the max of the value holding at its start and
    its samples, NaN before a rank's first sample and after its last: not started yet, or gone) and the
    columns' edges in s."""
    import numpy as np

    t0 = min(float(xs[0]) for xs, _ in series.values())
    t1 = max(float(xs[-1]) for xs, _ in series.values())
    times = np.unique(np.concatenate([xs for xs, _ in series.values()]))
    columns = max(1, min(_MAX_COLUMNS, len(times)))
    edges = np.linspace(t0, t1 if t1 > t0 else t0 + 1.0, columns + 1)
    grid = np.full((len(series), columns), np.nan)
    for row, (xs, ys) in enumerate(series.values()):
        values = ys.astype(np.float64)
        held = np.searchsorted(xs, edges[:-1], side="right") - 1  # the sample holding at each column's start
        live = (held >= 0) & (edges[:-1] <= xs[-1])
        grid[row, live] = values[held[live]]
        idx = np.clip(np.searchsorted(edges, xs, side="right") - 1, 0, columns - 1)
        np.fmax.at(grid[row], idx, values)  # and the column's own samples (fmax: over NaN too)
    return edges, grid


def _rank_panels(data: RunData, field: str) -> list[dict[str, Any]]:
    """Per pool (in ``data.pools`` order): its ranks' sample series of ``field`` (times in s, by time), drawn as
    lines or, past ``_MAX_LINES`` ranks, a heatmap with the pool's mean and max per rank; its rank capacity."""
    import numpy as np

    by_rank: dict[tuple[str, int, int], tuple[list[int], list[int]]] = {}
    for smp in sorted(data.samples, key=lambda x: (x.worker_id, x.dp_rank, x.time_ns)):
        ts, vs = by_rank.setdefault((smp.pool, smp.worker_id, smp.dp_rank), ([], []))
        ts.append(smp.time_ns)
        vs.append(getattr(smp, field))
    order = {pool: i for i, pool in enumerate(data.pools)}
    panels = []
    for pool in sorted({p for p, _, _ in by_rank}, key=lambda p: (order.get(p, len(order)), p)):
        full = {(w, r): (np.array(ts, dtype=np.int64) / NS_PER_S, np.array(vs, dtype=np.int64))
                for (p, w, r), (ts, vs) in sorted(by_rank.items()) if p == pool}
        panel: dict[str, Any] = {"pool": pool, "form": series_form(len(full)),
                                 "capacity": data.pools.get(pool, {}).get("kv_blocks") if field == "kv_blocks" else None}
        if panel["form"] == "lines":
            panel["series"] = {key: _decimate(xs, ys, _MAX_SERIES_POINTS) for key, (xs, ys) in full.items()}
        else:
            edges, grid = _heatmap(full)
            panel["ranks"] = [f"w{w}/r{r}" for w, r in full]
            panel["edges"], panel["grid"] = edges, grid
        panels.append(panel)
    return panels


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


def value_scale(values: Iterable[float]) -> str:
    """``log`` when the positive ``values`` span decades (max / min > ``_LOG_SPAN``), else ``linear``."""
    positive = [v for v in values if v is not None and v > 0]
    return "log" if positive and max(positive) / min(positive) > _LOG_SPAN else "linear"


def new_figure(title: str, xlabel: str, ylabel: str, legend: bool = False) -> tuple[Any, Any]:
    """A one-axes figure; with ``legend``, wider, with room right of the axes for one (``legend_right``)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(_FIGSIZE[0] + 2.4, _FIGSIZE[1]) if legend else _FIGSIZE, dpi=_DPI)
    fig.subplots_adjust(**{**_MARGINS, "left": 0.095, "right": 0.7} if legend else _MARGINS)
    ax = fig.add_subplot()
    ax.set_title(title, y=1.0)  # where matplotlib puts it anyway, without measuring every tick label first
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def save_png(fig: Any, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).print_png(path, metadata={"Software": None},
                                   pil_kwargs={"compress_level": _PNG_COMPRESS_LEVEL})


def no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _draw_cdf(points: tuple[Any, Any] | None, title: str, xlabel: str, path: Path) -> None:
    fig, ax = new_figure(title, xlabel, "fraction of completed requests")
    if points is not None:
        ax.step(*points, where="post")
        ax.set_ylim(0, 1.02)
    else:
        no_data(ax)
    save_png(fig, path)


_PANEL_IN = {"lines": 3.4, "aggregate": 1.9}
"""Height (inches) of a panel of lines and of a heatmap's aggregate axes; a heatmap's grows with its ranks."""


def _heatmap_in(ranks: int) -> float:
    return min(6.0, max(1.6, 0.09 * ranks))


def series_figure(panels: list[dict[str, Any]], title: str, ylabel: str, marks: dict[str, Any] | None = None) -> Any:
    """The figure of a per-rank plot: one panel per pool, stacked (see ``_rank_panels``); legends and colour
    bars right of the axes, never over the data."""
    from matplotlib.figure import Figure

    rows: list[tuple[dict[str, Any], str]] = []
    for panel in panels:
        rows += [(panel, "lines")] if panel["form"] == "lines" else [(panel, "aggregate"), (panel, "heatmap")]
    if not rows:
        fig, ax = new_figure(title, "scenario time (s)", ylabel)
        no_data(ax)
        return fig
    heights = [_heatmap_in(len(p["ranks"])) if kind == "heatmap" else _PANEL_IN[kind] for p, kind in rows]
    top_in, bottom_in, gap_in = 0.45, 0.55, 0.55
    total = sum(heights) + top_in + bottom_in + gap_in * (len(rows) - 1)
    fig = Figure(figsize=(_FIGSIZE[0] + 1.6, total), dpi=_DPI)
    fig.subplots_adjust(left=0.1, right=0.74 if marks is None else 0.68, top=1 - top_in / total,
                        bottom=bottom_in / total, hspace=gap_in * len(rows) / sum(heights))
    grid = fig.add_gridspec(len(rows), 1, height_ratios=heights)
    fig.suptitle(title, y=1 - 0.12 / total)
    axes: list[Axes] = []
    for i, (panel, kind) in enumerate(rows):
        ax = fig.add_subplot(grid[i], sharex=axes[0] if axes else None)
        ax.grid(True, alpha=0.3)
        name = "" if panel["pool"] == "aggregated" and len(panels) == 1 else f"{panel['pool']}: "
        if kind == "lines":
            _draw_lines(ax, panel, f"{name}{ylabel}")
        elif kind == "aggregate":
            _draw_aggregate(ax, panel, f"{name}{ylabel}\nper rank")
        else:
            _draw_heatmap(fig, ax, panel, ylabel)
        axes.append(ax)
    axes[-1].set_xlabel("scenario time (s)")
    twin = _draw_marks(axes[0], marks) if marks is not None else None
    for i, ax in enumerate(axes):
        handles, _ = ax.get_legend_handles_labels()
        if i == 0 and twin is not None:
            handles += twin.get_legend_handles_labels()[0]
        if handles:
            legend_right(ax, handles, offset=0.1 if twin is not None else 0.01)  # past the workers' axis
    return fig


def legend_right(ax: Any, handles: list[Any] | None = None, offset: float = 0.01) -> Any:
    """A legend left-aligned just right of ``ax`` (outside it: it hides no data)."""
    if handles is None:
        handles, _ = ax.get_legend_handles_labels()
    return ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1 + offset, 1), fontsize="small",
                     borderaxespad=0)


def _capacity(ax: Any, panel: dict[str, Any]) -> None:
    if panel["capacity"]:
        ax.axhline(panel["capacity"], color="black", linestyle="--", linewidth=1,
                   label=f"capacity ({panel['capacity']:,} blocks a rank)")
        ax.set_ylim(0, panel["capacity"] * 1.05)


def _draw_lines(ax: Any, panel: dict[str, Any], ylabel: str) -> None:
    """One step line per rank, each in its own colour of tab10, and the rank capacity."""
    for i, ((w, r), (xs, ys)) in enumerate(panel["series"].items()):
        ax.step(xs, ys, where="post", label=f"w{w}/r{r}", linewidth=1, color=f"C{i}")
    _capacity(ax, panel)
    ax.set_ylabel(ylabel)


def _draw_aggregate(ax: Any, panel: dict[str, Any], ylabel: str) -> None:
    """A heatmap pool's mean and max over its ranks per time column, and the rank capacity."""
    import numpy as np

    edges, grid = panel["edges"], panel["grid"]
    seen = ~np.all(np.isnan(grid), axis=0)
    mids = ((edges[:-1] + edges[1:]) / 2)[seen]
    ax.plot(mids, np.nanmean(grid[:, seen], axis=0), linewidth=1.5, color="C0", label=f"mean of {grid.shape[0]} ranks")
    ax.plot(mids, np.nanmax(grid[:, seen], axis=0), linewidth=1, color="C3", label="busiest rank")
    _capacity(ax, panel)
    ax.set_ylabel(ylabel)


def _draw_heatmap(fig: Any, ax: Any, panel: dict[str, Any], label: str) -> None:
    """Ranks (rows) x time, the colour the rank's value from 0 to the largest (the capacity line is in the
    aggregate panel above: scaled to it, a lightly loaded pool would be one colour); a colour bar."""
    import numpy as np

    edges, grid = panel["edges"], panel["grid"]
    n = grid.shape[0]
    top = float(np.nanmax(grid)) if not np.all(np.isnan(grid)) else 0.0
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", origin="lower", cmap="viridis",
                      extent=(edges[0], edges[-1], -0.5, n - 0.5), vmin=0, vmax=max(1.0, top))
    step = max(1, math.ceil(n / 16))
    ax.set_yticks(range(0, n, step), panel["ranks"][::step], fontsize="x-small")
    ax.grid(False)
    ax.set_ylabel("rank")
    bar = fig.colorbar(image, cax=ax.inset_axes((1.01, 0.0, 0.025, 1.0)))  # outside: the time axis stays aligned
    bar.set_label(label, fontsize="small")


def _draw_series(panels: list[dict[str, Any]], title: str, ylabel: str, path: Path,
                 marks: dict[str, Any] | None = None) -> None:
    save_png(series_figure(panels, title, ylabel, marks), path)


def _draw_marks(ax: Any, marks: dict[str, Any]) -> Any:
    """Autoscaler decisions as vertical lines (green: add, red: remove) and the pool's workers on a right axis
    (returned, None without counts)."""
    for t, action in marks["decisions"]:
        ax.axvline(t, color="tab:green" if action == "add" else "tab:red", linewidth=0.8, alpha=0.6, linestyle=":")
    if not marks["times"]:
        return None
    right = ax.twinx()
    right.step(marks["times"], marks["running"], where="post", color="black", linewidth=1.5,
               label=f"{marks['pool']} workers running")
    right.step(marks["times"], marks["provisioned"], where="post", color="grey", linewidth=1, linestyle="--",
               label="incl. starting and draining")
    right.set_ylabel("workers")
    right.set_ylim(0, max(marks["provisioned"]) + 1)
    return right


def _draw_reuse(curves: tuple[int, Any, Any, Any, Any] | None, path: Path) -> None:
    fig, ax = new_figure("Prefix cache reuse (engine-found cached tokens / prompt tokens)",
                      "completion time (s)", "reused fraction", legend=True)
    if curves is not None:
        window, x1, y1, x2, y2 = curves
        ax.plot(x1, y1, linewidth=1, label=f"rolling, last {window} completions")
        ax.plot(x2, y2, linewidth=1.5, linestyle="--", label="cumulative")
        ax.set_ylim(0, 1.02)
        legend_right(ax)
    else:
        no_data(ax)
    save_png(fig, path)


# ---------------------------------------------------------------------------------- jobs


def _plot_job(data: RunData, outdir: Path) -> dict[str, Any]:
    """Everything the plots show, as compact arrays (picklable, to hand to a renderer process)."""
    done = sorted((r for r in data.records if r.done), key=lambda r: (r.arrival_ns, r.request_id))
    ttft = [f - r.arrival_ns for r in done if (f := _first_token(r)) is not None]
    return {
        "outdir": str(Path(outdir).absolute()),
        "ttft": _cdf_points(ttft, len(ttft)),
        "e2e": _cdf_points((r.completion_ns - r.arrival_ns for r in done), len(done)),  # type: ignore[operator]
        "active": _rank_panels(data, "active_requests"),
        "blocks": _rank_panels(data, "kv_blocks"),
        "reuse": _reuse_curves(done),
        "autoscale": _autoscale_marks(data),
    }


_HALVES: tuple[tuple[str, ...], tuple[str, ...]] = (("ttft_cdf.png", "e2e_cdf.png", "cache_reuse.png"), ("active_requests.png", "kv_usage.png"))
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
    root = str(Path(__file__).absolute().parents[2])
    code = f"import sys; sys.path.insert(0, {root!r}); from harness.report.plots import _serve; _serve()"
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
