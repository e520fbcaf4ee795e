"""``kvemu plan``: the smallest cluster that meets an SLA at a goodput target, found by search, not a grid.

A cluster size *passes* when, for every seed, at least ``goodput`` of its requests met the SLA (summary's
``goodput_completed_requests / num_requests``). The search keeps the largest size known to fail and the
smallest known to pass and, each round, probes up to ``width`` sizes spread evenly between them (the largest
allowed size first, to learn whether any size passes), all in parallel on the sweep's executors: with width 1
it is bisection, with width k it narrows the interval k+1-fold a round. A disaggregated scenario searches the
total worker count; each total is probed at the scenario's prefill share and one prefill worker either side,
and passes when one of those splits does (the best split is the answer's).

More workers are assumed not to lower goodput; where a run says otherwise the answer is still the smallest
passing size found, and the report flags the non-monotonic pair.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, as_completed
from pathlib import Path

import msgspec

from kvemu.errors import InvalidArgument

from harness.scenario import MAX_WORKERS, Scenario, ScenarioError, parse_scenario
from harness.report.sla import Sla
from harness.sweep.executors import result_of
from harness.sweep.spec import MAX_RUNS, PointResult, PointSpec, run_point
from harness.text import counted

__all__ = ["MAX_RUNS_A_ROUND", "Plan", "PlanRow", "ProbeRow", "PlanSpec", "Probe", "check_plan", "plan_cluster", "parse_sla", "render_plan", "write_partial_plan",
           "write_plan"]

FIGURES = ["num_requests", "completed_requests", "goodput_completed_requests", "goodput_request_throughput_rps",
           "request_throughput_rps", "output_throughput_tok_s", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms",
           "p99_itl_ms", "gpus"]


class PlanSpec(msgspec.Struct, kw_only=True, frozen=True):
    """What to plan for: the scenario (text, directory, overrides), the SLA, the goodput target, the range."""

    scenario_text: str
    base_dir: str = "."
    source: str = "<scenario>"
    overrides: list[str] = []
    sla: Sla
    goodput: float = 0.95
    min_workers: int = 1
    max_workers: int = 32
    seeds: list[int] = msgspec.field(default_factory=lambda: [0])


class Probe(msgspec.Struct, kw_only=True):
    """One probed cluster: its size (total workers; the prefill share when disaggregated) and its runs."""

    workers: int
    prefill: int | None = None
    runs: list[PointResult] = []

    @property
    def met_fraction(self) -> float | None:
        """The smallest share of requests meeting the SLA over its seeds (None if a run failed)."""
        shares = []
        for r in self.runs:
            met, total = _count(r, "goodput_completed_requests"), _count(r, "num_requests")
            if r.status != "ok" or not total:
                return None
            shares.append((met or 0) / total)
        return min(shares) if shares else None

    def passes(self, target: float) -> bool:
        share = self.met_fraction
        return share is not None and share >= target

    def figure(self, name: str) -> float | None:
        """The mean of a figure over the probe's seeds."""
        values = [v for r in self.runs if isinstance(v := r.figures.get(name), (int, float))]
        return sum(values) / len(values) if values else None

    @property
    def label(self) -> str:
        return f"{self.workers}" if self.prefill is None else f"{self.workers} ({self.prefill}P:{self.workers - self.prefill}D)"


def _count(result: PointResult, name: str) -> float | None:
    """A numeric figure of ``result`` (None where absent or not a number)."""
    value = result.figures.get(name)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def parse_sla(text: str) -> Sla:
    """``ttft_ms=500,itl_ms=20`` (or ``e2e_ms=...``) → an ``Sla``; ``InvalidArgument`` naming the bad part."""
    fields: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in Sla.__struct_fields__:
            raise InvalidArgument(f"--sla {text!r}: expected ttft_ms=MS,itl_ms=MS or e2e_ms=MS, got {part!r}", field="sla")
        try:
            fields[key.strip()] = float(value)
        except ValueError:
            raise InvalidArgument(f"--sla {text!r}: {key.strip()} must be a number of ms, got {value!r}",
                                  field="sla") from None
    try:
        return Sla(**fields)
    except InvalidArgument as exc:
        raise InvalidArgument(f"--sla {text!r}: {exc}", field="sla") from None


def _scenario(spec: PlanSpec, extra: Iterable[str] = ()) -> Scenario:
    return parse_scenario(spec.scenario_text, base_dir=spec.base_dir, overrides=[*spec.overrides, *extra],
                          source=spec.source)


def _sla_overrides(sla: Sla) -> list[str]:
    return [f"run.sla={msgspec.json.encode({k: v for k, v in msgspec.structs.asdict(sla).items() if v is not None}).decode()}"]


def _sizes(spec: PlanSpec, workers: int, disaggregated: bool, share: float) -> list[tuple[int | None, list[str]]]:
    """The clusters one probe of ``workers`` runs: ``(prefill workers or None, overrides)``."""
    if not disaggregated:
        return [(None, [f"cluster.workers={workers}"])]
    middle = min(max(round(share * workers), 1), workers - 1)
    splits = sorted({min(max(middle + d, 1), workers - 1) for d in (-1, 0, 1)})
    return [(p, [f"cluster.prefill.workers={p}", f"cluster.decode.workers={workers - p}"]) for p in splits]


def _candidates(fail: int, passed: int | None, hi: int, width: int) -> list[int]:
    """Up to ``width`` sizes evenly spread in (fail, passed) — or in (fail, hi], hi first, before any passed."""
    if passed is None:
        span = hi - fail
        picks = {hi} | {fail + round(j * span / width) for j in range(1, width)}
    else:
        span = passed - fail
        picks = {fail + round(j * span / (width + 1)) for j in range(1, width + 1)}
        picks = {p for p in picks if fail < p < passed}
        if not picks and passed - fail > 1:
            picks = {fail + span // 2}
    return sorted(p for p in picks if fail < p <= hi)


MAX_RUNS_A_ROUND = MAX_RUNS
"""Most runs one round of a plan submits at once (probes a round x splits x seeds): a sweep's cap on runs."""


class _Shape(msgspec.Struct, frozen=True):
    disaggregated: bool
    share: float
    lo: int


def check_plan(spec: PlanSpec, width: int) -> _Shape:
    """Check a plan before anything runs; ``InvalidArgument`` names the flag at fault (``--max-workers``,
    ``--min-workers``, ``--seeds``, ``--width``), with its bound, rather than the scenario value it becomes."""
    base = _scenario(spec)
    disaggregated = base.cluster.disaggregated
    share = 0.5
    lo = max(spec.min_workers, 2 if disaggregated else 1)
    if disaggregated:
        assert base.cluster.prefill is not None and base.cluster.decode is not None
        share = base.cluster.prefill.workers / (base.cluster.prefill.workers + base.cluster.decode.workers)
    if spec.max_workers < lo:
        raise InvalidArgument(f"--max-workers ({spec.max_workers}) must be >= {lo}", field="max_workers")
    ceiling = MAX_WORKERS * 2 if disaggregated else MAX_WORKERS  # (each pool holds up to MAX_WORKERS)
    for flag, size in (("--min-workers", spec.min_workers), ("--max-workers", spec.max_workers)):
        if size > ceiling:
            raise InvalidArgument(f"{flag} ({size}) must be <= {ceiling}, the largest cluster a scenario may start",
                                  field=flag[2:].replace("-", "_"))
    splits = 3 if disaggregated else 1
    per_round = min(width, spec.max_workers - lo + 1) * splits * len(spec.seeds)
    if per_round > MAX_RUNS_A_ROUND:
        raise InvalidArgument(f"--seeds ({len(spec.seeds):,}) x {counted(min(width, spec.max_workers - lo + 1), 'probe')}"
                              f" a round{' x 3 splits' if disaggregated else ''} = {per_round:,} runs a round, more "
                              f"than the {MAX_RUNS_A_ROUND:,} a plan may run at once; lower --seeds (or --width)",
                              field="seeds")
    sla = _sla_overrides(spec.sla)
    for flag, size in (("--min-workers", lo), ("--max-workers", spec.max_workers)):
        for _, extra in _sizes(spec, size, disaggregated, share):  # every probe's scenario is valid if the extremes are
            try:
                _scenario(spec, [*extra, *sla, "run.mode=virtual"])
            except ScenarioError as exc:
                raise InvalidArgument(f"{flag} ({size}): a cluster of {counted(size, 'worker')} is not a valid "
                                      f"scenario: {exc}", field=flag[2:].replace("-", "_")) from None
    return _Shape(disaggregated=disaggregated, share=share, lo=lo)


def plan_cluster(spec: PlanSpec, executor: Executor, *, width: int = 2,
                 on_probe: Callable[[Probe], None] | None = None) -> Plan:
    """Search the smallest passing cluster (see the module doc); returns the plan (plan.json)."""
    started = time.perf_counter()
    shape = check_plan(spec, width)
    disaggregated, share, lo = shape.disaggregated, shape.share, shape.lo
    width = min(width, spec.max_workers - lo + 1)  # (no round probes more sizes than there are)
    sla = _sla_overrides(spec.sla)
    probes: dict[int, list[Probe]] = {}
    fail, passed = lo - 1, None
    runs = 0
    try:
        while True:
            sizes = _candidates(fail, passed, spec.max_workers, width)
            sizes = [s for s in sizes if s not in probes]
            if not sizes:
                break
            points: dict[Future[PointResult], Probe] = {}
            points_run: dict[Future[PointResult], PointSpec] = {}
            for workers in sizes:
                probes[workers] = []
                for prefill, extra in _sizes(spec, workers, disaggregated, share):
                    probe = Probe(workers=workers, prefill=prefill)
                    probes[workers].append(probe)
                    for seed in spec.seeds:
                        point = PointSpec(point=runs, seed=seed, scenario_text=spec.scenario_text, base_dir=spec.base_dir,
                                          overrides=[*spec.overrides, *extra, *sla, "run.mode=virtual"],
                                          figures=FIGURES, source=spec.source)
                        future = executor.submit(run_point, point)
                        points[future], points_run[future] = probe, point
                        runs += 1
            for future in as_completed(points):
                probe = points[future]
                probe.runs.append(result_of(future, points_run[future]))
                if len(probe.runs) == len(spec.seeds):
                    probe.runs.sort(key=lambda r: r.seed)  # (they finish in any order)
                    if on_probe is not None:
                        on_probe(probe)
            for workers in sizes:
                if any(p.passes(spec.goodput) for p in probes[workers]):
                    passed = workers if passed is None else min(passed, workers)
            fail = max([w for w in probes if w < (passed or spec.max_workers + 1)
                        and not any(p.passes(spec.goodput) for p in probes[w])], default=lo - 1)
            if passed is None and spec.max_workers in probes:
                break  # not even the largest passes
            if passed is not None and passed - fail <= 1:
                break
    except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM as one: what finished goes with it (plan.json)
        done = {w: ps for w, ps in probes.items() if ps and all(len(p.runs) == len(spec.seeds) for p in ps)}
        exc.partial_plan = _result(spec, done, passed if passed in done else None, fail, runs,  # type: ignore[attr-defined]
                                   time.perf_counter() - started, disaggregated)
        raise
    return _result(spec, probes, passed, fail, runs, time.perf_counter() - started, disaggregated)


def _best(probe_list: list[Probe]) -> Probe:
    return max(probe_list, key=lambda p: (p.met_fraction or -1.0, -(p.prefill or 0)))


class PlanRow(msgspec.Struct, kw_only=True, frozen=True):
    """A probed cluster in plan.json: its size, its worst seed's share of requests meeting the SLA, mean figures."""

    workers: int
    prefill_workers: int | None
    decode_workers: int | None
    met_fraction: float | None
    gpus: float | None
    goodput_request_throughput_rps: float | None
    request_throughput_rps: float | None
    p99_ttft_ms: float | None
    mean_itl_ms: float | None

    @property
    def cluster(self) -> str:
        """``3 workers`` or ``3 workers (1 prefill, 2 decode)``."""
        if self.prefill_workers is None:
            return counted(self.workers, "worker")
        return f"{counted(self.workers, 'worker')} ({self.prefill_workers} prefill, {self.decode_workers} decode)"


class ProbeRow(PlanRow, kw_only=True, frozen=True):
    """A probe in plan.json: its row and its runs (one a seed)."""

    runs: list[PointResult]


class Plan(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A plan's answer (plan.json): the smallest passing cluster, the largest failing one, every probe."""

    sla: dict[str, float]
    goodput_target: float
    range: tuple[int, int]
    """``--min-workers``, ``--max-workers``."""
    seeds: list[int]
    disaggregated: bool
    answer: PlanRow | None
    largest_failing: PlanRow | None
    non_monotonic: list[tuple[int, int]]
    """(workers that passed, more workers that failed)."""
    runs: int
    wall_time_s: float
    probes: list[ProbeRow]
    interrupted: str | None = None
    """The signal that stopped the search (a partial plan's probes are those that finished)."""

    @property
    def best_share(self) -> float | None:
        """The highest share of requests meeting the SLA over the probes."""
        shares = [p.met_fraction for p in self.probes if p.met_fraction is not None]
        return max(shares) if shares else None


def _result(spec: PlanSpec, probes: dict[int, list[Probe]], passed: int | None, fail: int, runs: int,
            wall_s: float, disaggregated: bool) -> Plan:
    rows = [_best(probes[w]) for w in sorted(probes)]
    monotonic = [(a.workers, b.workers) for a in rows for b in rows
                 if a.workers < b.workers and a.passes(spec.goodput) and not b.passes(spec.goodput)]
    answer = _best(probes[passed]) if passed is not None else None
    bound = _best(probes[fail]) if fail in probes else None
    return Plan(sla={k: v for k, v in msgspec.structs.asdict(spec.sla).items() if v is not None},
                goodput_target=spec.goodput, range=(spec.min_workers, spec.max_workers), seeds=spec.seeds,
                disaggregated=disaggregated, answer=None if answer is None else _row(answer),
                largest_failing=None if bound is None else _row(bound), non_monotonic=monotonic, runs=runs,
                wall_time_s=round(wall_s, 3),
                probes=[ProbeRow(**msgspec.structs.asdict(_row(p)), runs=p.runs)
                        for w in sorted(probes) for p in probes[w]])


def _row(p: Probe) -> PlanRow:
    return PlanRow(workers=p.workers, prefill_workers=p.prefill,
                   decode_workers=None if p.prefill is None else p.workers - p.prefill,
                   met_fraction=p.met_fraction, gpus=p.figure("gpus"),
                   goodput_request_throughput_rps=p.figure("goodput_request_throughput_rps"),
                   request_throughput_rps=p.figure("request_throughput_rps"),
                   p99_ttft_ms=p.figure("p99_ttft_ms"), mean_itl_ms=p.figure("mean_itl_ms"))


def answer_line(plan: Plan) -> str:
    """The plan's answer in one sentence."""
    sla = ", ".join(f"{k.removesuffix('_ms').upper()} ≤ {v:g} ms" for k, v in plan.sla.items())
    target = f"{100 * plan.goodput_target:g} %"
    if plan.answer is None:
        return (f"no cluster of up to {plan.range[1]} workers meets {sla} for {target} of requests "
                f"(best: {_pct(plan.best_share)}); raise --max-workers or relax the SLA")
    a = plan.answer
    return f"{a.cluster} meet {sla} for {_pct(a.met_fraction)} of requests (target {target})"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def render_plan(plan: Plan, plot: str | None = None) -> str:
    """plan.md: the answer, the runs that bound it, every probe, the plot."""
    from harness.report.markdown import fmt, table

    out = ["# kvemu plan", "", f"**{answer_line(plan)}.**", "",
           f"{plan.runs} runs in {plan.wall_time_s:.1f} s (seeds {', '.join(map(str, plan.seeds))}; "
           f"workers {plan.range[0]}–{plan.range[1]}).", ""]
    bounds = [("answer (smallest passing)", plan.answer), ("largest failing", plan.largest_failing)]
    header = ["", "cluster", "met SLA", "goodput (req/s)", "throughput (req/s)", "p99 TTFT (ms)", "mean ITL (ms)"]

    def cells(row: PlanRow) -> list[str]:
        return [row.cluster, _pct(row.met_fraction), fmt(row.goodput_request_throughput_rps),
                fmt(row.request_throughput_rps), fmt(row.p99_ttft_ms), fmt(row.mean_itl_ms)]

    out += ["## The runs that bound it", ""]
    out += table(header, [(name, *cells(row)) for name, row in bounds if row is not None])
    out += ["", "## Every probe", ""]
    out += table(header, [("passes" if (p.met_fraction or 0) >= plan.goodput_target else "fails", *cells(p))
                           for p in plan.probes])
    if plan.non_monotonic:
        out += ["", "Not monotonic: " + ", ".join(f"{a} workers passed where {b} failed"
                                                  for a, b in plan.non_monotonic) + "."]
    if plot:
        out += ["", f"![plan]({plot})"]
    return "\n".join(out) + "\n"


def _draw(plan: Plan, path: Path) -> None:
    from harness.report.figures import new_figure, save_png

    fig, ax = new_figure("Share of requests meeting the SLA", "workers", "met SLA")
    rows = sorted((p for p in plan.probes if p.met_fraction is not None), key=lambda p: p.workers)
    ax.plot([p.workers for p in rows], [p.met_fraction for p in rows], "o", color="tab:blue", label="probe")
    ax.axhline(plan.goodput_target, color="tab:red", linestyle="--", label="target")
    if plan.answer is not None:
        a = plan.answer
        ax.plot([a.workers], [a.met_fraction], "*", markersize=16, color="tab:green", label="answer")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower right")
    save_png(fig, path)


def write_plan(plan: Plan, outdir: Path) -> Path:
    """plan.json, plan.png and plan.md into ``outdir``; returns plan.md's path."""
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "plan.json").write_bytes(msgspec.json.format(msgspec.json.encode(plan), indent=2) + b"\n")
    _draw(plan, outdir / "plan.png")
    md = outdir / "plan.md"
    md.write_text(render_plan(plan, "plan.png"))
    return md


def write_partial_plan(plan: Plan, outdir: Path, reason: str) -> Path:
    """An interrupted plan's finished probes: plan.json (marked ``interrupted``) and plan.md, no plot."""
    outdir.mkdir(parents=True, exist_ok=True)
    plan = msgspec.structs.replace(plan, interrupted=reason)
    (outdir / "plan.json").write_bytes(msgspec.json.format(msgspec.json.encode(plan), indent=2) + b"\n")
    md = outdir / "plan.md"
    md.write_text(f"**Interrupted ({reason}) before the search ended: the probes that finished.**\n\n"
                  + render_plan(plan))
    return md
