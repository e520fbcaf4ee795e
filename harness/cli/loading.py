"""The scenario a command names (its file or the built-in quickstart, with --set, --mode, --seed), and its shape
in one line."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from harness.text import counted

if TYPE_CHECKING:
    from harness.scenario import RunOrigin, Scenario

__all__ = ["cluster_shape", "load_scenario_args", "run_origin"]


def _overrides(args: argparse.Namespace) -> list[str]:
    """The command's ``--set`` items, then ``--mode`` and ``--seed`` as the overrides they are."""
    overrides = list(getattr(args, "overrides", []) or [])
    if getattr(args, "mode", None):
        overrides.append(f"run.mode={args.mode}")
    if getattr(args, "seed", None) is not None:
        overrides.append(f"run.seed={args.seed}")
    return overrides


def run_origin(args: argparse.Namespace) -> RunOrigin:
    """What ``load_scenario_args`` built the command's scenario from, for its report's "What ran"."""
    from harness.scenario import RunOrigin

    command = getattr(args, "report_as", None) or f"kvemu {args.command}"  # (kvemu up's load generator says so)
    return RunOrigin.of(command, args.scenario, _overrides(args))


def load_scenario_args(args: argparse.Namespace) -> Scenario:
    from harness.memory_budget import MAX_MEMORY_ENV
    from harness.scenario import parse_scenario, scenario_text

    if getattr(args, "max_memory", None):
        os.environ[MAX_MEMORY_ENV] = args.max_memory  # the sessions' builder (and any child process) checks it

    text, base_dir, source = scenario_text(args.scenario or None)  # a YAML file, a trace .jsonl or the built-in
    scenario = parse_scenario(text, base_dir=base_dir, overrides=_overrides(args), source=source)
    from harness.run.factories import make_policy

    make_policy(scenario.router.policy)  # a custom policy must import before anything starts
    if scenario.autoscaler is not None:
        from harness.run.autoscaler import make_autoscaler

        make_autoscaler(scenario.autoscaler)  # so must a custom autoscaler
    return scenario


def cluster_shape(scenario: Scenario) -> str:
    """``4 workers × 1 DP rank``, or ``4 prefill workers × 1 + 12 decode workers × 2 DP ranks``."""
    pools = scenario.cluster.pools()
    if "aggregated" in pools:
        n, dp, _ = pools["aggregated"]
        return f"{counted(n, 'worker')} × {counted(dp, 'DP rank')}"
    last_dp = list(pools.values())[-1][1]
    return " + ".join(f"{counted(n, f'{pool} worker')} × {dp}" for pool, (n, dp, _) in pools.items()) + \
        (" DP rank" if last_dp == 1 else " DP ranks")
