"""Drawing a run's plots from a plot job (``plot_data``): the CDFs, the per-rank series (lines, or a heatmap past
8 ranks), the cache reuse curves; the default style whatever the user's matplotlibrc says, so the same job gives
identical PNG files on the same matplotlib."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.report.figures import DPI, FIGSIZE, legend_right, new_figure, no_data, save_png

if TYPE_CHECKING:
    import numpy.typing as npt
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    Array = npt.NDArray[Any]  # (of any dtype: times in s are floats, sampled counts ints)

__all__ = ["PLOTS", "REGRET_PLOT", "Points", "RankPanel", "AutoscaleMarks", "ReuseCurves", "RegretCurves", "PlotJob",
           "plot_names", "render", "series_figure"]

PLOTS = ("ttft_cdf.png", "e2e_cdf.png", "active_requests.png", "kv_usage.png", "cache_reuse.png")
"""The plots of every run."""
REGRET_PLOT = "routing_regret.png"
"""The plot of a run with routing truth (the engines in process) only."""


Points = tuple["Array", "Array"]
"""A curve: its x values and its y values (numpy arrays)."""


@dataclass(frozen=True)
class RankPanel:
    """One pool's per-rank series of a sampled figure: a line per rank (``form`` ``lines``: ``series``) or, past 8
    ranks, a heatmap (``heatmap``: ``ranks`` x time columns ``edges``, values ``grid``); its rank capacity."""

    pool: str
    form: str
    capacity: int | None = None
    series: dict[tuple[int, int], Points] = field(default_factory=dict)
    """(worker, DP rank) -> its samples (time s, value)."""
    ranks: list[str] = field(default_factory=list)
    edges: Array | None = None
    grid: Array | None = None


@dataclass(frozen=True)
class AutoscaleMarks:
    """An autoscaled run's applied decisions (time s, ``add``/``remove``) and its pool's running and provisioned
    workers as step series."""

    pool: str
    decisions: list[tuple[float, str]]
    times: list[float]
    running: list[int]
    provisioned: list[int]


@dataclass(frozen=True)
class ReuseCurves:
    """Engine-found cached / prompt tokens by completion time (s): over the last ``window`` completions, and
    cumulative."""

    window: int
    rolling: Points
    cumulative: Points


@dataclass(frozen=True)
class RegretCurves:
    """Routing regret per time bucket (``bucket_s`` wide, ``times`` their middles): the cluster's line and each
    replica's (NaN: a bucket without blocks), each one's overall ratio, and the chaos events (time, label)."""

    bucket_s: int
    times: Array
    lines: dict[str, Array]
    overall: dict[str, float | None]
    marks: list[tuple[float, str]]


@dataclass(frozen=True)
class PlotJob:
    """Everything a run's plots show, as compact arrays (picklable: handed to a renderer process), and where they go."""

    outdir: str
    ttft: Points | None
    e2e: Points | None
    active: list[RankPanel]
    blocks: list[RankPanel]
    reuse: ReuseCurves | None
    autoscale: AutoscaleMarks | None
    regret: RegretCurves | None


def plot_names(job: PlotJob) -> list[str]:
    """The plots a job draws: ``PLOTS``, and ``REGRET_PLOT`` when it has routing truth."""
    return [*PLOTS, *([REGRET_PLOT] if job.regret is not None else [])]


def _draw_cdf(points: Points | None, title: str, xlabel: str, path: Path) -> None:
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


def series_figure(panels: list[RankPanel], title: str, ylabel: str, marks: AutoscaleMarks | None = None) -> Figure:
    """The figure of a per-rank plot: one panel per pool, stacked (see ``plot_data``); legends and colour
    bars right of the axes, never over the data."""
    from matplotlib.figure import Figure

    rows: list[tuple[RankPanel, str]] = []
    for panel in panels:
        rows += [(panel, "lines")] if panel.form == "lines" else [(panel, "aggregate"), (panel, "heatmap")]
    if not rows:
        fig, ax = new_figure(title, "scenario time (s)", ylabel)
        no_data(ax)
        return fig
    heights = [_heatmap_in(len(p.ranks)) if kind == "heatmap" else _PANEL_IN[kind] for p, kind in rows]
    top_in, bottom_in, gap_in = 0.45, 0.55, 0.55
    total = sum(heights) + top_in + bottom_in + gap_in * (len(rows) - 1)
    fig = Figure(figsize=(FIGSIZE[0] + 1.6, total), dpi=DPI)
    fig.subplots_adjust(left=0.1, right=0.74 if marks is None else 0.68, top=1 - top_in / total,
                        bottom=bottom_in / total, hspace=gap_in * len(rows) / sum(heights))
    grid = fig.add_gridspec(len(rows), 1, height_ratios=heights)
    fig.suptitle(title, y=1 - 0.12 / total)
    axes: list[Axes] = []
    for i, (panel, kind) in enumerate(rows):
        ax = fig.add_subplot(grid[i], sharex=axes[0] if axes else None)
        ax.grid(True, alpha=0.3)
        name = "" if panel.pool == "aggregated" and len(panels) == 1 else f"{panel.pool}: "
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


def _capacity(ax: Axes, panel: RankPanel) -> None:
    if panel.capacity:
        ax.axhline(panel.capacity, color="black", linestyle="--", linewidth=1,
                   label=f"capacity ({panel.capacity:,} blocks a rank)")
        ax.set_ylim(0, panel.capacity * 1.05)


def _draw_lines(ax: Axes, panel: RankPanel, ylabel: str) -> None:
    """One step line per rank, each in its own colour of tab10, and the rank capacity."""
    for i, ((w, r), (xs, ys)) in enumerate(panel.series.items()):
        ax.step(xs, ys, where="post", label=f"w{w}/r{r}", linewidth=1, color=f"C{i}")
    _capacity(ax, panel)
    ax.set_ylabel(ylabel)


def _draw_aggregate(ax: Axes, panel: RankPanel, ylabel: str) -> None:
    """A heatmap pool's mean and max over its ranks per time column, and the rank capacity."""
    import numpy as np

    edges, grid = panel.edges, panel.grid
    assert edges is not None and grid is not None
    seen = ~np.all(np.isnan(grid), axis=0)
    mids = ((edges[:-1] + edges[1:]) / 2)[seen]
    ax.plot(mids, np.nanmean(grid[:, seen], axis=0), linewidth=1.5, color="C0", label=f"mean of {grid.shape[0]} ranks")
    ax.plot(mids, np.nanmax(grid[:, seen], axis=0), linewidth=1, color="C3", label="busiest rank")
    _capacity(ax, panel)
    ax.set_ylabel(ylabel)


def _draw_heatmap(fig: Figure, ax: Axes, panel: RankPanel, label: str) -> None:
    """Ranks (rows) x time, the colour the rank's value from 0 to the largest (the capacity line is in the
    aggregate panel above: scaled to it, a lightly loaded pool would be one colour); a colour bar."""
    import numpy as np

    edges, grid = panel.edges, panel.grid
    assert edges is not None and grid is not None
    n = grid.shape[0]
    top = float(np.nanmax(grid)) if not np.all(np.isnan(grid)) else 0.0
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", origin="lower", cmap="viridis",
                      extent=(edges[0], edges[-1], -0.5, n - 0.5), vmin=0, vmax=max(1.0, top))
    step = max(1, math.ceil(n / 16))
    ax.set_yticks(range(0, n, step), panel.ranks[::step], fontsize="x-small")
    ax.grid(False)
    ax.set_ylabel("rank")
    bar = fig.colorbar(image, cax=ax.inset_axes((1.01, 0.0, 0.025, 1.0)))  # outside: the time axis stays aligned
    bar.set_label(label, fontsize="small")


def _draw_series(panels: list[RankPanel], title: str, ylabel: str, path: Path,
                 marks: AutoscaleMarks | None = None) -> None:
    save_png(series_figure(panels, title, ylabel, marks), path)


def _draw_marks(ax: Axes, marks: AutoscaleMarks) -> Axes | None:
    """Autoscaler decisions as vertical lines (green: add, red: remove) and the pool's workers on a right axis
    (returned, None without counts)."""
    for t, action in marks.decisions:
        ax.axvline(t, color="tab:green" if action == "add" else "tab:red", linewidth=0.8, alpha=0.6, linestyle=":")
    if not marks.times:
        return None
    right = ax.twinx()
    right.step(marks.times, marks.running, where="post", color="black", linewidth=1.5,
               label=f"{marks.pool} workers running")
    right.step(marks.times, marks.provisioned, where="post", color="grey", linewidth=1, linestyle="--",
               label="incl. starting and draining")
    right.set_ylabel("workers")
    right.set_ylim(0, max(marks.provisioned) + 1)
    return right


def _draw_reuse(curves: ReuseCurves | None, path: Path) -> None:
    fig, ax = new_figure("Prefix cache reuse (engine-found cached tokens / prompt tokens)",
                      "completion time (s)", "reused fraction", legend=True)
    if curves is not None:
        ax.plot(*curves.rolling, linewidth=1, label=f"rolling, last {curves.window} completions")
        ax.plot(*curves.cumulative, linewidth=1.5, linestyle="--", label="cumulative")
        ax.set_ylim(0, 1.02)
        legend_right(ax)
    else:
        no_data(ax)
    save_png(fig, path)


def _draw_regret(curves: RegretCurves, path: Path) -> None:
    """Regret per time bucket: the cluster's (black) and each replica's, chaos events as labelled dotted lines."""
    width = curves.bucket_s
    fig, ax = new_figure("Routing regret over time (lost / (novel + lost) blocks)",
                         f"time since the first arrival (s), {width} s buckets", "regret ratio", legend=True)
    xs = curves.times
    for i, (name, ys) in enumerate(curves.lines.items()):
        overall = curves.overall[name]
        label = f"{name} ({'—' if overall is None else f'{100 * overall:.1f}%'} overall)"
        style = ({"color": "black", "linewidth": 1.8} if name == "cluster"
                 else {"color": f"C{(i - 1) % 10}", "linewidth": 1})
        ax.plot(xs, ys, marker="o", markersize=2.5, label=label, **style)
    ax.set_ylim(0, 1.02)
    for t, label in curves.marks:
        ax.axvline(t, color="tab:red", linewidth=0.9, linestyle=":", alpha=0.8)
        ax.text(t, 0.98, f" {label}", transform=ax.get_xaxis_transform(), rotation=90, va="top", ha="right",
                fontsize="x-small", color="tab:red")
    legend_right(ax)
    save_png(fig, path)


def _draw(job: PlotJob, name: str, path: Path) -> None:
    if name == "ttft_cdf.png":
        _draw_cdf(job.ttft, "TTFT CDF", "time to first token (ms)", path)
    elif name == "e2e_cdf.png":
        _draw_cdf(job.e2e, "End-to-end latency CDF", "end-to-end latency (ms)", path)
    elif name == "active_requests.png":
        _draw_series(job.active, "Active requests per rank (router's view)", "active requests", path, job.autoscale)
    elif name == "kv_usage.png":
        _draw_series(job.blocks, "KV blocks per rank (router's view)", "KV blocks", path, job.autoscale)
    elif name == "cache_reuse.png":
        _draw_reuse(job.reuse, path)
    elif name == REGRET_PLOT and job.regret is not None:
        _draw_regret(job.regret, path)
    else:
        raise ValueError(f"no plot named {name!r}")


def render(job: PlotJob, names: Iterable[str] | None = None) -> list[str]:
    """Draw those of the plots ``names`` the job has (all by default) into its directory; return every plot's name
    (``plot_names``)."""
    import matplotlib.style

    outdir = Path(job.outdir)
    drawn = plot_names(job)
    with matplotlib.style.context("default"):
        for name in drawn if names is None else names:
            if name in drawn or name not in (*PLOTS, REGRET_PLOT):  # (an unknown name: its error)
                _draw(job, name, outdir / name)
    return drawn
