"""``kvemu fleet`` (the scenario's workers with no kvemu router, until Ctrl-C) and ``kvemu bench-router`` (the
workload through several routers, each in front of a fresh fleet)."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from harness.cli.loading import load_scenario_args
from harness.cli.preflight import autoscaler_problem, http_problem
from harness.cli.processes import admission_limits

if TYPE_CHECKING:
    from harness.report.summary_types import Summary

__all__ = ["fleet_command", "bench_router_command"]

DEFAULT_ROUTERS = ("kvemu", "vllm-router:kv_aware", "vllm-router:cache_aware", "vllm-router:round_robin",
                   "sglang-router:cache_aware")


def fleet_command(args: argparse.Namespace) -> int:
    """Serve the fleet until SIGTERM/SIGINT; its start line (and ``--print-flags``' line) go to standard output."""
    from harness.scenario import ScenarioError

    try:
        scenario = load_scenario_args(args)
    except ScenarioError as exc:
        print(f"invalid scenario: {exc}", file=sys.stderr)
        return 2
    from harness.procs.fleet import fleet_chaos_problems

    problems = [p for p in (http_problem(args), autoscaler_problem(args, scenario)) if p]
    problems += fleet_chaos_problems(scenario, args.processes)
    if problems:
        for problem in problems:
            print(f"kvemu fleet: {problem}", file=sys.stderr)
        return 2
    from kvemu.runtime.loop import run_live

    from harness.external_routers import flag_caveats, fleet_flags
    from harness.procs.fleet import Fleet
    from harness.procs.protocol import HttpOptions
    from harness.text import counted
    from harness.tuning import tune_gc

    http = HttpOptions(listen="127.0.0.1:0", tokenizer=str(Path(args.tokenizer).resolve()) if args.tokenizer else None,
                       model=args.model, server=args.http_server, admission=admission_limits(args))
    sets = [x for o in args.overrides for x in ("--set", o)]
    config = (["--config", str(Path(args.scenario).resolve())] if args.scenario else []) + sets

    async def serve() -> None:
        fleet = Fleet(scenario, http=http, processes=args.processes, config_args=config)
        async with anyio.create_task_group() as tg:
            info = await tg.start(fleet.run)
            print(_json(info), flush=True)
            if args.print_flags:
                print(shlex.join(fleet_flags(args.print_flags, info)), flush=True)
                for caveat in flag_caveats(args.print_flags, info):
                    print(f"kvemu fleet: {caveat}", file=sys.stderr, flush=True)
            print(f"kvemu fleet: {counted(len(info.workers), 'worker')} serving (no kvemu router: put yours in front; "
                  f"kvemu fleet --print-flags vllm-router|sglang-router says how); Ctrl-C stops",
                  file=sys.stderr, flush=True)
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            tg.cancel_scope.cancel()

    tune_gc()
    run_live(serve)
    return 0


def _json(info: object) -> str:
    return msgspec.json.encode(info).decode()


def _first_screen(name: str, rows: list[dict[str, Any]], summaries: dict[str, Summary], outdir: Path) -> str:
    """bench-router's answer: each router's run summed up in a column (``harness.report.first_screen``); a router
    that never ran has no summary."""
    from harness.report.first_screen import render_first_screen

    runs = [(row["router"], summaries.get(row["router"])) for row in rows]
    through = f" through {runs[0][0]}" if len(runs) == 1 else ""  # (several: each router heads its column)
    return render_first_screen(f"kvemu bench-router: {name}{through}", runs, outdir / "routers.md")


def bench_router_command(args: argparse.Namespace) -> int:
    """Run the workload through each router; the table goes to standard output."""
    from harness.external_routers import RouterSpecError, parse_router
    from harness.router_bench import BenchInterrupted, bench_routers
    from harness.scenario import ScenarioError

    try:
        routers = [parse_router(r) for r in (args.routers or DEFAULT_ROUTERS)]
        scenario = load_scenario_args(args)
    except (RouterSpecError, ScenarioError) as exc:
        print(f"kvemu bench-router: {exc}", file=sys.stderr)
        return 2
    if not 1 <= args.compress <= 1000:
        print(f"kvemu bench-router: --compress {args.compress:g}: between 1 and 1000", file=sys.stderr)
        return 2
    from harness.procs.fleet import fleet_chaos_problems

    problems = [p for p in [autoscaler_problem(args, scenario), *fleet_chaos_problems(scenario, False)] if p]
    if scenario.cluster.disaggregated and any(r.kind == "kvemu" for r in routers):
        problems.append("kvemu's own front door (kvemu serve) does not serve a disaggregated cluster (cluster.prefill, "
                        "cluster.decode); its virtual run does (kvemu run): drop --router kvemu here")
    if scenario.chaos and any(r.kind == "kvemu" for r in routers):
        problems.append("a chaos timeline applies to the fleets of other routers (kvemu fleet), not to kvemu's own "
                        "(kvemu serve has none): drop --router kvemu, or the chaos section")
    if problems:
        for problem in problems:
            print(f"kvemu bench-router: {problem}", file=sys.stderr)
        return 2
    outdir = Path(args.outdir) if args.outdir else Path("out") / f"{scenario.name}-routers"
    from harness.report.files import OutputError, claim_outdir

    try:
        claim_outdir(outdir, force=args.force, into="write the reports there")
    except OutputError as exc:
        print(f"kvemu bench-router: cannot write the reports: {exc}", file=sys.stderr)
        return 2
    from harness.run.runner import NothingRan

    try:
        summaries: dict[str, Summary] = {}
        rows, _ = bench_routers(args.scenario, list(args.overrides), routers, outdir, args.compress, args.prompt,
                                summaries)
    except ScenarioError as exc:
        print(f"kvemu bench-router: {exc}", file=sys.stderr)
        return 2
    except BenchInterrupted as exc:  # the routers' table so far is written
        print(f"kvemu bench-router: {exc}", file=sys.stderr, flush=True)
        if not args.quiet and exc.rows:
            print(_first_screen(scenario.name, exc.rows, summaries, outdir), end="", flush=True)
        return exc.exit_code
    except NothingRan as exc:  # while the workload was counted, before the first router
        print(f"kvemu bench-router: {exc}", file=sys.stderr)
        return exc.exit_code
    if not args.quiet:
        print(_first_screen(scenario.name, rows, summaries, outdir), end="", flush=True)
    return 0 if all(r["completed"] and not r.get("error") for r in rows) else 1
