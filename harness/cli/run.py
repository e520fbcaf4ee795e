"""``kvemu run`` (one scenario in this process, then its report) and ``kvemu validate`` (the same checks, nothing
run)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from harness.cli.loading import cluster_shape, load_scenario_args, run_origin
from harness.run.interrupts import terminate_as_interrupt
from harness.run.mode import MODES
from harness.text import counted

if TYPE_CHECKING:
    from rich.console import Console

    from harness.run.progress import RunProgress
    from harness.run.runner import Progress as ProgressCallback
    from harness.scenario import Scenario

__all__ = ["run_command", "scenario_show_command", "validate_command"]


@contextlib.contextmanager
def _progress_bar(console: Console, meter: RunProgress | None) -> Iterator[ProgressCallback | None]:
    """A progress bar on ``console`` showing ``meter``'s line (the phase, its counts, the ETA), and the
    ``run_scenario`` callback that moves it; None (and no rich.progress) without a meter."""
    if meter is None:
        yield None
        return
    from rich.progress import BarColumn, Progress, ProgressColumn, Task
    from rich.text import Text

    shown = meter

    class _Line(ProgressColumn):
        def render(self, task: Task) -> Text:  # read at each refresh: generation runs in the main thread meanwhile
            return Text(shown.line())

    with Progress(BarColumn(), _Line(), console=console) as bar:
        task = bar.add_task("run", total=None)

        def progress(now_ns: int, done: int, total: int) -> None:
            meter.running(now_ns, done, total)
            bar.update(task, completed=round((meter.fraction() or 0.0) * 1000), total=1000)

        yield progress


def run_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from harness.report.plots import PLOTS, background_renderer
    from harness.report.files import OutputError, claim_outdir
    from harness.run.progress import for_scenario
    from harness.run.runner import NothingRan, RunAborted, run_scenario
    from harness.scenario import ScenarioError

    console = Console(stderr=True)
    try:
        scenario = load_scenario_args(args)
    except ScenarioError as exc:
        console.print(f"[red]invalid scenario[/red]: {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 2
    outdir = Path(args.outdir) if getattr(args, "outdir", None) else Path("out") / scenario.name
    if MODES[scenario.run.mode].opens_sockets:  # this process's own: no other process may use them
        from kvemu.wire.security import ensure_secret

        ensure_secret()
    try:
        claim_outdir(outdir, force=getattr(args, "force", False))
        with terminate_as_interrupt():
            console.print(f"kvemu: running [bold]{scenario.name}[/bold] ({scenario.run.mode} time, seed "
                          f"{scenario.run.seed}) on {cluster_shape(scenario)}", soft_wrap=True, highlight=False)
            # the plots' child process imports matplotlib while the scenario runs
            meter = for_scenario(scenario) if not args.quiet and console.is_terminal else None
            background = plots_in_background(getattr(args, "plots", "auto"), console.is_terminal)
            with _progress_bar(console, meter) as progress, background_renderer(wait=not background):
                outcome = run_scenario(scenario, outdir, progress=progress,
                                       generated=meter.generated if meter is not None else None,
                                       origin=run_origin(args))
    except OutputError as exc:
        console.print(f"[red]cannot write the report[/red]: {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 2
    except ScenarioError as exc:  # the workload (a trace file) is read when the run starts
        console.print(f"[red]invalid scenario[/red]: {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 2
    except NothingRan as exc:  # Ctrl-C while the workload was made: no 0/0 report
        console.print(f"kvemu run: {escape(str(exc))}", soft_wrap=True, highlight=False)
        return exc.exit_code
    except RunAborted as exc:
        console.print(f"[red]kvemu: {escape(str(exc))}[/red]", soft_wrap=True, highlight=False)
        return 1
    summary = outcome.summary  # (written: the run was given an output directory)
    assert summary is not None
    reason = outcome.data.stop_reason or "interrupted"
    partial = f" [yellow](PARTIAL: {escape(reason)})[/yellow]" if outcome.data.partial else ""
    # soft_wrap: rich would wrap at 80 columns in a pipe, breaking the path
    where = (f"report in {escape(str(outcome.report_dir))}/report.md" if outcome.report_dir is not None else
             "no report could be written (its summary is above)")
    console.print(f"kvemu: {summary.completed_requests}/{summary.num_requests} requests completed"
                  f"{partial}; {where}", soft_wrap=True, highlight=False)
    if background and outcome.report_dir is not None and _plots_pending(outcome.report_dir, PLOTS):
        console.print("kvemu: the plots are being drawn in the background; each appears when done (within "
                      "seconds)", soft_wrap=True, highlight=False)
    if not args.quiet:
        from harness.report.first_screen import first_screen

        report = outcome.report_dir / "report.md" if outcome.report_dir is not None else None
        print(first_screen("kvemu run", summary, report), end="", flush=True)
    if not outcome.data.partial:
        return 0
    return 143 if outcome.data.stop_reason == "SIGTERM" else 130


def plots_in_background(choice: str, interactive: bool) -> bool:
    """``--plots``: whether the command ends before its plots are drawn. ``auto`` does so for a person at a
    terminal only: a script reading the report's directory next finds every file there."""
    return choice == "background" or (choice == "auto" and interactive)


def _plots_pending(report_dir: Path, plots: Sequence[str]) -> bool:
    """Whether a plot the report names is not written yet (left to the background renderer)."""
    return any(not (report_dir / name).exists() for name in plots)


def validate_command(args: argparse.Namespace) -> int:
    from kvemu.errors import KvemuError

    from harness.run.factories import check_buildable
    from harness.scenario import ScenarioError
    from harness.workload.build import build_sessions

    try:
        scenario = load_scenario_args(args)
        sessions = build_sessions(scenario)
        check_buildable(scenario)
    except ScenarioError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 2
    except (KvemuError, ValueError) as exc:  # a router or engine part that would not build
        print(f"invalid: {exc}", file=sys.stderr)
        return 2
    print(f"ok: {scenario.name}: {cluster_shape(scenario)}, {sessions.in_words()}, {scenario.run.mode} mode"
          + _lanes_note(scenario))
    return 0


def scenario_show_command(args: argparse.Namespace) -> int:
    """``kvemu scenario show``: the resolved scenario as YAML, each key with its bound and meaning (no policy module
    is imported: nothing runs)."""
    from harness.scenario import ScenarioError, parse_scenario, scenario_text
    from harness.scenario.show import show_scenario

    try:
        text, base_dir, source = scenario_text(args.scenario or None)
        scenario = parse_scenario(text, base_dir=base_dir, overrides=list(args.overrides), source=source)
    except ScenarioError as exc:
        print(f"invalid scenario: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(show_scenario(scenario))
    return 0


def _lanes_note(scenario: Scenario) -> str:
    """``validate``'s words for a workload on lanes: how many, and for how long."""
    lanes = getattr(scenario.workload, "lanes", None)
    if lanes is None:
        return ""
    span = f"recycling the corpus for {lanes.duration_s:g} s" if lanes.duration_s is not None else "the corpus once"
    return f", on {counted(lanes.lanes, 'lane')} ({span})"
