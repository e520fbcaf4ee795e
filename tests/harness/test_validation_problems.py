"""Scenario validation reports every problem of a file in one go (issue #44, item 9), each as a single problem is
reported (key path, line, "did you mean", the kind hints), at most ``MAX_LISTED_PROBLEMS`` of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.scenario import (
    Scenario,
    ScenarioError,
    default_scenario_text,
    describe_validation_error,
    parse_scenario,
)
from harness.yaml_validation import MAX_LISTED_PROBLEMS, load_yaml

ROOT = Path(__file__).resolve().parents[2]


def error_of(text: str, **kwargs) -> ScenarioError:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(text, source="s.yaml", **kwargs)
    return info.value


def test_problems_in_several_sections_are_all_reported_each_with_its_line():
    text = ("name: x\n"
            "cluster:\n"
            "  workers: 0\n"
            "router:\n"
            "  policy: kv\n"
            "  replicas: 0\n"
            "run:\n"
            "  mode: warp\n"
            "chaos:\n"
            "  - {at_s: -1, action: add_worker}\n")
    exc = error_of(text)
    assert str(exc) == ("s.yaml: 4 problems\n"
                        "  cluster.workers (line 3): Expected `int` >= 1, got 0\n"
                        "  router.replicas (line 6): Expected `int` >= 1, got 0\n"
                        "  run.mode (line 8): Invalid enum value 'warp', got 'warp'\n"
                        "  chaos[0].at_s (line 10): Expected `float` >= 0.0, got -1")
    assert exc.problems is not None and [p.key for p in exc.problems] == \
        ["cluster.workers", "router.replicas", "run.mode", "chaos[0].at_s"]


def test_an_unknown_key_and_a_bad_value_in_one_section_are_both_reported():
    exc = error_of("router:\n  polcy: kv\n  replicas: 0\n")
    assert str(exc) == ("s.yaml: 2 problems\n"
                        "  router.polcy (line 2): unknown key; did you mean router.policy?\n"
                        "  router.replicas (line 3): Expected `int` >= 1, got 0")


def test_values_given_with_set_are_listed_as_from_set_among_the_files_problems():
    exc = error_of("name: x\nrun:\n  mode: warp\n", overrides=["cluster.workers=0", "router.replicas=0"])
    assert str(exc) == ("s.yaml: 3 problems\n"
                        "  run.mode (line 3): Invalid enum value 'warp', got 'warp'\n"
                        "  cluster.workers (from --set): Expected `int` >= 1, got 0\n"
                        "  router.replicas (from --set): Expected `int` >= 1, got 0")


def test_the_kind_hints_and_the_sections_own_checks_are_listed_with_the_rest(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps({"timestamp": 0, "input_length": 4, "output_length": 1,
                                                  "hash_ids": [1]}) + "\n")
    text = ("workload:\n  kind: trace\n  trace: t.jsonl\n  turns: 3\n"  # a synthetic workload's key
            "cluster:\n  prefill: {workers: 1}\n"  # the cluster's own check: both pools or none
            "run:\n  seed: x\n")
    assert str(error_of(text, base_dir=tmp_path)) == (
        "s.yaml: 3 problems\n"
        "  workload.turns (line 4): belongs to workload.kind=synthetic; with workload.kind=trace, remove it\n"
        "  cluster.decode (line 5): a disaggregated cluster needs both pools: give cluster.prefill and "
        "cluster.decode\n"
        "  run.seed (line 8): expected an integer, got 'x'")


def test_keys_of_another_workload_kind_say_what_to_do_once():
    exc = error_of(default_scenario_text(), overrides=["workload.kind=trace"])
    lines = str(exc).split("\n")
    assert lines[:3] == [
        "s.yaml: 9 problems",
        "  workload.rate_rps (line 16): belongs to workload.kind=synthetic; with workload.kind=trace, remove it "
        "(--set cannot remove a key: write the scenario to a file without it) and set workload.trace; or give the "
        "trace itself as the scenario: kvemu run TRACE.jsonl",
        "  workload.turns (line 17): belongs to workload.kind=synthetic too"]
    assert lines[-1] == "  workload (line 14): Object missing required field `trace`"


def test_a_missing_trace_and_the_disaggregated_pool_keys_are_reported_with_the_schemas_problems(tmp_path):
    text = ("workload:\n  kind: trace\n  trace: nowhere.jsonl\n"
            "cluster:\n  workers: 2\n  dp_size: 1\n  prefill: {workers: 1}\n  decode: {workers: 1}\n"
            "router:\n  replicas: 0\n")
    exc = error_of(text, base_dir=tmp_path)
    lines = str(exc).split("\n")
    assert lines[:4] == [
        "s.yaml: 4 problems",
        "  cluster.workers (line 5): a disaggregated cluster sizes each pool: set cluster.prefill.workers and "
        "cluster.decode.workers instead",
        "  cluster.dp_size (line 6): a disaggregated cluster sizes each pool: set cluster.prefill.dp_size and "
        "cluster.decode.dp_size instead",
        "  router.replicas (line 10): Expected `int` >= 1, got 0"]
    assert lines[4].startswith(f"  workload.trace (line 3): file not found: {tmp_path / 'nowhere.jsonl'}")


def test_a_list_past_the_cap_names_the_first_problems_and_counts_the_rest():
    items = 3 * MAX_LISTED_PROBLEMS
    exc = error_of("cluster:\n  workers: 2\n  prefill: {workers: 1}\n  decode: {workers: 1}\nchaos:\n"
                   + "  - {at_s: -1, action: add_worker}\n" * items)
    lines = str(exc).split("\n")
    assert lines[0] == f"s.yaml: {items + 1} problems"
    assert lines[1].startswith("  cluster.workers (line 2): a disaggregated cluster sizes each pool")
    assert lines[2:-1] == [f"  chaos[{i}].at_s (line {i + 6}): Expected `float` >= 0.0, got -1"
                           for i in range(MAX_LISTED_PROBLEMS - 1)]
    assert lines[-1] == f"  and {items + 1 - MAX_LISTED_PROBLEMS} more"
    assert exc.problems is not None and len(exc.problems) == MAX_LISTED_PROBLEMS


def test_kvemu_validate_prints_every_problem(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: x\nworkload:\n  kind: synthetic\n  rate_rps: -1\n  bogus: 3\n"
                                       "cluster:\n  workers: 0\n")
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "validate", "bad.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert proc.stderr == ("invalid: bad.yaml: 3 problems\n"
                           "  workload.rate_rps (line 4): Expected `float` > 0.0, got -1\n"
                           "  workload.bogus (line 5): unknown key (check its spelling and section)\n"
                           "  cluster.workers (line 7): Expected `int` >= 1, got 0\n")


# ------------------------------------------------------------------- any set of independent problems

BAD_KEYS: dict[str, str] = {
    "name": "[1]",
    "cluster.workers": "0",
    "cluster.dp_size": "0",
    "cluster.nonsense": "1",
    "cluster.engine.nonsense": "1",
    "router.replicas": "0",
    "router.polcy": "kv",
    "router.affinity.ttl_secs": "0",
    "workload.rate_rps": "-1",
    "workload.turns": "0",
    "workload.isl.std": "-1",
    "run.seed": "x",
    "run.mode": "warp",
    "chaos[0].at_s": "{at_s: -1, action: add_worker}",
    "chaos[1].action": "{at_s: 1, action: explode}",
    "autoscaler.interval_s": "0",
    "autoscaler": "",  # max_workers, which it requires, left out
}
"""Key paths that each hold one problem when given this value, whatever else is wrong, in file order."""


def bad_scenario(keys: set[str]) -> tuple[str, dict[str, int]]:
    """A scenario with the problems at ``keys`` (of ``BAD_KEYS``), and the line each is reported at."""
    lines: list[str] = []
    where: dict[str, int] = {}
    opened: set[str] = set()

    def open_(path: str, indent: int) -> None:
        if path not in opened:
            opened.add(path)
            lines.append(" " * indent + path.rsplit(".", 1)[-1] + ":")
            where[path] = len(lines)
            if path == "workload":
                lines.append("  kind: synthetic")

    chaos = any(key.startswith("chaos") for key in keys)
    for key in BAD_KEYS:
        if key.startswith("chaos"):  # both items when either is chosen, a good one in place of the other
            if chaos:
                open_("chaos", 0)
                lines.append("  - " + (BAD_KEYS[key] if key in keys else "{at_s: 1, action: add_worker}"))
                where[key] = len(lines)
        elif key not in keys:
            continue
        elif key == "name":
            lines.append(f"name: {BAD_KEYS[key]}")
            where[key] = len(lines)
        elif key == "autoscaler":
            open_("autoscaler", 0)
            lines.append("  graceful: true")
        else:
            parts = key.split(".")
            for depth in range(1, len(parts)):
                open_(".".join(parts[:depth]), 2 * (depth - 1))
            if parts[0] == "autoscaler" and "autoscaler" not in keys:
                lines.append("  max_workers: 8")
            lines.append(" " * (2 * (len(parts) - 1)) + f"{parts[-1]}: {BAD_KEYS[key]}")
            where[key] = len(lines)
    return "".join(line + "\n" for line in lines), {k: where[k] for k in BAD_KEYS if k in keys}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sets(st.sampled_from(sorted(BAD_KEYS)), min_size=1))
def test_every_injected_problem_is_reported_once_at_its_line_and_the_first_is_msgspecs(keys):
    text, expected = bad_scenario(keys)
    exc = error_of(text)
    assert exc.problems is not None
    assert [(p.key, p.at) for p in exc.problems] == [(k, f" (line {n})") for k, n in expected.items()], text
    message = str(exc)
    if len(keys) == 1:  # one problem reads as it always has: one line
        assert message == f"s.yaml: {exc.problems[0]}"
    else:
        assert message.split("\n")[0] == f"s.yaml: {len(keys)} problems"
    document = load_yaml(text, "s.yaml")
    with pytest.raises(msgspec.ValidationError) as first:  # the problem msgspec meets first is listed first
        msgspec.convert(document.data, Scenario, strict=True)
    assert describe_validation_error(first.value, document.data, document.node, "s.yaml", schema=Scenario) == \
        f"s.yaml: {exc.problems[0]}"
