"""``kvemu plan``: the smallest cluster that meets an SLA at a goodput target (a search over cluster sizes)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from harness.run.interrupts import terminate_as_interrupt
from harness.text import counted

if TYPE_CHECKING:
    from harness.sweep.plan import Probe

__all__ = ["plan_command"]


def plan_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from harness.sweep.executors import MAX_JOBS, ExecutorError, open_executor
    from harness.sweep.plan import MAX_RUNS_A_ROUND, PlanSpec, answer_line, check_plan, parse_sla, plan_cluster, \
        write_partial_plan, write_plan
    from harness.report.files import OutputError, claim_outdir
    from harness.scenario import ScenarioError, parse_scenario, scenario_text
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
        text, base_dir, source = scenario_text(args.scenario)
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
        outdir = claim_outdir(Path(args.outdir) if args.outdir else Path("out") / f"plan-{scenario.name}",
                              force=args.force, into="write the plan there")
    except (InvalidArgument, ScenarioError) as exc:
        return error("kvemu plan", exc)
    except OutputError as exc:
        return error("cannot write the plan", exc)
    console.print(f"kvemu: planning [bold]{scenario.name}[/bold] for {args.goodput:.0%} of requests within "
                  f"{args.sla or 'run.sla'}, {args.min_workers}–{args.max_workers} workers, {width} probes a round",
                  highlight=False, soft_wrap=True)

    def on_probe(probe: Probe) -> None:
        share = probe.met_fraction
        verdict = "error" if share is None else ("passes" if share >= args.goodput else "fails")
        detail = f"{share:.1%} met the SLA" if share is not None else "; ".join(
            str(r.error) for r in probe.runs if r.error)
        console.print(f"  {probe.label} worker{'' if probe.label == '1' else 's'}: {detail} → {verdict}",
                      highlight=False, soft_wrap=True)

    try:
        with terminate_as_interrupt(), open_executor(args.address, min(jobs, width * len(seeds) * 3)) as executor:
            plan = plan_cluster(spec, executor, width=width, on_probe=on_probe)
    except (ExecutorError, InvalidArgument, ScenarioError) as exc:
        return error("kvemu plan", exc)
    except KeyboardInterrupt as exc:
        reason = getattr(exc, "reason", "SIGINT")
        partial = getattr(exc, "partial_plan", None)
        if partial is not None and partial.probes:
            md = write_partial_plan(partial, outdir, reason)
            where = f"what finished ({counted(len(partial.probes), 'probe')}) is in {md}"
        else:
            where = "no probe had finished; nothing written"
        console.print(f"kvemu plan: interrupted ({reason}); {where}", highlight=False, soft_wrap=True)
        return 143 if reason == "SIGTERM" else 130
    md = write_plan(plan, outdir)
    print(answer_line(plan))
    for label, row in (("smallest passing", plan.answer), ("largest failing", plan.largest_failing)):
        if row is not None:
            met = "n/a" if row.met_fraction is None else f"{row.met_fraction:.1%}"
            print(f"  {label}: {counted(row.workers, 'worker')}, {met} met the SLA, "
                  f"p99 TTFT {row.p99_ttft_ms} ms")
    console.print(f"kvemu: {counted(plan.runs, 'run')} in {plan.wall_time_s:.1f} s; plan in {md}",
                  highlight=False, soft_wrap=True)
    return 0 if plan.answer is not None else 1
