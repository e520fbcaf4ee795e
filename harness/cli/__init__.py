"""The ``kvemu`` command line: run, sweep, plan, validate, compare, demo, and a live cluster's processes.

``main`` here parses the command line and hands the command to its module, one a job: ``parser`` (every command's
options), ``run`` (run, validate, scenario show), ``sweep``, ``plan``, ``processes`` (router, worker, loadgen, up,
serve), ``fleet`` (workers for another router) with ``preflight`` (what those processes refuse before any starts),
``trace`` (validate, convert and generate trace files), ``tools`` (tokenizer, compare, demo), and what they share:
``loading`` (the scenario a command names); what SIGINT and SIGTERM do is ``harness.run.interrupts`` (the run and the
load generators share it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from harness.cli.parser import build_parser
from harness.cli.plan import plan_command
from harness.cli.processes import admission_limits, process_command
from harness.cli.run import run_command, scenario_show_command, validate_command
from harness.cli.sweep import sweep_command
from harness.cli.tools import compare_command, demo_command, tokenizer_command
from harness.run.interrupts import Terminated, terminate_as_interrupt

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvemu`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # plain "kvemu": what it can do, and how to start
        parser.print_help()
        return 0
    if getattr(args, "max_running", None) is not None or getattr(args, "max_waiting", None) is not None:
        from kvemu.errors import InvalidArgument

        try:
            admission_limits(args)
        except InvalidArgument as exc:
            parser.error(str(exc))
    if getattr(args, "overrides", None):
        from harness.scenario import paths_from_cwd

        args.overrides = paths_from_cwd(args.overrides)  # --set paths are from here, not the scenario's folder
    if getattr(args, "allow_local_policies", False):
        import os

        from harness.plugins import ALLOW_LOCAL_POLICIES_ENV

        os.environ[ALLOW_LOCAL_POLICIES_ENV] = "1"  # child processes (kvemu up) inherit it
    if args.command in ("router", "worker", "front", "loadgen", "up", "serve"):
        try:
            return process_command(args)  # (each handles its own signals: a drain, a supervisor's stop)
        except KeyboardInterrupt:  # before it handles them (it was starting): nothing ran, no traceback
            print(f"kvemu {args.command}: interrupted (SIGINT) while starting: nothing ran", file=sys.stderr)
            return 130
    if args.command == "fleet":
        from harness.cli.fleet import fleet_command

        return fleet_command(args)
    try:
        with terminate_as_interrupt():  # the first SIGTERM stops any command, as Ctrl-C does
            return _command(parser, args)
    except KeyboardInterrupt as exc:  # stopped where the command had no handler of its own (nothing written)
        reason = getattr(exc, "reason", "SIGINT") if isinstance(exc, Terminated) else "SIGINT"
        print(f"kvemu {args.command}: interrupted ({reason})", file=sys.stderr)
        return 143 if reason == "SIGTERM" else 130


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run a batch command (not a process of a live cluster)."""
    if args.command == "run":
        return run_command(args)  # (the runner turns Ctrl-C and SIGTERM into a partial report)
    if args.command == "sweep":
        return sweep_command(args)
    if args.command == "bench-router":
        from harness.cli.fleet import bench_router_command

        return bench_router_command(args)  # (a signal keeps the routers' table so far, marked partial)
    if args.command == "plan":
        return plan_command(args)
    if args.command == "validate":
        return validate_command(args)
    if args.command == "trace":
        from harness.cli.trace import trace_command

        return trace_command(args)
    if args.command == "tokenizer":
        return tokenizer_command(args)
    if args.command == "scenario":
        return scenario_show_command(args)
    if args.command == "compare":
        return compare_command(args)
    return demo_command(parser, args)
