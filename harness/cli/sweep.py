"""``kvemu sweep``: a scenario at every point of a grid, in parallel (local processes, Dask or Ray), resumable."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from harness.run.interrupts import held_signals, terminate_as_interrupt
from harness.text import counted

if TYPE_CHECKING:
    from rich.console import Console

    from harness.sweep.spec import PointResult
    from harness.sweep.runner import OnResult

__all__ = ["sweep_command"]


def sweep_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from harness.sweep.executors import MAX_JOBS, ExecutorError, executor_kind, open_executor
    from harness.report.files import OutputError
    from harness.scenario import ScenarioError
    from harness.sweep.spec import SweepError, load_sweep, plan_runs
    from harness.sweep.results import SweepStore
    from harness.sweep.runner import run_sweep

    console = Console(stderr=True)

    def error(what: str, exc: BaseException | str) -> int:
        console.print(f"[red]{what}[/red]: {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 2

    stop: list[str] = []
    with held_signals(stop):  # a signal while planning stops the sweep once its directory exists
        try:
            kind = executor_kind(args.address)
            if args.jobs is not None and not 1 <= args.jobs <= MAX_JOBS:
                raise ExecutorError(f"--jobs must be in 1..{MAX_JOBS}, got {args.jobs}")
            sweep = load_sweep(args.sweep, list(args.overrides))
            outdir = Path(args.outdir) if args.outdir else Path("out") / sweep.name
            runs = plan_runs(sweep, reports=outdir / "points" if args.reports else None)
        except ExecutorError as exc:
            return error("kvemu sweep", exc)
        except ScenarioError as exc:  # SweepError is one
            return error("invalid sweep", _scenario_not_sweep(args.sweep) or exc)
        shape = (f"{counted(sweep.points, 'point')} × {counted(sweep.seeds_per_point, 'seed')} = "
                 f"{counted(len(runs), 'run')}")
        if args.validate:
            print(f"ok: {sweep.name}: {shape}, every point valid")
            return 0
        try:
            store = SweepStore(outdir, sweep, runs, force=args.force)
        except (SweepError, OutputError) as exc:
            return error("kvemu sweep", exc)
    if store.refusals:  # earlier results that do not decode (torn by a kill, or past a bound) are not reused
        console.print(f"[yellow]kvemu sweep: {counted(store.refusals, 'earlier result')} refused, not reused: "
                      f"{escape('; '.join(store.refused[:3]))}[/yellow]", highlight=False, soft_wrap=True)
    todo = len(store.todo())
    jobs = args.jobs or os.cpu_count() or 1
    processes = min(jobs, todo)
    where = {"local": f"a local pool of {counted(processes, 'process', 'processes')}",
             "dask": f"Dask at {args.address}",
             "ray": f"Ray at {args.address}"}[kind]
    if not todo:
        where = f"all {len(runs)} runs reused from {outdir}; nothing to run"
        console.print(f"kvemu: sweep [bold]{sweep.name}[/bold]: {shape}: {where}", highlight=False, soft_wrap=True)
    else:
        reused = f", {store.reused} finished before" if store.reused else ""
        console.print(f"kvemu: sweep [bold]{sweep.name}[/bold]: {shape} ({todo} to run{reused}) on {where} → {outdir}",
                      highlight=False, soft_wrap=True)
    outcome = None
    try:
        with terminate_as_interrupt(), _sweep_progress(console, todo, not args.quiet) as on_result:
            if todo and not stop:
                try:
                    with open_executor(args.address, processes) as executor:
                        outcome = run_sweep(store, executor, on_result=on_result, executor_name=where)
                except KeyboardInterrupt as exc:  # while the executor started (or stopped): no run finished now
                    if outcome is None:
                        stop.append(getattr(exc, "reason", "SIGINT"))
            if outcome is None:
                outcome = run_sweep(store, None, executor_name=where, stopped=stop[0] if stop else None)
    except ExecutorError as exc:
        store.close()
        return error("kvemu sweep", exc)
    if outcome.interrupted:  # one line: what stopped, what is kept where, how to go on
        left = outcome.counts.get("pending", 0)
        console.print(f"[yellow]kvemu sweep: interrupted ({outcome.interrupted}): {len(runs) - left} of "
                      f"{counted(len(runs), 'run')} finished, kept in {escape(str(outdir))}/sweep.md; run the same "
                      f"command again to resume (the other {left})[/yellow]", highlight=False, soft_wrap=True)
        return 143 if outcome.interrupted == "SIGTERM" else 130
    counts = ", ".join(f"{n} {status}" for status, n in outcome.counts.items())
    console.print(f"kvemu: {counts} ({outcome.ran} ran now, {outcome.reused} reused) in "
                  f"{outcome.wall_time_s:.1f} s; results in {outdir}/sweep.md", highlight=False, soft_wrap=True)
    if outcome.failed:
        console.print(f"[red]kvemu: {outcome.failed} of {counted(len(runs), 'run')} failed or stopped early "
                      "(sweep.csv has their errors); run the same command again to retry them[/red]", highlight=False,
                      soft_wrap=True)
        return 1
    return 0


def _scenario_not_sweep(path: str) -> str | None:
    """Why ``path`` is refused as a sweep when it is a scenario (None if it is not one): which command runs it."""
    from harness.scenario import ScenarioError, file_kind, read_text_file
    from harness.yaml_validation import YamlError, load_yaml

    try:
        kind = file_kind(load_yaml(read_text_file(Path(path), "sweep"), path).data)
    except (ScenarioError, YamlError):
        return None
    return (f"{path}: a scenario, not a sweep file (a sweep has axes:): run it with kvemu run {path}, or name it in "
            "a sweep's base:") if kind == "scenario" else None


@contextlib.contextmanager
def _sweep_progress(console: Console, total: int, enabled: bool) -> Iterator[OnResult]:
    """The ``run_sweep`` callback: a progress bar over runs with an ETA (on a terminal), and each failure printed."""
    from rich.markup import escape

    def report_failure(result: PointResult, printer: Console) -> None:
        if result.status != "ok":
            axes = ", ".join(f"{k}={v}" for k, v in result.axes.items())
            printer.print(f"[red]point {result.point} ({axes}) seed {result.seed} {result.status}[/red]: "
                          f"{escape(str(result.error))}", soft_wrap=True, highlight=False)

    if not (enabled and console.is_terminal and total):
        yield lambda result, done, todo: report_failure(result, console)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    with Progress(TextColumn("runs"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]}"),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task("sweep", total=total, failed="")
        failed = 0

        def on_result(result: PointResult, done: int, todo: int) -> None:
            nonlocal failed
            failed += result.status != "ok"
            report_failure(result, bar.console)
            bar.update(task, completed=done, failed=f"{failed} failed" if failed else "")

        yield on_result
