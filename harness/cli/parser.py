"""The ``kvemu`` argument parser: every command, option and help text (no command runs here)."""

from __future__ import annotations

import argparse
import textwrap

from harness.router_contract import CMD_CONTRACT
from harness.workload.synthetic_trace import MAX_SYNTHETIC_ROWS

__all__ = ["build_parser", "EXAMPLES"]

EXAMPLES: dict[str, tuple[str, ...]] = {
    "": ("kvemu run                                   # the built-in quickstart; the report in out/quickstart",
         "kvemu scenario show > mine.yaml             # every knob, its default, bound and meaning",
         "kvemu COMMAND --help                        # each command's options and examples"),
    "run": ("kvemu run                                   # the built-in quickstart, in virtual time",
            "kvemu run examples/compose.yaml --set cluster.workers=8 -o out/eight",
            "kvemu run my-trace.jsonl --mode live --quiet"),
    "sweep": ("kvemu sweep examples/sweep-workers.yaml --validate",
              "kvemu sweep examples/sweep-workers.yaml --jobs 2 -o out/workers"),
    "plan": ("kvemu plan --sla ttft_ms=200,itl_ms=30",
             "kvemu plan my-trace.jsonl --goodput 0.99 --max-workers 16"),
    "validate": ("kvemu validate examples/quickstart.yaml",
                 "kvemu validate --set cluster.workers=7 --set run.duration_s=10"),
    "compare": ("kvemu run --set router.policy=round_robin -o out/rr",
                "kvemu compare out/quickstart out/rr           # B - A for every figure"),
    "router": ("kvemu router --listen tcp://127.0.0.1:5555 --config examples/compose.yaml",
               "kvemu router --config examples/compose.yaml --http 127.0.0.1:8000"),
    "front": ("kvemu front --router tcp://127.0.0.1:5555 --router tcp://127.0.0.1:5556 "
              "--config examples/replicas-chaos.yaml",
              "kvemu front --router tcp://127.0.0.1:5555 --http 127.0.0.1:8000"),
    "worker": ("kvemu worker --router tcp://127.0.0.1:5555 --config examples/compose.yaml --worker-id 0",
               "kvemu worker --http 127.0.0.1:9000 --config examples/compose.yaml"),
    "loadgen": ("kvemu loadgen examples/compose.yaml --router tcp://127.0.0.1:5555 --expect-workers 3 -o out/live",
                "kvemu loadgen examples/compose.yaml --http http://127.0.0.1:8000 -o out/http"),
    "up": ("kvemu up                                    # the built-in quickstart as processes",
           "kvemu up examples/compose.yaml --http 127.0.0.1:8000 -o out/up"),
    "serve": ("kvemu serve                                 # an OpenAI API at http://127.0.0.1:8000/v1",
              "kvemu serve examples/compose.yaml --worker-http"),
    "fleet": ("kvemu fleet --print-flags vllm-router",
              "kvemu fleet examples/compose.yaml --processes"),
    "bench-router": ("kvemu bench-router --router kvemu --router vllm-router:kv_aware --compress 10",
                     "kvemu bench-router --router 'cmd:python my_proxy.py --port {port} {workers}'"),
    "trace": ("kvemu trace validate my-trace.jsonl",
              "kvemu trace convert my-trace.jsonl out.jsonl --to mooncake-delta",
              "kvemu trace synth standin.jsonl --rows 3000"),
    "trace validate": ("kvemu trace validate my-trace.jsonl",
                       "kvemu trace validate corpus/ --from weka"),
    "trace synth": ("kvemu trace synth standin.jsonl --rows 3000",
                    "kvemu trace synth mooncake-standin.jsonl --rows 12031 --seed 1   # as many rows as the real one"),
    "trace convert": ("kvemu trace convert my-trace.jsonl out.jsonl --to mooncake-delta",
                      "kvemu trace convert agentic.jsonl flat.jsonl --to mooncake --allow-lossy"),
    "scenario": ("kvemu scenario show", "kvemu scenario show examples/compose.yaml --set cluster.workers=8"),
    "scenario show": ("kvemu scenario show                         # the built-in default, every knob",
                      "kvemu scenario show examples/compose.yaml --set cluster.workers=8 > mine.yaml",
                      "kvemu run mine.yaml                         # runs what it printed"),
    "tokenizer": ("kvemu tokenizer export tok/", "kvemu serve --tokenizer tok/"),
    "tokenizer export": ("kvemu tokenizer export tok/",
                         "kvemu serve --tokenizer tok/                # clients load the same tokenizer"),
    "demo": ("kvemu demo", "kvemu demo --workers 8 --sessions 20 --seed 1"),
}
"""Every command's examples, shown at the end of its ``--help`` (keyed by the command's words after ``kvemu``)."""


def _add_set(parser: argparse.ArgumentParser,
            text: str = "override a scenario value, e.g. --set cluster.workers=8 (repeatable; a relative path is "
                        "from the working directory)") -> None:
    """The ``--set KEY.PATH=VALUE`` option, said once for every command that reads a scenario."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE", help=text)


def _add_max_memory(parser: argparse.ArgumentParser) -> None:
    """``--max-memory SIZE``: the bound a run's estimated memory must fit (as well as the memory available)."""
    from harness.memory_budget import MAX_MEMORY_ENV

    def size(text: str) -> str:
        from harness.memory_budget import parse_size

        try:
            parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    parser.add_argument("--max-memory", type=size, metavar="SIZE",
                        help=f"refuse a run estimated to need more memory than SIZE (8G, 512M; also {MAX_MEMORY_ENV}); "
                             "the memory available bounds it too")


def _add_http(parser: argparse.ArgumentParser, default: str | None) -> None:
    """The options of the OpenAI front door a process serves (``--http`` and what it serves with)."""
    parser.add_argument("--http", default=default, metavar="HOST:PORT",
                        help="serve the OpenAI-compatible front door there (port 0: pick a free one)")
    _add_serving(parser)


def _add_serving(parser: argparse.ArgumentParser) -> None:
    """How an OpenAI server serves: its tokenizer, model name and HTTP server."""
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="a local tokenizer.json (or a directory with one); default: kvemu's built-in tokenizer")
    parser.add_argument("--model", default="kvemu", help="the model name clients use (default: kvemu)")
    parser.add_argument("--http-server", choices=["uvicorn", "granian"], default="uvicorn",
                        help="the HTTP server (granian: pip install 'kvemu[granian]')")
    parser.add_argument("--max-running", type=int, metavar="N",
                        help="generation requests served at once (1..65536, default 256); more wait")
    parser.add_argument("--max-waiting", type=int, metavar="N",
                        help="requests waiting for a slot (0..65536, default 256); more get 429 with Retry-After")


def _add_force(parser: argparse.ArgumentParser, what: str = "the report") -> None:
    """``--force``: write into an -o OUTDIR that holds other files (``claim_outdir`` refuses it otherwise)."""
    parser.add_argument("--force", action="store_true",
                        help=f"write {what} into an OUTDIR that is not empty and holds no earlier kvemu report")


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    run = sub.add_parser("run", help="run a scenario (default: the built-in quickstart) and write a report")
    run.add_argument("scenario", nargs="?", help="scenario YAML or a trace .jsonl (omit for the built-in default)")
    _add_set(run)
    run.add_argument("-o", "--outdir", help="report directory (default: out/<scenario name>)")
    _add_force(run)
    run.add_argument("--mode", choices=("virtual", "live"), help="override run.mode")
    run.add_argument("--seed", type=int, help="override run.seed")
    run.add_argument("--quiet", action="store_true", help="no progress bar, and no summary table at the end")
    run.add_argument("--plots", choices=("auto", "wait", "background"), default="auto",
                     help="wait for the report's plots before ending, or leave them drawing in the background "
                          "(each appears whole when drawn); auto (default): background when stderr is a terminal")
    _add_max_memory(run)
    return run


def _add_sweep(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
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


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    plan = sub.add_parser("plan", help="find the smallest cluster that meets an SLA at a goodput target (a search, "
                                       "in parallel); writes plan.md, plan.json and plan.png")
    plan.add_argument("scenario", nargs="?", help="scenario YAML or a trace .jsonl (default: the built-in "
                                                  "quickstart)")
    plan.add_argument("--sla", help="ttft_ms=MS,itl_ms=MS or e2e_ms=MS (default: the scenario's run.sla)")
    plan.add_argument("--goodput", type=float, default=0.95,
                      help="share of requests that must meet the SLA, in (0, 1] (default 0.95)")
    plan.add_argument("--min-workers", type=int, default=1, help="smallest cluster to consider (default 1)")
    plan.add_argument("--max-workers", type=int, default=32, help="largest cluster to consider (default 32)")
    plan.add_argument("--seeds", type=int, default=1, help="seeds per probe; a size passes when every seed does")
    _add_set(plan)
    plan.add_argument("-o", "--outdir", help="output directory (default: out/plan-<scenario name>)")
    _add_force(plan, "the plan")
    plan.add_argument("--jobs", type=int, help="local worker processes, and probes per round (default: CPU count)")
    plan.add_argument("--address", help="tcp://HOST:PORT (Dask) or ray://HOST:PORT | auto (Ray), as for sweep")
    plan.add_argument("--width", type=int, help="probes per round (default: --jobs, or 4 on Dask/Ray)")
    return plan


def _synth_rows(text: str) -> int:
    """``--rows N`` of ``kvemu trace synth``: a whole number within 1 .. ``MAX_SYNTHETIC_ROWS``."""
    try:
        rows = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= rows <= MAX_SYNTHETIC_ROWS:
        raise argparse.ArgumentTypeError(f"{rows} is outside 1 .. {MAX_SYNTHETIC_ROWS:,}")
    return rows


def _add_trace(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``kvemu trace validate``, ``kvemu trace convert`` and ``kvemu trace synth``."""
    from harness.workload.traces.names import FORMATS, WRITABLE

    trace = sub.add_parser("trace", help="check a trace file, convert it to another format, or generate one "
                                        "(docs/traces.md)")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True, metavar="COMMAND", help="what to do")
    validate = trace_sub.add_parser("validate", help="read a trace and print its requests, edges, sessions, plays")
    validate.add_argument("input", metavar="FILE", help="the trace (a file; a directory for weka)")
    convert = trace_sub.add_parser("convert", help="write a trace as another format (refused where that would "
                                                   "change its replay, unless --allow-lossy)")
    convert.add_argument("input", metavar="IN", help="the trace to read")
    convert.add_argument("output", metavar="OUT", help="the file to write")
    convert.add_argument("--to", required=True, choices=WRITABLE, help="the format to write")
    convert.add_argument("--allow-lossy", action="store_true",
                         help="write even where the target cannot hold every edge, trigger or delay (Mooncake: "
                              "sessions become chains); prints what was dropped")
    synth = trace_sub.add_parser("synth", help="write a generated trace in the Mooncake format, shaped like its "
                                               "one-hour conversation trace (a stand-in where that is missing)")
    synth.add_argument("output", metavar="OUT", help="the .jsonl file to write (refused if it exists, unless --force)")
    synth.add_argument("--rows", type=_synth_rows, required=True, metavar="N",
                       help=f"rows to write (1 .. {MAX_SYNTHETIC_ROWS:,}; the real trace has 12,031, about an hour "
                            "of arrivals)")
    synth.add_argument("--seed", type=int, default=0, metavar="S", help="the same seed writes the same bytes "
                                                                         "(default 0)")
    synth.add_argument("--force", action="store_true", help="write over an existing OUT")
    for command in (validate, convert):
        command.add_argument("--from", dest="from_format", default="auto", choices=("auto", *FORMATS),
                             help="the input's format (default: detected from the file where unambiguous)")
        command.add_argument("--block-size", type=int, metavar="N",
                             help="tokens per hash id (default: the file's own, or 512 where the format has none)")


def _add_scenario(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``kvemu scenario show``: a resolved scenario, every key with its default, bound and meaning."""
    scenario = sub.add_parser("scenario", help="print a scenario resolved: every key, its value, bound and meaning")
    scenario_sub = scenario.add_subparsers(dest="scenario_command", required=True, metavar="COMMAND",
                                           help="what to do")
    show = scenario_sub.add_parser("show", help="print the scenario as YAML with every default filled in, each key "
                                                "followed by its bound and meaning (kvemu run takes the output)")
    show.add_argument("scenario", nargs="?", metavar="FILE",
                      help="scenario YAML or a trace .jsonl (omit for the built-in default)")
    _add_set(show)


def _add_examples(parser: argparse.ArgumentParser, path: str) -> None:
    """End the help of ``parser`` (the command ``kvemu PATH``) and of each of its subcommands with its ``EXAMPLES``
    (after any epilog it has, wrapped), as written."""
    text = textwrap.fill(parser.epilog, 100) + "\n\n" if parser.epilog else ""
    parser.epilog = text + "examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[path])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                _add_examples(child, f"{path} {name}".strip())


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


class _VersionAction(argparse.Action):
    """``--version``: the version is looked up only when asked (``importlib.metadata`` costs ~20 ms, and every
    ``kvemu`` command built this parser)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, default: str = argparse.SUPPRESS,
                 help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"kvemu {_version()} ({_build_name()} build)")  # (stdout, as argparse's own version action)
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The ``kvemu`` argument parser: every subcommand and option, each with its help."""
    parser = argparse.ArgumentParser(prog="kvemu", description="Emulator of KV-cache-aware LLM serving clusters.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the version and the build (compiled or pure Python)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", help="what to do (none: this help)")
    run_parser = _add_run(sub)
    sweep_parser = _add_sweep(sub)
    _add_plan(sub)
    validate = sub.add_parser("validate", help="check a scenario without running it")
    validate.add_argument("scenario", nargs="?", help="scenario YAML or a trace .jsonl (omit for the built-in default)")
    _add_set(validate)
    _add_max_memory(validate)
    compare = sub.add_parser("compare", help="print two reports' summaries side by side with deltas")
    compare.add_argument("a", help="the first report directory (A: has summary.json)")
    compare.add_argument("b", help="the second report directory (B: deltas are B - A)")
    router = sub.add_parser("router", help="run a router process (workers and load generators connect to it)")
    router.add_argument("--listen", default="tcp://127.0.0.1:5555", help="ROUTER endpoint for workers and clients")
    router.add_argument("--config", dest="scenario", help="scenario YAML for the router and engine settings")
    _add_set(router)
    router.add_argument("--grace", type=float, default=10.0, help="seconds to drain requests on SIGTERM")
    router.add_argument("--replica", type=int, default=0, metavar="I",
                        help="with router.replicas: which replica this router is (0 .. replicas-1; default 0)")
    router.add_argument("--sync-listen", default="tcp://127.0.0.1:0", metavar="ENDPOINT",
                        help="with router.replica_sync: PUB endpoint of this replica's sync batches (port 0 = a free "
                             "one, printed at start)")
    router.add_argument("--sync-peer", action="append", default=[], metavar="I=ENDPOINT",
                        help="with router.replica_sync: replica I's --sync-listen endpoint, to subscribe to "
                             "(repeat per peer)")
    front = sub.add_parser("front", help="run an OpenAI front door that spreads requests over router processes "
                                         "(router.replicas), as kvemu up --http and kvemu serve start it")
    front.add_argument("--router", action="append", required=True,
                       help="a router replica's --listen endpoint; repeat it for each replica, in replica order "
                            "(requests are spread by router.replica_front)")
    front.add_argument("--config", dest="scenario", help="scenario YAML (its router replicas and engine settings)")
    _add_set(front)
    front.add_argument("--grace", type=float, default=10.0, help="seconds open requests get to end on SIGTERM")
    _add_http(front, "127.0.0.1:8000")
    worker = sub.add_parser("worker", help="run a mock worker process with its DP ranks")
    worker.add_argument("--router", action="append",
                        help="the router's --listen endpoint (none: serve --http clients alone, as a member of "
                             "kvemu fleet with another router in front); repeat it for each router replica")
    worker.add_argument("--worker-id", type=int, help="default: random")
    worker.add_argument("--dp-size", type=int, help="default: the scenario's cluster.dp_size (or its pool's)")
    worker.add_argument("--worker-type", choices=("aggregated", "prefill", "decode"),
                        help="the pool this worker serves, with that pool's engine and DP size: required for a "
                             "disaggregated scenario (prefill or decode); default: aggregated")
    worker.add_argument("--kv-events", default="tcp://127.0.0.1:0",
                        help="PUB endpoint of rank 0 (rank r uses port + r; port 0 = pick one per rank)")
    worker.add_argument("--kv-replay", default="tcp://127.0.0.1:0", help="replay ROUTER endpoint ('' to disable)")
    worker.add_argument("--config", dest="scenario", help="scenario YAML for the engine settings: the router's "
                                                         "(the router refuses a worker whose engine differs)")
    _add_set(worker)
    worker.add_argument("--own-engine", action="store_true",
                        help="register although this worker's engine differs from the router's scenario, on "
                             "purpose (a straggler, a test); the router logs the knobs that differ")
    worker.add_argument("--grace", type=float, default=10.0, help="seconds to finish requests on SIGTERM")
    _add_http(worker, None)
    loadgen = sub.add_parser("loadgen", help="play a scenario's workload against a router process")
    loadgen.add_argument("scenario", nargs="?",
                         help="scenario YAML or a trace .jsonl (default: the built-in quickstart)")
    loadgen.add_argument("--config", dest="config_path", help="same as the positional scenario")
    loadgen.add_argument("--router", action="append",
                         help="the router's --listen endpoint (a kvemu router process); repeat it for each router "
                              "replica, in replica order (requests are spread by router.replica_front)")
    loadgen.add_argument("--http", metavar="URL", dest="http_url",
                         help="instead of --router: any OpenAI-compatible server (a router in front of a kvemu "
                              "fleet), sent streamed /v1/completions with X-Request-Id and session headers")
    loadgen.add_argument("--fleet", metavar="FILE",
                         help="with --http: kvemu fleet's start line (a file, or - for standard input), so the "
                              "report has what each engine really did (worker, rank, cached tokens)")
    loadgen.add_argument("--prompt", choices=["text", "tokens"], default="text",
                         help="with --http: prompts as text the fleet's tokenizer maps back to the workload's ids "
                              "(default; routers that hash text need it) or as token-id lists")
    loadgen.add_argument("--tokenizer", metavar="PATH",
                         help="with --http: the fleet's tokenizer.json (default: kvemu's built-in tokenizer)")
    loadgen.add_argument("--model", default="kvemu", help="with --http: the model name (default: kvemu)")
    loadgen.add_argument("-o", "--outdir", help="report directory (default: out/<scenario name>)")
    _add_force(loadgen)
    loadgen.add_argument("--expect-workers", type=int, help="wait until this many workers are registered")
    loadgen.add_argument("--router-pid", type=int, action="append",
                         help="the router's process id on this machine: a silent router whose process is alive is "
                              "waited for (run.router_stall_s), one whose process exited is lost at once (repeat "
                              "it per --router)")
    loadgen.add_argument("--chaos", choices=["apply", "skip"],
                         help="a scenario with a chaos timeline: apply it through the router's control channel "
                              "(needs KVEMU_CONTROL_TOKEN, as the router has) or skip it (kvemu up applies it)")
    _add_set(loadgen)
    loadgen.add_argument("--report-as", default="kvemu loadgen", help=argparse.SUPPRESS)  # kvemu up's own title
    _add_http(router, None)
    up = sub.add_parser("up", help="router + workers + load generator as processes on 127.0.0.1, then a report")
    up.add_argument("scenario", nargs="?", help="scenario YAML or a trace .jsonl (default: the built-in quickstart)")
    _add_set(up)
    up.add_argument("-o", "--outdir", help="report directory (default: out/<scenario name>)")
    _add_force(up)
    _add_http(up, None)
    serve = sub.add_parser("serve", help="router with its OpenAI front door + workers as processes, until Ctrl-C")
    serve.add_argument("scenario", nargs="?", help="scenario YAML for the cluster (default: the built-in quickstart)")
    _add_set(serve)
    _add_http(serve, "127.0.0.1:8000")
    serve.add_argument("--in-process", action="store_true",
                       help="router, workers and front door in this one process (no --worker-http); the front door "
                            "also serves the engines' truth at /kvemu/requests")
    for command in (loadgen, up):
        command.add_argument("--quiet", action="store_true", help="no summary table at the end")
    for command in (up, serve):
        command.add_argument("--worker-http", action="store_true",
                             help="every worker also serves the OpenAI routes for its own ranks, with vLLM's metrics "
                                  "(on a free 127.0.0.1 port each; printed at start)")
    fleet = sub.add_parser("fleet", help="the scenario's workers with no kvemu router (HTTP, KV events and replay "
                                         "per rank), for any router to sit in front; prints where they are")
    fleet.add_argument("scenario", nargs="?", help="scenario YAML or a trace .jsonl (default: the built-in quickstart)")
    _add_set(fleet)
    fleet.add_argument("--print-flags", choices=["vllm-router", "sglang-router"],
                       help="also print the arguments that router takes for this fleet (a second line)")
    fleet.add_argument("--processes", action="store_true",
                       help="one process per worker (default: every worker in this process)")
    _add_serving(fleet)
    bench = sub.add_parser("bench-router", help="the scenario's workload through each --router in front of a fresh "
                                                "fleet; writes routers.md, routers.json and routers.png",
                           epilog=CMD_CONTRACT)
    bench.add_argument("scenario", nargs="?", help="scenario YAML or a trace .jsonl (default: the built-in quickstart)")
    _add_set(bench)
    bench.add_argument("--router", dest="routers", action="append", default=[], metavar="ROUTER",
                       help="kvemu, vllm-router[:POLICY], sglang-router[:POLICY] or 'cmd:COMMAND WITH {flags} {port}' "
                            "(repeatable; default: kvemu, vllm-router:kv_aware, vllm-router:cache_aware, "
                            "vllm-router:round_robin, sglang-router:cache_aware)")
    bench.add_argument("-o", "--outdir", help="where the reports go (default: out/<scenario name>-routers)")
    _add_force(bench, "the reports")
    bench.add_argument("--compress", type=float, default=1.0,
                       help="run arrivals and engine passes this many times faster; latencies are reported scaled "
                            "back (default 1)")
    bench.add_argument("--prompt", choices=["auto", "text", "tokens"], default="auto",
                       help="prompts as token-id lists where the router takes them (kvemu, vllm-router) and text "
                            "the fleet's tokenizer maps back to those ids elsewhere (auto, the default), or all "
                            "as text, or all as token ids")
    bench.add_argument("--quiet", action="store_true", help="no summary table at the end")
    _add_trace(sub)
    _add_scenario(sub)
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
    _add_examples(parser, "")
    for command in (run_parser, sweep_parser, validate, router, worker, loadgen, up, serve, fleet, bench):
        command.add_argument("--allow-local-policies", action="store_true",
                             help="put the working directory on the import path for router.policy and "
                                  "autoscaler.policy modules (a scenario can run code)")
    return parser
