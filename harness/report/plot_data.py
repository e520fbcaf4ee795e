"""What a run's plots show, reduced from its records and samples to compact numpy arrays of at most a few
thousand points a line (plenty for 800 px): a plot job, picklable, to draw here or hand to a renderer process.
numpy is imported when reducing only."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from harness.report.plot_drawing import AutoscaleMarks, PlotJob, Points, RankPanel, RegretCurves, ReuseCurves
from harness.report.summary import RankSeries, rank_series, regret_blocks

if TYPE_CHECKING:
    from kvemu.records import RequestRecord

    from harness.report.plot_drawing import Array
    from harness.report.run_data import RunData

__all__ = ["NS_PER_MS", "NS_PER_S", "plot_job", "regret_bucket_s", "regret_curves", "series_form"]

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000

_MAX_POINTS = 2000
_MAX_SERIES_POINTS = 800


def _decimate(xs: Array, ys: Array, limit: int = _MAX_POINTS) -> Points:
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


def _cdf_points(values_ns: Iterable[int], count: int) -> Points | None:
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


def _heatmap(series: dict[tuple[int, int], Points]) -> tuple[Array, Array]:
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


def _rank_panels(data: RunData, series: RankSeries, field: str) -> list[RankPanel]:
    """Per pool (in ``data.pools`` order): its ranks' sample series of ``field`` (``active_requests`` or
    ``kv_blocks``; times in s, by time), drawn as lines or, past ``_MAX_LINES`` ranks, a heatmap with the pool's mean
    and max per rank; its rank capacity."""
    which = 1 if field == "active_requests" else 2
    order = {pool: i for i, pool in enumerate(data.pools)}
    panels = []
    for pool in sorted({p for p, _, _ in series}, key=lambda p: (order.get(p, len(order)), p)):
        full = {(w, r): (cols[0], cols[which]) for (p, w, r), cols in series.items() if p == pool}
        form = series_form(len(full))
        capacity = data.pools.get(pool, {}).get("kv_blocks") if field == "kv_blocks" else None
        if form == "lines":
            panels.append(RankPanel(pool, form, capacity, series={
                key: _decimate(xs, ys, _MAX_SERIES_POINTS) for key, (xs, ys) in full.items()}))
        else:
            edges, grid = _heatmap(full)
            panels.append(RankPanel(pool, form, capacity, ranks=[f"w{w}/r{r}" for w, r in full], edges=edges,
                                    grid=grid))
    return panels


def _autoscale_marks(data: RunData) -> AutoscaleMarks | None:
    """An autoscaled run's applied decisions (time in s, action) and its pool's running and provisioned
    (running + starting + draining) workers as step series, or None without an autoscaler."""
    log = data.autoscale
    if log is None:
        return None
    points = [(p.time_ns, p.running, p.provisioned) for p in log.series if p.pool == log.pool][:_MAX_SERIES_POINTS]
    end = max((s.time_ns for s in data.samples), default=0)
    if points and end > points[-1][0]:  # the last counts hold until the run's last sample
        points.append((end, *points[-1][1:]))
    return AutoscaleMarks(
        pool=log.pool,
        decisions=[(d.time_ns / NS_PER_S, d.action) for d in log.decisions if d.applied][:_MAX_SERIES_POINTS],
        times=[t / NS_PER_S for t, _, _ in points],
        running=[r for _, r, _ in points],
        provisioned=[p for _, _, p in points],
    )


def _reuse_curves(done: list[RequestRecord]) -> ReuseCurves | None:
    """Engine-found cached / prompt tokens by completion: (window, x1, rolling, x2, cumulative), decimated."""
    import numpy as np

    n = len(done)
    if not n:
        return None
    ordered = sorted(done, key=lambda r: (r.completion_ns, r.request_id))
    window = max(1, min(200, n // 20))
    xs = np.fromiter((r.completion_ns for r in ordered), dtype=np.int64, count=n) / NS_PER_S
    cached = np.cumsum(np.fromiter((r.engine.cached_tokens or 0 for r in ordered), dtype=np.int64, count=n))
    prompt = np.cumsum(np.fromiter((r.isl for r in ordered), dtype=np.int64, count=n))
    win_c, win_i = cached.copy(), prompt.copy()
    win_c[window:] -= cached[:-window]  # the last ``window`` completions
    win_i[window:] -= prompt[:-window]
    rolling = np.divide(win_c, win_i, out=np.zeros(n), where=win_i != 0)
    cumulative = np.divide(cached, prompt, out=np.zeros(n), where=prompt != 0)
    return ReuseCurves(window, _decimate(xs, rolling), _decimate(xs, cumulative))


_LONG_RUN_S = 600
"""Routing decisions spanning more than this are bucketed by the minute for the regret plot, shorter ones by 10 s."""


def regret_bucket_s(span_s: float) -> int:
    """The regret plot's bucket width for decisions spanning ``span_s`` seconds: 60 s past ten minutes, else 10 s
    (enough decisions a bucket for a ratio, enough buckets for a curve)."""
    return 60 if span_s > _LONG_RUN_S else 10


def regret_curves(data: RunData) -> RegretCurves | None:
    """Routing regret (lost / (novel + lost) blocks, as ``kvemu.routing.regret``) per time bucket of the routing
    decisions, for the cluster and, with router replicas, each replica; the chaos timeline's events as marks.
    Times in s since the first arrival; a bucket without blocks is NaN. None: no routing truth in the run."""
    import numpy as np

    judged = [(r, blk) for r in data.records if (blk := regret_blocks(r, data.block_size)) is not None]
    if not judged:
        return None
    t0 = min(r.arrival_ns for r in data.records)
    routed = [(r.routed_ns - t0 if r.routed_ns is not None else 0, r.request_id, blk) for r, blk in judged]
    width = regret_bucket_s(max(t for t, _, _ in routed) / NS_PER_S)
    buckets = max(t for t, _, _ in routed) // (width * NS_PER_S) + 1
    rep = data.replicas
    names = ["cluster"] + ([f"replica {i}" for i in range(rep.count)] if rep is not None else [])
    blocks = np.zeros((len(names), 2, buckets), dtype=np.int64)  # line x (lost, novel) x bucket
    for t, rid, (lost, novel) in routed:
        bucket = t // (width * NS_PER_S)
        rows = [0]
        if rep is not None and (i := rep.replica_of.get(rid)) is not None:
            rows.append(1 + i)
        for line in rows:
            blocks[line, 0, bucket] += lost
            blocks[line, 1, bucket] += novel
    total = blocks.sum(axis=1)
    ratio = np.divide(blocks[:, 0], total, out=np.full(total.shape, np.nan), where=total != 0)
    overall = blocks.sum(axis=2)
    chaos = data.chaos
    return RegretCurves(
        bucket_s=width,
        times=(np.arange(buckets) + 0.5) * width,  # each bucket's middle
        lines={name: ratio[i] for i, name in enumerate(names)},
        overall={name: (float(overall[i, 0] / overall[i].sum()) if overall[i].sum() else None)
                 for i, name in enumerate(names)},
        marks=sorted((ev.t_s - t0 / NS_PER_S, ev.label) for ev in chaos),
    )


def plot_job(data: RunData, outdir: Path) -> PlotJob:
    """Everything the plots show, as compact arrays (picklable, to hand to a renderer process)."""
    done = sorted((r for r in data.records if r.done), key=lambda r: (r.arrival_ns, r.request_id))
    ttft = [f - r.arrival_ns for r in done if (f := _first_token(r)) is not None]
    series = rank_series(data.samples)
    return PlotJob(
        outdir=str(Path(outdir).absolute()),
        ttft=_cdf_points(ttft, len(ttft)),
        e2e=_cdf_points((r.completion_ns - r.arrival_ns for r in done), len(done)),  # type: ignore[operator]
        active=_rank_panels(data, series, "active_requests"),
        blocks=_rank_panels(data, series, "kv_blocks"),
        reuse=_reuse_curves(done),
        autoscale=_autoscale_marks(data),
        regret=regret_curves(data),
    )
