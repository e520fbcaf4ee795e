"""sweep.md: what a capacity planner reads first: the table, the chosen point, and plots against each axis.

Per point, each figure is the mean over its ``ok`` runs (seeds). The Pareto front is over the points that have
both an output throughput per GPU (higher is better) and a p99 TTFT (lower is better): a point is on it when no
other point is at least as good on both and better on one. The *chosen* point is, when the runs have an SLA
(``run.sla``), the point of highest throughput per GPU whose every seed had at least ``objective.goodput``
(default 0.95) of its requests meeting the SLA, and whose p99 TTFT meets ``objective.ttft_ms`` if set (none if
no point does); without an SLA, with ``objective.ttft_ms``, the front's point of highest throughput per GPU
whose p99 TTFT meets the bound (none if no point does); without either, the front's knee: after scaling both figures to [0, 1] over the front, the point farthest from
the straight line between its two ends (ties, and fronts of one or two points: the higher throughput per GPU).
Plots are PNGs drawn with ``harness.report.figures``' helpers (Agg, default style, fixed size).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from harness.report.figures import new_figure, legend_right, no_data, save_png, value_scale
from harness.report.markdown import fmt, pct, table
from harness.sweep.spec import DEFAULT_GOODPUT, Figure, Objective, PointResult, Sweep

__all__ = ["PointRow", "point_means", "pareto_front", "choose_point", "sla_shares", "render_sweep_markdown", "write_sweep_report",
           "THROUGHPUT", "TTFT"]

THROUGHPUT = "output_throughput_tok_s_per_gpu"
TTFT = "p99_ttft_ms"
_MAX_GROUPS = 8
_MAX_TABLE_ROWS = 2000


def _number(value: Figure) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


class PointRow(msgspec.Struct, kw_only=True, frozen=True):
    """A point in sweep.md: its axes, how many runs (seeds) it has and how many are ok, each figure's mean."""

    point: int
    axes: dict[str, str]
    runs: int
    ok: int
    figures: dict[str, Figure]


def _ttft(row: PointRow) -> float:
    """The row's p99 TTFT (a usable row has one)."""
    return _number(row.figures.get(TTFT)) or 0.0


def _tput(row: PointRow) -> float:
    """The row's output throughput per GPU (a usable row has one)."""
    return _number(row.figures.get(THROUGHPUT)) or 0.0


def point_means(results: Sequence[PointResult]) -> list[PointRow]:
    """One row per point (in point order): ``point``, ``axes``, ``runs``, ``ok`` and each figure's mean over its
    ok runs (None where no ok run has it; a non-numeric figure keeps the first ok run's value)."""
    by_point: dict[int, list[PointResult]] = {}
    for result in results:
        by_point.setdefault(result.point, []).append(result)
    rows = []
    for point in sorted(by_point):
        group = by_point[point]
        ok = [r for r in group if r.status == "ok"]
        names = list(dict.fromkeys(n for r in group for n in r.figures))
        means: dict[str, Figure] = {}
        for name in names:
            values = [r.figures.get(name) for r in ok]
            numbers = [v for v in map(_number, values) if v is not None]
            if numbers and len(numbers) == len([v for v in values if v is not None]):
                mean = math.fsum(numbers) / len(numbers)
                whole = mean.is_integer() and all(isinstance(v, int) for v in values if v is not None)
                means[name] = int(mean) if whole else mean
            else:
                means[name] = next((v for v in values if v is not None), None)
        rows.append(PointRow(point=point, axes=dict(group[0].axes), runs=len(group), ok=len(ok), figures=means))
    return rows


def pareto_front(items: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the (ttft, throughput) pairs on the front (lower ttft, higher throughput), by ttft.

    Of pairs equal on both, the first is kept.
    """
    order = sorted(range(len(items)), key=lambda i: (items[i][0], -items[i][1], i))
    front: list[int] = []
    best = -math.inf
    for i in order:
        if items[i][1] > best:
            front.append(i)
            best = items[i][1]
    return front


def choose_point(items: Sequence[tuple[float, float]], front: Sequence[int],
                 ttft_bound: float | None) -> tuple[int | None, str]:
    """The chosen index among ``front`` (see the module docstring) and why it was chosen."""
    if not front:
        return None, "no point has both a p99 TTFT and a throughput per GPU"
    if ttft_bound is not None:
        meeting = [i for i in front if items[i][0] <= ttft_bound]
        if not meeting:
            return None, f"no point meets the objective p99 TTFT <= {fmt(ttft_bound)} ms"
        best = max(meeting, key=lambda i: (items[i][1], -items[i][0]))
        return best, f"the highest throughput per GPU with p99 TTFT <= {fmt(ttft_bound)} ms (objective.ttft_ms)"
    why = "the knee of the Pareto front (no objective.ttft_ms set)"
    if len(front) <= 2:
        return max(front, key=lambda i: items[i][1]), why
    xs = [items[i][0] for i in front]
    ys = [items[i][1] for i in front]
    span_x = (max(xs) - min(xs)) or 1.0
    span_y = (max(ys) - min(ys)) or 1.0
    pts = [((x - min(xs)) / span_x, (y - min(ys)) / span_y) for x, y in zip(xs, ys)]
    (x0, y0), (x1, y1) = pts[0], pts[-1]
    norm = math.hypot(x1 - x0, y1 - y0) or 1.0

    def distance(k: int) -> float:
        x, y = pts[k]
        return abs((x1 - x0) * (y0 - y) - (x0 - x) * (y1 - y0)) / norm

    best = max(range(len(front)), key=lambda k: (round(distance(k), 12), ys[k]))
    return front[best], why


def sla_shares(results: Sequence[PointResult]) -> dict[int, float]:
    """Per point: the smallest share of requests meeting ``run.sla`` over its ok runs (seeds), as ``kvemu plan``
    counts it (``goodput_completed_requests / num_requests``); points without SLA figures are absent."""
    shares: dict[int, float] = {}
    for result in results:
        met = _number(result.figures.get("goodput_completed_requests"))
        total = _number(result.figures.get("num_requests"))
        if result.status != "ok" or met is None or not total:
            continue
        share = met / total
        shares[result.point] = min(shares.get(result.point, share), share)
    return shares


def _pareto(rows: list[PointRow], results: Sequence[PointResult],
            objective: Objective) -> tuple[list[int], list[int], int | None, str]:
    """Rows with both figures, the front among them and the chosen one (all as row indices), and why.

    Runs with an SLA: the chosen point is the highest throughput per GPU among the points whose every seed had
    at least ``objective.goodput`` of its requests meeting the SLA (and p99 TTFT within ``objective.ttft_ms``);
    without one, ``choose_point`` on the front.
    """
    usable = [k for k, r in enumerate(rows)
              if _number(r.figures.get(TTFT)) is not None and _number(r.figures.get(THROUGHPUT)) is not None]
    items = [(_ttft(rows[k]), _tput(rows[k])) for k in usable]
    front = [usable[i] for i in pareto_front(items)]
    shares = sla_shares(results)
    if not shares:
        chosen, why = choose_point(items, [usable.index(k) for k in front], objective.ttft_ms)
        return usable, front, (usable[chosen] if chosen is not None else None), why
    target = objective.goodput if objective.goodput is not None else DEFAULT_GOODPUT
    rule = (f"at least {100 * target:g} % of requests meeting run.sla in every seed (objective.goodput"
            + (")" if objective.goodput is not None else f", by default {100 * DEFAULT_GOODPUT:g} % with an SLA)"))
    bound = objective.ttft_ms
    if bound is not None:
        rule += f" and p99 TTFT <= {fmt(bound)} ms (objective.ttft_ms)"
    eligible = [k for k, (ttft, _) in zip(usable, items)
                if shares.get(rows[k].point, -1.0) >= target and (bound is None or ttft <= bound)]
    if not eligible:
        return usable, front, None, f"no point has {rule}"
    best = max(eligible, key=lambda k: (_tput(rows[k]), -_ttft(rows[k])))
    return usable, front, best, f"the highest throughput per GPU with {rule}"


def _missed(rows: list[PointRow], results: Sequence[PointResult], objective: Objective,
            usable: list[int]) -> list[int]:
    """The usable rows that miss the objective (a seed under the goodput target with an SLA, or p99 TTFT past
    ``objective.ttft_ms``): none when the sweep states no objective."""
    shares = sla_shares(results)
    target = objective.goodput if objective.goodput is not None else DEFAULT_GOODPUT
    bound = objective.ttft_ms
    if not shares and bound is None:
        return []
    return [k for k in usable if (shares and shares.get(rows[k].point, -1.0) < target)
            or (bound is not None and _ttft(rows[k]) > bound)]


# ---------------------------------------------------------------------------------- plots


def _slug(key: str) -> str:
    return re.sub(r"[^\w.-]", "_", key)


def _axis_positions(values: list[str]) -> tuple[list[float], list[str] | None]:
    """Numeric axis values as numbers; anything else at 0, 1, 2 ... with the values as tick labels."""
    from harness.yaml_validation import load_yaml

    parsed = [load_yaml(v, "an axis value").data for v in values]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in parsed):
        return [float(v) for v in parsed], None
    return [float(i) for i in range(len(values))], values


def _draw_against_axis(rows: list[PointRow], axis: str, axis_values: list[str], series: list[tuple[str, str]],
                       title: str, ylabel: str, path: Path) -> Any:
    """``series`` (figure key, label) against ``axis``: one colour per combination of the other axes, on a log
    scale when the values span decades; returns the figure (saved to ``path``)."""
    fig, ax = new_figure(title, axis, ylabel, legend=True)
    xs, labels = _axis_positions(axis_values)
    x_of = dict(zip(axis_values, xs))
    groups: dict[tuple[tuple[str, str], ...], list[PointRow]] = {}
    for row in rows:
        others = tuple((k, v) for k, v in row.axes.items() if k != axis)
        groups.setdefault(others, []).append(row)
    styles = ("-", "--", ":", "-.")
    drawn = 0
    values: list[float] = []
    for g, (others, members) in enumerate(list(groups.items())[:_MAX_GROUPS]):
        color = f"C{g % 10}"
        for s, (key, label) in enumerate(series):
            pts = sorted((x_of[r.axes[axis]], v) for r in members
                         if (v := _number(r.figures.get(key))) is not None)
            if not pts:
                continue
            name = ", ".join([label, *(f"{k}={v}" for k, v in others)])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=styles[s % len(styles)], marker="o",
                    color=color, label=name)
            values += [p[1] for p in pts]
            drawn += 1
    if drawn:
        ax.set_yscale(value_scale(values))  # latencies of a saturated point are decades above the others
        legend_right(ax)
        if labels is not None:
            ax.set_xticks(xs, labels)
        elif len(xs) <= 12:
            ax.set_xticks(xs)
    else:
        no_data(ax)
    save_png(fig, path)
    return fig


def _draw_pareto(rows: list[PointRow], usable: list[int], front: list[int], chosen: int | None,
                 bound: float | None, path: Path, missed: list[int] | None = None) -> Any:
    fig, ax = new_figure("Output throughput per GPU vs p99 TTFT (Pareto front)", "p99 TTFT (ms)",
                      "output tokens/s per GPU", legend=True)
    if usable:
        xs = [_ttft(rows[k]) for k in usable]
        ys = [_tput(rows[k]) for k in usable]
        ax.scatter(xs, ys, color="C0", alpha=0.6, label="points")
        if missed:
            ax.scatter([_ttft(rows[k]) for k in missed], [_tput(rows[k]) for k in missed],
                       marker="x", s=80, color="C3", zorder=3, label="missed the objective")
        for k, x, y in zip(usable, xs, ys):
            ax.annotate(str(rows[k].point), (x, y), textcoords="offset points", xytext=(4, 4), fontsize="small")
        fx = [_ttft(rows[k]) for k in front]
        fy = [_tput(rows[k]) for k in front]
        ax.plot(fx, fy, color="C1", marker="o", drawstyle="steps-post", label="Pareto front")
        if bound is not None:
            ax.axvline(bound, color="C3", linestyle="--", label=f"objective p99 TTFT {fmt(bound)} ms")
        if chosen is not None:
            ax.scatter([_ttft(rows[chosen])], [_tput(rows[chosen])], marker="*", s=300, color="C2", zorder=3,
                       label=f"chosen: point {rows[chosen].point}")
        ax.set_xscale(value_scale(xs))
        legend_right(ax)
    else:
        no_data(ax)
    save_png(fig, path)
    return fig


def _plots(sweep: Sweep, rows: list[PointRow], usable: list[int], front: list[int], chosen: int | None,
           outdir: Path, missed: list[int] | None = None) -> dict[str, list[str]]:
    """Draw every plot into ``outdir``; ``section -> file names``."""
    import matplotlib.style

    bound = sweep.spec.objective.ttft_ms
    goodput = any(r.figures.get("goodput_request_throughput_rps") is not None for r in rows)
    out: dict[str, list[str]] = {}
    with matplotlib.style.context("default"):
        name = "sweep_pareto.png"
        _draw_pareto(rows, usable, front, chosen, bound, outdir / name, missed)
        out["pareto"] = [name]
        for axis in sweep.axes:
            values = list(dict.fromkeys(r.axes[axis] for r in rows))
            names = [f"sweep_ttft_{_slug(axis)}.png", f"sweep_itl_{_slug(axis)}.png",
                     f"sweep_throughput_{_slug(axis)}.png"]
            _draw_against_axis(rows, axis, values, [("median_ttft_ms", "p50"), ("p90_ttft_ms", "p90"),
                                                    ("p99_ttft_ms", "p99")],
                               f"TTFT against {axis}", "TTFT (ms)", outdir / names[0])
            _draw_against_axis(rows, axis, values, [("median_itl_ms", "p50"), ("p90_itl_ms", "p90"),
                                                    ("p99_itl_ms", "p99")],
                               f"ITL against {axis}", "ITL (ms)", outdir / names[1])
            series = [("request_throughput_rps", "throughput")]
            if goodput:
                series.append(("goodput_request_throughput_rps", "goodput"))
            _draw_against_axis(rows, axis, values, series, f"Request throughput{' and goodput' if goodput else ''} "
                               f"against {axis}", "requests/s", outdir / names[2])
            out[axis] = names
    return out


# ---------------------------------------------------------------------------------- markdown


def render_sweep_markdown(sweep: Sweep, results: Sequence[PointResult], plots: dict[str, list[str]] | None = None,
                          note: str | None = None) -> str:
    """sweep.md from the sweep and its results (one per run, by point then seed); ``plots`` as ``_plots`` names."""
    spec = sweep.spec
    rows = point_means(results)
    usable, front, chosen, why = _pareto(rows, results, spec.objective)
    shares = sla_shares(results)
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    seeds = sweep.seeds_per_point
    out = [f"# kvemu sweep: {sweep.name}", ""]
    if note:
        out += [f"> **{note}**", ""]
    out += [f"- base scenario `{sweep.base_source}`, sweep file `{sweep.source}`",
            f"- axes ({spec.mode}): " + "; ".join(f"`{k}` = {', '.join(dict.fromkeys(r.axes[k] for r in rows))}"
                                                  for k in sweep.axes),
            f"- {len(rows)} points × {seeds} seed{'s' if seeds != 1 else ''} = {len(results)} runs: "
            + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())),
            f"- figures per point: {'mean over its ok seeds' if seeds > 1 else 'its run'}; every run in `sweep.csv`",
            ""]
    figures = list(spec.figures)
    out += ["## Results", ""]
    shown = rows[:_MAX_TABLE_ROWS]
    met = ["met SLA (worst seed)"] if shares else []
    out += table(["point", *sweep.axes, "ok runs", *met, *figures],
                  [(r.point, *(r.axes[a] for a in sweep.axes), f"{r.ok}/{r.runs}",
                    *([pct(shares.get(r.point))] if shares else []),
                    *(fmt(r.figures.get(f)) for f in figures)) for r in shown])
    if len(rows) > len(shown):
        out += ["", f"… and {len(rows) - len(shown)} more points (sweep.csv has them all)."]
    out += ["", "## Chosen point", ""]
    if not counts.get("ok"):
        out += ["None: no run finished yet."]
    elif chosen is None:
        out += [f"None: {why}."]
    else:
        c = rows[chosen]
        f = c.figures
        out += [f"**Point {c.point}** ({', '.join(f'`{k}={v}`' for k, v in c.axes.items())}): "
                f"{fmt(f.get(THROUGHPUT))} output tok/s per GPU on {fmt(f.get('gpus'))} GPUs, "
                f"p99 TTFT {fmt(f.get(TTFT))} ms; {why}."]
    out += ["", "## Pareto front: output throughput per GPU vs p99 TTFT", "",
            "GPUs are the cluster's DP ranks as started (workers × dp_size over its pools). A point is on the front "
            "when no other point has both a lower p99 TTFT and a higher throughput per GPU.", ""]
    if front:
        out += table(["point", *sweep.axes, "p99 TTFT (ms)", "output tok/s per GPU", "GPUs", "chosen"],
                      [(rows[k].point, *(rows[k].axes[a] for a in sweep.axes), fmt(_ttft(rows[k])),
                        fmt(_tput(rows[k])), fmt(rows[k].figures.get("gpus")),
                        "**yes**" if k == chosen else "") for k in front])
    else:
        out += ["No point has both figures."]
    if plots:
        out += ["", *(f"![Pareto front]({name})" for name in plots.get("pareto", []))]
        out += ["", "## Against each axis", "",
                "Lines join points that share the other axes' values; a point is the mean over its ok seeds."]
        for axis in sweep.axes:
            out += ["", f"### {axis}", ""] + [f"![{name.removesuffix('.png')}]({name})" for name in plots.get(axis, [])]
    failed = [r for r in results if r.status in ("failed", "partial")]
    if failed:
        out += ["", "## Failed and partial runs", ""]
        out += table(["point", "seed", "status", "error"],
                      [(r.point, r.seed, r.status, (r.error or "")[:300]) for r in failed[:200]])
    return "\n".join(out) + "\n"


def write_sweep_report(sweep: Sweep, results: Sequence[PointResult], outdir: Path, note: str | None = None) -> Path:
    """Draw the plots and write sweep.md into ``outdir``; return its path."""
    rows = point_means(results)
    usable, front, chosen, _ = _pareto(rows, results, sweep.spec.objective)
    plots = _plots(sweep, rows, usable, front, chosen, Path(outdir),
                   _missed(rows, results, sweep.spec.objective, usable))
    path = Path(outdir) / "sweep.md"
    tmp = path.with_name(".sweep.md.tmp")
    tmp.write_text(render_sweep_markdown(sweep, results, plots, note), encoding="utf-8")
    tmp.replace(path)
    return path
