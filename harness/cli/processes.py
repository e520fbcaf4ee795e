"""The processes of a live cluster: ``kvemu router``, ``kvemu worker``, ``kvemu loadgen``, and ``kvemu up`` and
``kvemu serve``, which start them; each handles its own signals (a drain, a supervisor's stop)."""

from __future__ import annotations

import argparse
import sys

import msgspec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.cli.loading import load_scenario_args, run_origin
from harness.cli.preflight import autoscaler_problem, disagg_problem, http_problem, loadgen_chaos_problem
from harness.run.interrupts import held_signals

if TYPE_CHECKING:
    from harness.report.summary_types import Summary
    from harness.scenario import Scenario

__all__ = ["process_command"]


def process_command(args: argparse.Namespace) -> int:
    from harness.scenario import ScenarioError

    if args.command == "loadgen" and args.config_path and not args.scenario:
        args.scenario = args.config_path
    try:
        scenario = load_scenario_args(args)
    except ScenarioError as exc:
        print(f"invalid scenario: {exc}", file=sys.stderr)
        return 2
    if args.command == "loadgen" and not (args.router or args.http_url):
        print("kvemu loadgen: give --router (a kvemu router process) or --http URL (any OpenAI-compatible server)",
              file=sys.stderr)
        return 2
    problem = http_problem(args) or disagg_problem(args, scenario) or autoscaler_problem(args, scenario)
    if problem:
        print(f"kvemu {args.command}: {problem}", file=sys.stderr)
        return 2
    if args.command in ("router", "worker", "front"):
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
    if args.command in ("loadgen", "up"):
        from harness.report.files import OutputError, claim_outdir

        try:
            claim_outdir(outdir, force=getattr(args, "force", False))
        except OutputError as exc:
            print(f"kvemu {args.command}: cannot write the report: {exc}", file=sys.stderr)
            return 2
    if args.command == "loadgen" and args.http_url:
        return _http_loadgen(args, scenario, outdir)
    if args.command == "loadgen":
        from harness.procs.loadgen import NotStarted, loadgen_report
        from harness.run.runner import NothingRan

        problem = loadgen_chaos_problem(scenario, args.chaos) or _loadgen_routers_problem(args, scenario)
        if problem:
            print(f"kvemu loadgen: {problem}", file=sys.stderr)
            return 2
        try:
            summary, where = loadgen_report(scenario, args.router, outdir, args.expect_workers,
                                            apply_chaos=args.chaos == "apply", router_pid=args.router_pid,
                                            origin=run_origin(args), command=args.report_as)
        except NothingRan as exc:  # Ctrl-C or SIGTERM before anything ran
            print(f"kvemu loadgen: {exc}", file=sys.stderr)
            return exc.exit_code
        except NotStarted as exc:  # a router never reached, or lost before anything ran
            print(f"kvemu loadgen: {exc}", file=sys.stderr)
            return 1
        except ScenarioError as exc:  # the workload (a trace file) is read when the load generator starts
            print(f"invalid scenario: {exc}", file=sys.stderr)
            return 2
        with held_signals([]):  # the report is written: one more Ctrl-C does not turn its line into a traceback
            print(f"kvemu loadgen: {summary.completed_requests}/{summary.num_requests} requests "
                  "completed" + _stopped(summary) + "; " + (f"report in {where}/report.md" if where is not None else
                                                            "no report could be written (its summary is above)"),
                  file=sys.stderr, flush=True)
        _first_screen(args, summary, where)
        if (summary.kvemu.stop_reason or "").startswith("error:"):
            return 1  # the load generator failed (its partial report is written)
        return 0 if not summary.partial else 130
    from harness.procs.up import NotStarted as ChildNotStarted, run_secret, serve_main, up_main

    if args.command == "serve" and args.in_process:
        if args.worker_http:
            print("kvemu serve: --in-process serves the front door only (drop --worker-http)", file=sys.stderr)
            return 2
        from harness.procs.serve_in_process import serve_in_process

        run_secret("kvemu serve")  # its ZeroMQ sockets are its own alone
        return serve_in_process(scenario, _http_options(args))
    try:
        if args.command == "serve":
            return serve_main(args.scenario or "", list(args.overrides), scenario, _http_args(args),
                              _worker_http_args(args))
        return up_main(args.scenario or "", list(args.overrides), scenario, outdir, _http_args(args),
                       _worker_http_args(args), quiet=args.quiet)
    except ChildNotStarted as exc:  # the child printed why on the shared stderr
        print(f"kvemu {args.command}: {exc}", file=sys.stderr)
        return 2 if exc.code == 2 else 1


def _first_screen(args: argparse.Namespace, summary: Summary, where: Path | None) -> None:
    """The run's answer on standard output (``harness.report.first_screen``), unless ``--quiet``."""
    if args.quiet:
        return
    from harness.report.first_screen import first_screen

    print(first_screen(args.report_as, summary, where / "report.md" if where is not None else None), end="",
          flush=True)


def _stopped(summary: Summary) -> str:
    """`` (PARTIAL: why)`` for a report of a run stopped early, else nothing."""
    return f" (PARTIAL: {summary.kvemu.stop_reason or 'stopped'})" if summary.partial else ""


def _loadgen_routers_problem(args: argparse.Namespace, scenario: Scenario) -> str | None:
    """Whether the load generator's ``--router`` (and ``--router-pid``) flags fit the scenario's router replicas."""
    n, given = scenario.router.replicas, len(args.router)
    if given != n:
        return (f"{given} --router flags for router.replicas {n}: give each router replica's --listen endpoint, in "
                "replica order" if n > 1 else f"{given} --router flags: give one (router.replicas is 1)")
    if args.router_pid and len(args.router_pid) != given:
        return f"{len(args.router_pid)} --router-pid flags for {given} --router: give one per router, in the same order"
    return None


def _http_loadgen(args: argparse.Namespace, scenario: Scenario, outdir: Path) -> int:
    """``kvemu loadgen --http URL``: the workload against any OpenAI-compatible server."""
    import msgspec

    from harness.procs.fleet import FleetInfo
    from harness.procs.http_loadgen import http_loadgen_report

    if args.router:
        print("kvemu loadgen: --router or --http, not both", file=sys.stderr)
        return 2
    if not args.http_url.startswith(("http://", "https://")):
        print(f"kvemu loadgen: --http {args.http_url}: an http:// or https:// URL", file=sys.stderr)
        return 2
    fleet = None
    if args.fleet:
        try:
            text = sys.stdin.readline() if args.fleet == "-" else Path(args.fleet).read_text().splitlines()[0]
            fleet = msgspec.json.decode(text, type=FleetInfo)
        except (OSError, IndexError, msgspec.DecodeError) as exc:
            print(f"kvemu loadgen: --fleet {args.fleet}: not kvemu fleet's start line ({exc})", file=sys.stderr)
            return 2
    from harness.run.runner import NothingRan

    try:
        summary, where = http_loadgen_report(scenario, args.http_url, outdir, fleet=fleet, prompt_form=args.prompt,
                                             tokenizer=args.tokenizer, model=args.model,
                                             origin=run_origin(args), command=args.report_as)
    except NothingRan as exc:  # Ctrl-C or SIGTERM while the workload was made
        print(f"kvemu loadgen: {exc}", file=sys.stderr)
        return exc.exit_code
    with held_signals([]):  # the report is written: one more Ctrl-C does not turn its line into a traceback
        print(f"kvemu loadgen: {summary.completed_requests}/{summary.num_requests} requests completed"
              + _stopped(summary) + "; " + (f"report in {where}/report.md" if where is not None else
                                           "no report could be written"), file=sys.stderr, flush=True)
    _first_screen(args, summary, where)
    return 0 if not summary.partial else 130


def _serve_process(args: argparse.Namespace, scenario: Scenario) -> int:
    """``kvemu router``, ``kvemu front`` or ``kvemu worker``: serve until SIGTERM."""
    from harness.scenario import ScenarioError

    if args.command == "front":
        from harness.procs.replica_door import front_main

        n = scenario.router.replicas
        if len(args.router) != n:
            print(f"kvemu front: {len(args.router)} --router flags for router.replicas {n}: give each router "
                  "replica's --listen endpoint, in replica order", file=sys.stderr)
            return 2
        return front_main(scenario, args.router, _http_options(args), args.grace)
    if args.command == "router":
        from harness.procs.router import router_main

        peers, problem = _replica_flags(args, scenario)
        if problem:
            print(f"kvemu router: {problem}", file=sys.stderr)
            return 2
        return router_main(scenario, args.listen, args.grace, _http_options(args), args.replica, args.sync_listen,
                           peers)
    from harness.procs.worker import worker_main, worker_pool

    if args.router is None and not args.http:
        print("kvemu worker: give --router (a kvemu router's --listen endpoint) or --http (serve clients, or "
              "another router, directly): with neither, nothing could reach this worker", file=sys.stderr)
        return 2

    try:
        worker_pool(scenario, args.worker_type)
    except ScenarioError as exc:
        print(f"kvemu worker: {exc}", file=sys.stderr)
        return 2
    return worker_main(scenario, args.router, worker_id=args.worker_id, dp_size=args.dp_size,
                       kv_events=args.kv_events, kv_replay=args.kv_replay or None, grace_s=args.grace,
                       http=_http_options(args), worker_type=args.worker_type, own_engine=args.own_engine)


def _replica_flags(args: argparse.Namespace, scenario: Scenario) -> tuple[dict[int, str], str | None]:
    """A router replica's ``--sync-peer I=ENDPOINT`` flags as {replica: endpoint}, and what is wrong with its
    replica flags (None: nothing)."""
    n = scenario.router.replicas
    if not 0 <= args.replica < n:
        return {}, f"--replica {args.replica}: the scenario's router.replicas is {n} (replicas 0 .. {n - 1})"
    peers: dict[int, str] = {}
    for flag in args.sync_peer:
        index, _, endpoint = flag.partition("=")
        if not index.strip().isdigit() or not endpoint or not 0 <= int(index) < n or int(index) == args.replica:
            return {}, (f"--sync-peer {flag}: give I=ENDPOINT with I another replica (0 .. {n - 1}, not this one, "
                        f"{args.replica}) and ENDPOINT its --sync-listen address")
        peers[int(index)] = endpoint
    return peers, None


def _http_options(args: argparse.Namespace) -> Any:
    """The ``--http`` options of a router process (None without ``--http``)."""
    if not getattr(args, "http", None):
        return None
    from harness.procs.protocol import HttpOptions

    return HttpOptions(listen=args.http, tokenizer=args.tokenizer, model=args.model, server=args.http_server,
                       admission=admission_limits(args))


def admission_limits(args: argparse.Namespace) -> Any:
    """``--max-running``/``--max-waiting`` as checked limits (``InvalidArgument`` naming the flag out of bounds)."""
    from kvemu.errors import InvalidArgument
    from kvemu.http.admission import AdmissionLimits

    given = {k: v for k in ("max_running", "max_waiting") if (v := getattr(args, k, None)) is not None}
    try:
        return msgspec.convert(given, AdmissionLimits)
    except msgspec.ValidationError as exc:  # "Expected `int` >= 1 - at `$.max_running`"
        what, _, where = str(exc).partition(" - at ")
        flag = where.strip("`").removeprefix("$.").replace("_", "-")
        raise InvalidArgument(f"--{flag}: {what.replace('`', '')}", field=flag) from None


def _http_flags(args: argparse.Namespace, listen: str) -> list[str]:
    """The HTTP options a child process gets to serve on ``listen``."""
    flags = ["--http", listen, "--model", args.model, "--http-server", args.http_server]
    flags += [x for k in ("max_running", "max_waiting") if (v := getattr(args, k, None)) is not None
              for x in (f"--{k.replace('_', '-')}", str(v))]
    return flags + (["--tokenizer", str(Path(args.tokenizer).resolve())] if args.tokenizer else [])


def _http_args(args: argparse.Namespace) -> list[str]:
    """The ``--http`` options to pass on to a router process."""
    return _http_flags(args, args.http) if getattr(args, "http", None) else []


def _worker_http_args(args: argparse.Namespace) -> list[str]:
    """What a worker process needs to serve its own OpenAI routes (``--worker-http``), else nothing."""
    return _http_flags(args, "127.0.0.1:0") if getattr(args, "worker_http", False) else []
