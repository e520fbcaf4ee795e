"""The ``kvemu`` command line: run, sweep, validate, compare, demo."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.text import counted

if TYPE_CHECKING:
    from rich.console import Console

    from harness.runner import Progress as ProgressCallback
    from harness.scenario import Scenario

__all__ = ["build_parser", "main"]


def _add_run(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    run = sub.add_parser("run", help="run a scenario (default: the built-in quickstart) and write a report")
    run.add_argument("scenario", nargs="?", help="scenario YAML (omit for the built-in default)")
    _add_set(run)
    run.add_argument("-o", "--outdir", help="report directory (default: out/<scenario name>)")
    run.add_argument("--mode", choices=("virtual", "live"), help="override run.mode")
    run.add_argument("--seed", type=int, help="override run.seed")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    return run


def _load(args: argparse.Namespace) -> Scenario:
    from harness.scenario import default_scenario_text, load_scenario, parse_scenario

    overrides = list(getattr(args, "overrides", []) or [])
    if getattr(args, "mode", None):
        overrides.append(f"run.mode={args.mode}")
    if getattr(args, "seed", None) is not None:
        overrides.append(f"run.seed={args.seed}")
    if args.scenario:
        scenario = load_scenario(args.scenario, overrides)
    else:
        scenario = parse_scenario(default_scenario_text(), base_dir=Path.cwd(), overrides=overrides,
                                  source="<built-in quickstart>")
    from harness.cluster import make_policy

    make_policy(scenario.router.policy)  # a custom policy must import before anything starts
    if scenario.autoscaler is not None:
        from harness.autoscaler import make_autoscaler

        make_autoscaler(scenario.autoscaler)  # so must a custom autoscaler
    return scenario


@contextlib.contextmanager
def _progress_bar(console: Console, enabled: bool) -> Iterator[ProgressCallback | None]:
    """A progress bar on ``console`` and its ``run_scenario`` callback; None (and no rich.progress) if disabled."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    last = {"t": 0, "done": 0}
    with Progress(TextColumn("[bold]{task.fields[clock]}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} requests"), TextColumn("{task.fields[rate]}"),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("run", total=None, clock="t=0s", rate="")

        def progress(now_ns: int, done: int, total: int) -> None:
            dt = (now_ns - last["t"]) / 1e9
            rate = (done - last["done"]) / dt if dt > 0 else 0.0
            last.update(t=now_ns, done=done)
            bar.update(task, completed=done, total=total, clock=f"t={now_ns / 1e9:,.0f}s", rate=f"{rate:.1f} req/s")

        yield progress


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from harness.report.plots import background_renderer
    from harness.report.files import OutputError, prepare_outdir
    from harness.runner import RunAborted, run_scenario
    from harness.scenario import ScenarioError

    console = Console(stderr=True)
    try:
        scenario = _load(args)
    except ScenarioError as exc:
        console.print(f"[red]invalid scenario[/red]: {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 2
    outdir = Path(args.outdir) if getattr(args, "outdir", None) else Path("out") / scenario.name
    try:
        prepare_outdir(outdir)
        with _terminate_as_interrupt():
            console.print(f"kvemu: running [bold]{scenario.name}[/bold] ({scenario.run.mode} time, seed "
                          f"{scenario.run.seed}) on {_shape(scenario)}", soft_wrap=True, highlight=False)
            # the plots' child process imports matplotlib while the scenario runs
            with _progress_bar(console, not args.quiet and console.is_terminal) as progress, background_renderer():
                outcome = run_scenario(scenario, outdir, progress=progress)
    except OutputError as exc:
        console.print(f"[red]cannot write the report[/red]: {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 2
    except ScenarioError as exc:  # the workload (a trace file) is read when the run starts
        console.print(f"[red]invalid scenario[/red]: {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 2
    except RunAborted as exc:
        console.print(f"[red]kvemu: {escape(str(exc))}[/red]", soft_wrap=True, highlight=False)
        return 1
    summary = outcome.summary or {}
    reason = outcome.data.stop_reason or "interrupted"
    partial = f" [yellow](PARTIAL: {escape(reason)})[/yellow]" if outcome.data.partial else ""
    # soft_wrap: rich would wrap at 80 columns in a pipe, breaking the path
    where = (f"report in {escape(str(outcome.report_dir))}/report.md" if outcome.report_dir is not None else
             "no report could be written (its summary is above)")
    console.print(f"kvemu: {summary.get('completed_requests')}/{summary.get('num_requests')} requests completed"
                  f"{partial}; {where}", soft_wrap=True, highlight=False)
    if not outcome.data.partial:
        return 0
    return 143 if outcome.data.stop_reason == "SIGTERM" else 130


@contextlib.contextmanager
def _signal_handlers(handlers: dict[int, Callable[[int, Any], None]]) -> Iterator[None]:
    """Install ``handlers`` (signal number -> handler) for the block, then put the previous ones back; outside
    the main thread, where signals cannot be set, the block runs with them left alone."""
    import signal

    try:
        previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _held_signals(caught: list[str]) -> contextlib.AbstractContextManager[None]:
    """While in this block, SIGINT and SIGTERM are noted in ``caught`` (by name) instead of stopping the process,
    so that what they interrupt (planning a sweep) ends and the caller can stop cleanly."""
    import signal

    def note(signum: int, frame: object) -> None:
        caught.append(signal.Signals(signum).name)

    return _signal_handlers({signal.SIGINT: note, signal.SIGTERM: note})


def _terminate_as_interrupt() -> contextlib.AbstractContextManager[None]:
    """While running, SIGTERM stops the run as Ctrl-C does: a partial report, marked with the signal."""
    import signal

    from harness.runner import Terminated

    def handler(signum: int, frame: object) -> None:
        raise Terminated("SIGTERM")

    return _signal_handlers({signal.SIGTERM: handler})


def _add_sweep(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    sweep = sub.add_parser("sweep", help="run a scenario at every point of a grid of overrides, in parallel; "
                                         "writes sweep.csv, sweep.json and sweep.md")
    sweep.add_argument("sweep", help="sweep YAML (base scenario, axes, seeds, figures)")
    _add_set(sweep, "override a scenario value at every point (joins the sweep's set:; repeatable)")
    sweep.add_argument("-o", "--outdir", help="output directory (default: out/<sweep name>); a re-run resumes there")
    sweep.add_argument("--jobs", type=int, help="local worker processes (default: the CPU count)")
    sweep.add_argument("--address", help="tcp://HOST:PORT: a Dask scheduler; ray://HOST:PORT or auto: a Ray "
                                         "cluster (default: a local process pool)")
    sweep.add_argument("--validate", action="store_true", help="check the sweep and every point, run nothing")
    sweep.add_argument("--reports", action="store_true",
                       help="also write each run's full report to OUTDIR/points/<point>-seed<seed>/ (on the "
                            "machine that runs it: with --address, a filesystem the workers share)")
    sweep.add_argument("--force", action="store_true", help="write into an OUTDIR that holds other files or "
                                                            "another sweep (its results are discarded)")
    sweep.add_argument("--quiet", action="store_true", help="no progress bar")
    return sweep


def _sweep(args: argparse.Namespace) -> int:
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
    with _held_signals(stop):  # a signal while planning stops the sweep once its directory exists
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
        with _terminate_as_interrupt(), _sweep_progress(console, todo, not args.quiet) as on_result:
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
    counts = ", ".join(f"{n} {status}" for status, n in outcome.counts.items())
    console.print(f"kvemu: {counts} ({outcome.ran} ran now, {outcome.reused} reused) in "
                  f"{outcome.wall_time_s:.1f} s; results in {outdir}/sweep.md", highlight=False, soft_wrap=True)
    if outcome.interrupted:
        console.print(f"[yellow]kvemu: interrupted ({outcome.interrupted}): run the same command again to resume "
                      "(finished runs are kept)[/yellow]", highlight=False, soft_wrap=True)
        return 143 if outcome.interrupted == "SIGTERM" else 130
    if outcome.failed:
        console.print(f"[red]kvemu: {outcome.failed} of {counted(len(runs), 'run')} failed or stopped early "
                      "(sweep.csv has their errors); run the same command again to retry them[/red]", highlight=False,
                      soft_wrap=True)
        return 1
    return 0


def _scenario_not_sweep(path: str) -> str | None:
    """Why ``path`` is refused as a sweep when it is a scenario (None if it is not one): which command runs it."""
    import yaml

    from harness.scenario import ScenarioError, file_kind, read_text_file

    try:
        kind = file_kind(yaml.safe_load(read_text_file(Path(path), "sweep")))
    except (ScenarioError, yaml.YAMLError, RecursionError):
        return None
    return (f"{path}: a scenario, not a sweep file (a sweep has axes:): run it with kvemu run {path}, or name it in "
            "a sweep's base:") if kind == "scenario" else None


def _add_plan(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    plan = sub.add_parser("plan", help="find the smallest cluster that meets an SLA at a goodput target (a search, "
                                       "in parallel); writes plan.md, plan.json and plan.png")
    plan.add_argument("scenario", nargs="?", help="scenario YAML or Mooncake trace .jsonl (default: the built-in "
                                                  "quickstart)")
    plan.add_argument("--sla", help="ttft_ms=MS,itl_ms=MS or e2e_ms=MS (default: the scenario's run.sla)")
    plan.add_argument("--goodput", type=float, default=0.95,
                      help="share of requests that must meet the SLA, in (0, 1] (default 0.95)")
    plan.add_argument("--min-workers", type=int, default=1, help="smallest cluster to consider (default 1)")
    plan.add_argument("--max-workers", type=int, default=32, help="largest cluster to consider (default 32)")
    plan.add_argument("--seeds", type=int, default=1, help="seeds per probe; a size passes when every seed does")
    _add_set(plan)
    plan.add_argument("-o", "--outdir", help="output directory (default: out/plan-<scenario name>)")
    plan.add_argument("--jobs", type=int, help="local worker processes, and probes per round (default: CPU count)")
    plan.add_argument("--address", help="tcp://HOST:PORT (Dask) or ray://HOST:PORT | auto (Ray), as for sweep")
    plan.add_argument("--width", type=int, help="probes per round (default: --jobs, or 4 on Dask/Ray)")
    return plan


def _plan(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from harness.sweep.executors import MAX_JOBS, ExecutorError, open_executor
    from harness.sweep.plan import MAX_RUNS_A_ROUND, PlanSpec, answer_line, check_plan, parse_sla, plan_cluster, \
        scenario_for, write_partial_plan, write_plan
    from harness.report.files import OutputError, prepare_outdir
    from harness.scenario import ScenarioError, parse_scenario
    from kvemu.errors import InvalidArgument

    console = Console(stderr=True)

    def error(what: str, exc: BaseException | str) -> int:
        console.print(f"[red]{what}[/red]: {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 2

    try:
        if not 0 < args.goodput <= 1:
            raise InvalidArgument(f"--goodput must be in (0, 1], got {args.goodput}")
        if args.min_workers < 1 or args.max_workers < args.min_workers:
            raise InvalidArgument(f"--min-workers ({args.min_workers}) must be >= 1 and <= --max-workers "
                                  f"({args.max_workers})")
        for flag in ("jobs", "width", "seeds"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                raise InvalidArgument(f"--{flag} must be >= 1, got {getattr(args, flag)}")
        if args.jobs is not None and args.jobs > MAX_JOBS:
            raise InvalidArgument(f"--jobs ({args.jobs}) must be <= {MAX_JOBS}, the local worker processes a plan may "
                                  "start")
        if args.seeds > MAX_RUNS_A_ROUND:  # (before a list of them is built; check_plan bounds seeds x probes)
            raise InvalidArgument(f"--seeds ({args.seeds:,}) must be <= {MAX_RUNS_A_ROUND:,}, the runs a plan may "
                                  "run at once")
        text, base_dir, source = scenario_for(args.scenario)
        scenario = parse_scenario(text, base_dir=base_dir, overrides=list(args.overrides), source=source)
        sla = parse_sla(args.sla) if args.sla else scenario.run.sla
        if sla is None:
            raise InvalidArgument("give --sla ttft_ms=...,itl_ms=... (or e2e_ms=...), or run.sla in the scenario")
        seeds = [scenario.run.seed + k for k in range(args.seeds)]
        spec = PlanSpec(scenario_text=text, base_dir=base_dir, source=source, overrides=list(args.overrides),
                        sla=sla, goodput=args.goodput, min_workers=args.min_workers, max_workers=args.max_workers,
                        seeds=seeds)
        jobs = args.jobs or os.cpu_count() or 1
        width = args.width or (jobs if args.address is None else 4)
        check_plan(spec, width)
        outdir = prepare_outdir(Path(args.outdir) if args.outdir else Path("out") / f"plan-{scenario.name}")
    except (InvalidArgument, ScenarioError) as exc:
        return error("kvemu plan", exc)
    except OutputError as exc:
        return error("cannot write the plan", exc)
    console.print(f"kvemu: planning [bold]{scenario.name}[/bold] for {args.goodput:.0%} of requests within "
                  f"{args.sla or 'run.sla'}, {args.min_workers}–{args.max_workers} workers, {width} probes a round",
                  highlight=False, soft_wrap=True)

    def on_probe(probe: Any) -> None:
        share = probe.met_fraction
        verdict = "error" if share is None else ("passes" if share >= args.goodput else "fails")
        detail = f"{share:.1%} met the SLA" if share is not None else "; ".join(
            str(r["error"]) for r in probe.runs if r["error"])
        console.print(f"  {probe.label} worker{'' if probe.label == '1' else 's'}: {detail} → {verdict}",
                      highlight=False, soft_wrap=True)

    try:
        with _terminate_as_interrupt(), open_executor(args.address, min(jobs, width * len(seeds) * 3)) as executor:
            plan = plan_cluster(spec, executor, width=width, on_probe=on_probe)
    except (ExecutorError, InvalidArgument, ScenarioError) as exc:
        return error("kvemu plan", exc)
    except KeyboardInterrupt as exc:
        reason = getattr(exc, "reason", "SIGINT")
        partial = getattr(exc, "partial_plan", None)
        if partial is not None and partial["probes"]:
            md = write_partial_plan(partial, outdir, reason)
            where = f"what finished ({counted(len(partial['probes']), 'probe')}) is in {md}"
        else:
            where = "no probe had finished; nothing written"
        console.print(f"kvemu plan: interrupted ({reason}); {where}", highlight=False, soft_wrap=True)
        return 143 if reason == "SIGTERM" else 130
    md = write_plan(plan, outdir)
    print(answer_line(plan))
    for name in ("answer", "largest_failing"):
        row = plan[name]
        if row is not None:
            label = "smallest passing" if name == "answer" else "largest failing"
            print(f"  {label}: {counted(row['workers'], 'worker')}, {row['met_fraction']:.1%} met the SLA, "
                  f"p99 TTFT {row['p99_ttft_ms']} ms")
    console.print(f"kvemu: {counted(plan['runs'], 'run')} in {plan['wall_time_s']:.1f} s; plan in {md}",
                  highlight=False, soft_wrap=True)
    return 0 if plan["answer"] is not None else 1


@contextlib.contextmanager
def _sweep_progress(console: Console, total: int, enabled: bool) -> Iterator[Any]:
    """The ``run_sweep`` callback: a progress bar over runs with an ETA (on a terminal), and each failure printed."""
    from rich.markup import escape

    def report_failure(result: dict[str, Any], printer: Any) -> None:
        if result["status"] != "ok":
            axes = ", ".join(f"{k}={v}" for k, v in result["axes"].items())
            printer.print(f"[red]point {result['point']} ({axes}) seed {result['seed']} {result['status']}[/red]: "
                          f"{escape(str(result['error']))}", soft_wrap=True, highlight=False)

    if not (enabled and console.is_terminal and total):
        yield lambda result, done, todo: report_failure(result, console)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    with Progress(TextColumn("runs"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]}"),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task("sweep", total=total, failed="")
        failed = 0

        def on_result(result: dict[str, Any], done: int, todo: int) -> None:
            nonlocal failed
            failed += result["status"] != "ok"
            report_failure(result, bar.console)
            bar.update(task, completed=done, failed=f"{failed} failed" if failed else "")

        yield on_result


def _validate(args: argparse.Namespace) -> int:
    from kvemu.errors import KvemuError

    from harness.cluster import check_buildable
    from harness.runner import count_requests
    from harness.scenario import ScenarioError
    from harness.trace_sessions import turn_count
    from harness.workload import build_sessions

    try:
        scenario = _load(args)
        sessions = build_sessions(scenario)
        check_buildable(scenario)
    except ScenarioError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 2
    except (KvemuError, ValueError) as exc:  # a router or engine part that would not build
        print(f"invalid: {exc}", file=sys.stderr)
        return 2
    turns = turn_count(sessions)
    requests = count_requests(sessions)  # as run counts them: each sub-agent of a turn is a request too
    detail = f" ({counted(turns, 'turn')} + {counted(requests - turns, 'sub-agent request')})" if requests > turns \
        else ""
    print(f"ok: {scenario.name}: {_shape(scenario)}, {counted(len(sessions), 'session')}, "
          f"{counted(requests, 'request')}{detail}, {scenario.run.mode} mode")
    return 0


def _shape(scenario: Scenario) -> str:
    """``4 workers × 1 DP rank``, or ``4 prefill workers × 1 + 12 decode workers × 2 DP ranks``."""
    pools = scenario.cluster.pools()
    if "aggregated" in pools:
        n, dp, _ = pools["aggregated"]
        return f"{counted(n, 'worker')} × {counted(dp, 'DP rank')}"
    last_dp = list(pools.values())[-1][1]
    return " + ".join(f"{counted(n, f'{pool} worker')} × {dp}" for pool, (n, dp, _) in pools.items()) + \
        (" DP rank" if last_dp == 1 else " DP ranks")


def _process(args: argparse.Namespace) -> int:
    from harness.scenario import ScenarioError

    if args.command == "loadgen" and args.config_path and not args.scenario:
        args.scenario = args.config_path
    try:
        scenario = _load(args)
    except ScenarioError as exc:
        print(f"invalid scenario: {exc}", file=sys.stderr)
        return 2
    problem = _http_problem(args) or _disagg_problem(args, scenario) or _autoscaler_problem(args, scenario)
    if problem:
        print(f"kvemu {args.command}: {problem}", file=sys.stderr)
        return 2
    if args.command in ("router", "worker"):
        from kvemu.errors import InvalidArgument
        from kvemu.http.server import ListenError

        try:
            return _serve_process(args, scenario)
        except ListenError as exc:  # the --http port was taken after the check above
            print(f"kvemu {args.command}: {exc}", file=sys.stderr)
            return 2
        except InvalidArgument as exc:  # e.g. a --listen address in use
            print(f"kvemu {args.command}: {exc}", file=sys.stderr)
            return 2
    outdir = Path(args.outdir) if getattr(args, "outdir", None) else Path("out") / scenario.name
    if args.command == "loadgen":
        from harness.procs.loadgen import NotStarted, loadgen_report

        problem = _loadgen_chaos_problem(scenario, args.chaos)
        if problem:
            print(f"kvemu loadgen: {problem}", file=sys.stderr)
            return 2
        try:
            summary, where = loadgen_report(scenario, args.router, outdir, args.expect_workers,
                                            apply_chaos=args.chaos == "apply", router_pid=args.router_pid)
        except NotStarted as exc:  # a router never reached, or lost or stopped before anything ran
            print(f"kvemu loadgen: {exc}", file=sys.stderr)
            return 1
        print(f"kvemu loadgen: {summary.get('completed_requests')}/{summary.get('num_requests')} requests completed; "
              + (f"report in {where}/report.md" if where is not None else "no report could be written (its summary "
                 "is above)"), file=sys.stderr)
        if str(summary.get("kvemu", {}).get("stop_reason") or "").startswith("error:"):
            return 1  # the load generator failed (its partial report is written)
        return 0 if not summary.get("partial") else 130
    from harness.procs.up import NotStarted as ChildNotStarted, serve_main, up_main

    try:
        if args.command == "serve":
            return serve_main(args.scenario or "", list(args.overrides), scenario, _http_args(args),
                              _worker_http_args(args))
        return up_main(args.scenario or "", list(args.overrides), scenario, outdir, _http_args(args),
                       _worker_http_args(args))
    except ChildNotStarted as exc:  # the child printed why on the shared stderr
        print(f"kvemu {args.command}: {exc}", file=sys.stderr)
        return 2 if exc.code == 2 else 1


def _serve_process(args: argparse.Namespace, scenario: Scenario) -> int:
    """``kvemu router`` or ``kvemu worker``: serve until SIGTERM."""
    from harness.scenario import ScenarioError

    if args.command == "router":
        from harness.procs.router import router_main

        return router_main(scenario, args.listen, args.grace, _http_options(args))
    from harness.procs.worker import worker_main, worker_pool

    try:
        worker_pool(scenario, args.worker_type)
    except ScenarioError as exc:
        print(f"kvemu worker: {exc}", file=sys.stderr)
        return 2
    return worker_main(scenario, args.router, worker_id=args.worker_id, dp_size=args.dp_size,
                       kv_events=args.kv_events, kv_replay=args.kv_replay or None, grace_s=args.grace,
                       http=_http_options(args), worker_type=args.worker_type)


def _http_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--http`` / ``--tokenizer`` (None: nothing), before any process starts."""
    if getattr(args, "http", None):
        from kvemu.http.server import ListenError, check_listen, parse_listen

        try:
            parse_listen(args.http)
            check_listen(args.http)  # a busy port is one line now, not a child's traceback later
        except (ValueError, ListenError) as exc:
            return str(exc)
    if getattr(args, "http_server", None) == "granian":
        import importlib.util

        if importlib.util.find_spec("granian") is None:
            return "--http-server granian needs granian: pip install 'kvemu[granian]'"
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer:
        path = Path(tokenizer)
        if not (path / "tokenizer.json" if path.is_dir() else path).is_file():
            return f"--tokenizer {tokenizer}: no tokenizer.json there (kvemu tokenizer export DIR writes one)"
    return None


def _disagg_problem(args: argparse.Namespace, scenario: Scenario) -> str | None:
    """What a disaggregated cluster's processes cannot do yet (None: nothing): serve OpenAI routes."""
    if scenario.cluster.disaggregated and (getattr(args, "http", None) or getattr(args, "worker_http", False)):
        return ("the OpenAI front door (--http, --worker-http, kvemu serve) does not serve a disaggregated cluster "
                "(cluster.prefill, cluster.decode) yet: run it without them (kvemu up, or router, workers and loadgen)")
    return None


def _autoscaler_problem(args: argparse.Namespace, scenario: Scenario) -> str | None:
    """Why processes cannot run this scenario's autoscaler (None: it has none, or this process does not play the
    scenario's timeline)."""
    if scenario.autoscaler is None or args.command in ("router", "worker"):
        return None
    return ("autoscaler: not supported with processes (kvemu up, loadgen, serve, docker-compose): the supervisor "
            "that starts and stops worker processes sees neither the requests' latencies nor the engines' queues "
            "(they live in the load generator and the workers), and the report is the load generator's; run the "
            "scenario with kvemu run (virtual time, or --mode live) instead, or remove the autoscaler section")


def _http_options(args: argparse.Namespace) -> Any:
    """The ``--http`` options of a router process (None without ``--http``)."""
    if not getattr(args, "http", None):
        return None
    from harness.procs.protocol import HttpOptions

    return HttpOptions(listen=args.http, tokenizer=args.tokenizer, model=args.model, server=args.http_server)


def _http_flags(args: argparse.Namespace, listen: str) -> list[str]:
    """The HTTP options a child process gets to serve on ``listen``."""
    flags = ["--http", listen, "--model", args.model, "--http-server", args.http_server]
    return flags + (["--tokenizer", str(Path(args.tokenizer).resolve())] if args.tokenizer else [])


def _http_args(args: argparse.Namespace) -> list[str]:
    """The ``--http`` options to pass on to a router process."""
    return _http_flags(args, args.http) if getattr(args, "http", None) else []


def _worker_http_args(args: argparse.Namespace) -> list[str]:
    """What a worker process needs to serve its own OpenAI routes (``--worker-http``), else nothing."""
    return _http_flags(args, "127.0.0.1:0") if getattr(args, "worker_http", False) else []


def _add_http(parser: argparse.ArgumentParser, default: str | None) -> None:
    parser.add_argument("--http", default=default, metavar="HOST:PORT",
                        help="serve the OpenAI-compatible front door there (port 0: pick a free one)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="a local tokenizer.json (or a directory with one); default: kvemu's built-in tokenizer")
    parser.add_argument("--model", default="kvemu", help="the model name clients use (default: kvemu)")
    parser.add_argument("--http-server", choices=["uvicorn", "granian"], default="uvicorn",
                        help="the HTTP server (granian: pip install 'kvemu[granian]')")


def _tokenizer(args: argparse.Namespace) -> int:
    from kvemu.http.tokenizer import export_builtin

    files = export_builtin(args.directory)
    print(f"wrote kvemu's built-in tokenizer to {args.directory}: {', '.join(f.name for f in files)}")
    print(f"use it with: --tokenizer {args.directory} (aiperf, vllm bench serve, transformers.AutoTokenizer)")
    return 0


def _loadgen_chaos_problem(scenario: Any, chaos: str | None) -> str | None:
    """Why the load generator cannot run this scenario's chaos timeline as asked (None if it can)."""
    from harness.chaos import CONTROL_TOKEN_ENV, ROUTER_CHAOS, chaos_problems

    if not scenario.chaos:
        return None
    if chaos is None:
        return ("this scenario has a chaos timeline: pass --chaos apply to apply it through the router's control "
                "channel, or --chaos skip when something else applies it (kvemu up does)")
    if chaos == "skip":
        return None
    problems = chaos_problems(scenario.chaos, ROUTER_CHAOS, "the load generator (it starts and stops no process: "
                                                           "use kvemu up, or scale the worker service)")
    if not os.environ.get(CONTROL_TOKEN_ENV):
        problems.append(f"--chaos apply needs {CONTROL_TOKEN_ENV} set to the router's control token")
    return "; ".join(problems) or None


def _add_set(parser: argparse.ArgumentParser,
             text: str = "override a scenario value, e.g. --set cluster.workers=8 (repeatable; a relative path is "
                         "from the working directory)") -> None:
    """The ``--set KEY.PATH=VALUE`` option, said once for every command that reads a scenario."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE", help=text)


def _version() -> str:
    """The installed package's version (the source tree's when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvemu")
    except PackageNotFoundError:  # pragma: no cover - run from a checkout without installing
        from kvemu import __version__

        return __version__


def _build_name() -> str:
    """``compiled`` or ``pure``: which build of the hot modules this process runs (``kvemu._build``)."""
    import kvemu

    return "compiled" if kvemu.compiled else "pure"


def build_parser() -> argparse.ArgumentParser:
    """The ``kvemu`` argument parser: every subcommand and option, each with its help."""
    parser = argparse.ArgumentParser(prog="kvemu", description="Emulator of KV-cache-aware LLM serving clusters.")
    parser.add_argument("--version", action="version", version=f"kvemu {_version()} ({_build_name()} build)",
                        help="print the version and the build (compiled or pure Python)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do")
    run_parser = _add_run(sub)
    sweep_parser = _add_sweep(sub)
    _add_plan(sub)
    validate = sub.add_parser("validate", help="check a scenario without running it")
    validate.add_argument("scenario", nargs="?", help="scenario YAML (omit for the built-in default)")
    _add_set(validate)
    compare = sub.add_parser("compare", help="print two reports' summaries side by side with deltas")
    compare.add_argument("a", help="the first report directory (A: has summary.json)")
    compare.add_argument("b", help="the second report directory (B: deltas are B - A)")
    router = sub.add_parser("router", help="run a router process (workers and load generators connect to it)")
    router.add_argument("--listen", default="tcp://127.0.0.1:5555", help="ROUTER endpoint for workers and clients")
    router.add_argument("--config", dest="scenario", help="scenario YAML for the router and engine settings")
    _add_set(router)
    router.add_argument("--grace", type=float, default=10.0, help="seconds to drain requests on SIGTERM")
    worker = sub.add_parser("worker", help="run a mock worker process with its DP ranks")
    worker.add_argument("--router", required=True, help="the router's --listen endpoint")
    worker.add_argument("--worker-id", type=int, help="default: random")
    worker.add_argument("--dp-size", type=int, help="default: the scenario's cluster.dp_size (or its pool's)")
    worker.add_argument("--worker-type", choices=("aggregated", "prefill", "decode"),
                        help="the pool this worker serves, with that pool's engine and DP size: required for a "
                             "disaggregated scenario (prefill or decode); default: aggregated")
    worker.add_argument("--kv-events", default="tcp://127.0.0.1:0",
                        help="PUB endpoint of rank 0 (rank r uses port + r; port 0 = pick one per rank)")
    worker.add_argument("--kv-replay", default="tcp://127.0.0.1:0", help="replay ROUTER endpoint ('' to disable)")
    worker.add_argument("--config", dest="scenario", help="scenario YAML for the engine settings")
    _add_set(worker)
    worker.add_argument("--grace", type=float, default=10.0, help="seconds to finish requests on SIGTERM")
    _add_http(worker, None)
    loadgen = sub.add_parser("loadgen", help="play a scenario's workload against a router process")
    loadgen.add_argument("scenario", nargs="?", help="scenario YAML (default: the built-in quickstart)")
    loadgen.add_argument("--config", dest="config_path", help="same as the positional scenario")
    loadgen.add_argument("--router", required=True, help="the router's --listen endpoint")
    loadgen.add_argument("-o", "--outdir", help="report directory (default: out/<scenario name>)")
    loadgen.add_argument("--expect-workers", type=int, help="wait until this many workers are registered")
    loadgen.add_argument("--router-pid", type=int,
                         help="the router's process id on this machine: a silent router whose process is alive is "
                              "waited for (run.router_stall_s), one whose process exited is lost at once")
    loadgen.add_argument("--chaos", choices=["apply", "skip"],
                         help="a scenario with a chaos timeline: apply it through the router's control channel "
                              "(needs KVEMU_CONTROL_TOKEN, as the router has) or skip it (kvemu up applies it)")
    _add_set(loadgen)
    _add_http(router, None)
    up = sub.add_parser("up", help="router + workers + load generator as processes on 127.0.0.1, then a report")
    up.add_argument("scenario", nargs="?", help="scenario YAML (default: the built-in quickstart)")
    _add_set(up)
    up.add_argument("-o", "--outdir", help="report directory (default: out/<scenario name>)")
    _add_http(up, None)
    serve = sub.add_parser("serve", help="router with its OpenAI front door + workers as processes, until Ctrl-C")
    serve.add_argument("scenario", nargs="?", help="scenario YAML for the cluster (default: the built-in quickstart)")
    _add_set(serve)
    _add_http(serve, "127.0.0.1:8000")
    for command in (up, serve):
        command.add_argument("--worker-http", action="store_true",
                             help="every worker also serves the OpenAI routes for its own ranks, with vLLM's metrics "
                                  "(on a free 127.0.0.1 port each; printed at start)")
    tokenizer = sub.add_parser("tokenizer", help="the built-in tokenizer as a Hugging Face tokenizer directory")
    tokenizer_sub = tokenizer.add_subparsers(dest="tokenizer_command", required=True, metavar="COMMAND",
                                             help="what to do with it")
    export = tokenizer_sub.add_parser("export", help="write tokenizer.json and its configs into DIR")
    export.add_argument("directory", help="where to write them (created if missing)")
    demo = sub.add_parser("demo", help="route a few multi-turn sessions with the policy core alone")
    demo.add_argument("--workers", type=int, default=4, help="workers to route to (default 4)")
    demo.add_argument("--dp-size", type=int, default=2, help="DP ranks per worker (default 2)")
    demo.add_argument("--sessions", type=int, default=6, help="conversations (default 6)")
    demo.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the prompts and tie-breaking (default 0)")
    for command in (run_parser, sweep_parser, validate, router, worker, loadgen, up, serve):
        command.add_argument("--allow-local-policies", action="store_true",
                             help="put the working directory on the import path for router.policy and "
                                  "autoscaler.policy modules (a scenario can run code)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvemu`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "overrides", None):
        from harness.scenario import paths_from_cwd

        args.overrides = paths_from_cwd(args.overrides)  # --set paths are from here, not the scenario's folder
    if getattr(args, "allow_local_policies", False):
        import os

        from harness.cluster import ALLOW_LOCAL_POLICIES_ENV

        os.environ[ALLOW_LOCAL_POLICIES_ENV] = "1"  # child processes (kvemu up) inherit it
    if args.command in ("router", "worker", "loadgen", "up", "serve"):
        return _process(args)  # (each handles its own signals: a drain, a supervisor's stop)
    from harness.runner import Terminated

    try:
        with _terminate_as_interrupt():  # the first SIGTERM stops any command, as Ctrl-C does
            return _command(parser, args)
    except KeyboardInterrupt as exc:  # stopped where the command had no handler of its own (nothing written)
        reason = getattr(exc, "reason", "SIGINT") if isinstance(exc, Terminated) else "SIGINT"
        print(f"kvemu {args.command}: interrupted ({reason})", file=sys.stderr)
        return 143 if reason == "SIGTERM" else 130


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run a batch command (not a process of a live cluster)."""
    if args.command == "run":
        return _run(args)  # (the runner turns Ctrl-C and SIGTERM into a partial report)
    if args.command == "sweep":
        return _sweep(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "validate":
        return _validate(args)
    if args.command == "tokenizer":
        return _tokenizer(args)
    if args.command == "compare":
        from harness.report.compare import main as compare_main

        return compare_main([args.a, args.b])
    from harness.demo import run_demo

    for name in ("workers", "dp_size", "sessions", "turns"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    run_demo(sys.stdout, workers=args.workers, dp_size=args.dp_size, sessions=args.sessions, turns=args.turns,
             seed=args.seed)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
