"""What the processes of a live cluster refuse before any starts, each a one-line reason (None: nothing): a bad
``--http`` or ``--tokenizer``, OpenAI routes on a disaggregated cluster, an autoscaler, a chaos timeline the load
generator cannot apply."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.scenario import Scenario

__all__ = ["autoscaler_problem", "disagg_problem", "http_problem", "loadgen_chaos_problem"]


def http_problem(args: argparse.Namespace) -> str | None:
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


def disagg_problem(args: argparse.Namespace, scenario: Scenario) -> str | None:
    """What a disaggregated cluster's processes cannot do yet (None: nothing): serve OpenAI routes at kvemu's
    front door (a prefill or decode worker's own server takes another router's legs: ``kv_handoff``)."""
    if args.command == "worker":
        return None
    if scenario.cluster.disaggregated and (getattr(args, "http", None) or getattr(args, "worker_http", False)):
        return ("the OpenAI front door (--http, --worker-http, kvemu serve) does not serve a disaggregated cluster "
                "(cluster.prefill, cluster.decode) yet: run it without them (kvemu up, or router, workers and loadgen)")
    return None


def autoscaler_problem(args: argparse.Namespace, scenario: Scenario) -> str | None:
    """Why processes cannot run this scenario's autoscaler (None: it has none, or this process does not play the
    scenario's timeline)."""
    if scenario.autoscaler is None or args.command in ("router", "worker", "front"):
        return None
    return ("autoscaler: not supported with processes (kvemu up, loadgen, serve, docker-compose): the supervisor "
            "that starts and stops worker processes sees neither the requests' latencies nor the engines' queues "
            "(they live in the load generator and the workers), and the report is the load generator's; run the "
            "scenario with kvemu run (virtual time, or --mode live) instead, or remove the autoscaler section")


def loadgen_chaos_problem(scenario: Any, chaos: str | None) -> str | None:
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
