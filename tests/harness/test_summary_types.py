"""The typed ``Summary``: read by attribute, and summary.json's content unchanged by the typing (every key, value,
int or float, null or absent, as the sections compose it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from msgspec import UNSET

from harness.report.run_data import RunData
from harness.report.summary import dumps_summary, summarize
from harness.report.summary_types import Summary

ROOT = Path(__file__).resolve().parents[2]

SCENARIOS = {
    "sla": ("examples/quickstart.yaml", ["run.sla.ttft_ms=200", "run.sla.itl_ms=40"]),
    "autoscaler": ("examples/autoscale-burst.yaml", []),
    "disaggregated": ("examples/compose-disagg.yaml", ["run.mode=virtual", "run.max_requests=60"]),
    "speculative-hybrid": ("examples/hybrid-sliding-window.yaml", [
        "run.max_requests=40", "cluster.engine.speculative={method: eagle, num_speculative_tokens: 3, "
        "acceptance_rates: [0.9, 0.7, 0.5], draft_cost: 0.1}"]),
    "replicas": ("examples/replicas-chaos.yaml", ["run.max_requests=80"]),
}
"""Runs that between them fill every optional section but the lanes (``test_lanes`` runs those)."""


def _exactly(plain: Any, typed: Any, where: str = "") -> None:
    """``typed`` is ``plain``: the same keys in the same order, the same values of the same types (1 is not 1.0)."""
    assert type(typed) is type(plain), f"{where}: {plain!r} became {typed!r}"
    if isinstance(plain, dict):
        assert list(typed) == list(plain), f"{where}: keys {list(plain)} became {list(typed)}"
        for key in plain:
            _exactly(plain[key], typed[key], f"{where}.{key}")
    elif isinstance(plain, list):
        assert len(typed) == len(plain), where
        for i, (a, b) in enumerate(zip(plain, typed)):
            _exactly(a, b, f"{where}[{i}]")
    else:
        assert typed == plain, f"{where}: {plain!r} became {typed!r}"


@pytest.fixture(scope="module")
def runs() -> dict[str, RunData]:
    from harness.run.runner import run_scenario
    from harness.scenario import load_scenario

    return {name: run_scenario(load_scenario(ROOT / path, overrides), None).data
            for name, (path, overrides) in SCENARIOS.items()}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_summary_holds_each_figure_as_its_section_declares_it(runs, name):
    """``summarize`` builds the sections directly: decoding what it wrote back into ``Summary`` changes nothing (no
    int in a float field that JSON would write as ``1``, no key the schema does not declare)."""
    summary = summarize(runs[name])
    plain = summary.to_builtins()
    again = msgspec.convert(plain, Summary)
    assert again == summary
    _exactly(plain, again.to_builtins())
    assert dumps_summary(summary) == json.dumps(plain, sort_keys=True, indent=2, allow_nan=False) + "\n"


def test_the_scenarios_fill_the_optional_sections(runs):
    k = {name: summarize(data).kvemu for name, data in runs.items()}
    assert k["sla"].sla is not UNSET and summarize(runs["sla"]).goodput_completed_requests is not UNSET
    assert k["autoscaler"].autoscaler is not UNSET
    assert k["disaggregated"].disaggregated is not UNSET and k["disaggregated"].routing.pools is not UNSET
    assert k["speculative-hybrid"].speculative is not UNSET
    assert any(r.kv_blocks_per_group is not UNSET for r in k["speculative-hybrid"].per_rank)
    assert k["replicas"].replicas is not UNSET


def test_absent_sections_are_left_out_and_empty_figures_are_null():
    summary = summarize(RunData())
    plain = summary.to_builtins()
    assert summary.kvemu.sla is UNSET and "sla" not in plain["kvemu"] and "goodput_completed_requests" not in plain
    assert summary.mean_ttft_ms is None and plain["mean_ttft_ms"] is None  # (present, null)
    assert summary.kvemu.routing.regret is None and plain["kvemu"]["routing"]["regret"] is None
    assert summary.kvemu.affinity is None and plain["kvemu"]["affinity"] is None


def test_a_key_the_summary_does_not_declare_is_refused_not_dropped():
    plain = summarize(RunData()).to_builtins()
    plain["kvemu"]["queue"]["new_figure"] = 1
    with pytest.raises(msgspec.ValidationError, match="new_figure"):
        msgspec.convert(plain, Summary)


def test_summary_json_decodes_back_into_the_same_summary(runs):
    summary = summarize(runs["disaggregated"])
    assert msgspec.json.decode(dumps_summary(summary), type=Summary) == summary


def test_reading_the_summary_as_a_dict_still_works_for_one_release_with_a_warning():
    summary = summarize(RunData())
    with pytest.warns(DeprecationWarning, match="typed Summary"):
        assert summary["kvemu"]["mode"] == "virtual"
    with pytest.warns(DeprecationWarning, match="typed Summary"):
        assert summary.get("num_requests") == 0 and summary.get("goodput_completed_requests") is None
    with pytest.warns(DeprecationWarning, match="typed Summary"):
        assert "kvemu" in summary and "goodput_completed_requests" not in summary
