"""``kvemu scenario show``: the resolved scenario as YAML, every default filled in, each key with its bound and
meaning read from the schema; the text loads back as the same scenario."""

import msgspec
import pytest

from harness.scenario import MAX_WORKERS, load_scenario, parse_scenario, resolve
from harness.scenario.show import show_scenario

from tests.harness.test_cli import ROOT, kvemu


def _builtins(scenario):
    out = msgspec.to_builtins(scenario)
    out.pop("base_dir")
    return out


def _line(text, key):
    return next(line for line in text.splitlines() if line.lstrip().startswith(f"{key}:"))


def test_show_prints_the_built_in_scenario_with_every_default_and_it_loads_back(tmp_path):
    shown = kvemu("scenario", "show", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    (tmp_path / "s.yaml").write_text(shown.stdout)
    assert kvemu("validate", "s.yaml", cwd=tmp_path).stdout == kvemu("validate", cwd=tmp_path).stdout
    built_in = load_scenario(ROOT / "harness" / "quickstart.yaml")
    assert _builtins(load_scenario(tmp_path / "s.yaml")) == _builtins(built_in)
    for key in ("max_num_batched_tokens", "router_ttl_secs", "drain_timeout_s", "replica_front"):  # defaults too
        assert _line(shown.stdout, key)


def test_each_key_says_its_bound_and_meaning():
    text = show_scenario(load_scenario(ROOT / "examples" / "quickstart.yaml"))
    assert _line(text, "workers").split("#", 1)[1].strip() == f"int in [1, {MAX_WORKERS}]"
    assert _line(text, "rate_rps").endswith("# number in (0, 1e+06] | New sessions per second.")
    assert "# one of hard, soft" in _line(text, "mode")
    assert "or null | Stop arrivals after this much scenario time, then drain." in _line(text, "duration_s")
    # a knob defined in another package (RouterSettings, EngineConfig) carries its own docstring there
    assert "| Re-selections after rejected dispatches" in _line(text, "retry_limit")


def test_set_is_applied_and_an_unknown_key_is_refused_as_validate_refuses_it(tmp_path):
    shown = kvemu("scenario", "show", "--set", "cluster.workers=7", cwd=tmp_path)
    assert shown.returncode == 0 and _line(shown.stdout, "workers").startswith("  workers: 7 ")
    bad = kvemu("scenario", "show", "--set", "cluster.wrokers=7", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == ""
    refused = kvemu("validate", "--set", "cluster.wrokers=7", cwd=tmp_path)
    assert bad.stderr.removeprefix("invalid scenario: ") == refused.stderr.removeprefix("invalid: ")
    assert "unknown key; did you mean cluster.workers?" in bad.stderr


@pytest.mark.parametrize("example", ["compose-disagg.yaml", "replicas-chaos.yaml", "autoscale-burst.yaml",
                                     "hybrid-sliding-window.yaml", "agentic-lanes.yaml"])
def test_every_kind_of_section_loads_back_as_the_same_scenario(example):
    scenario = load_scenario(ROOT / "examples" / example, ["run.sla={ttft_ms: 200}"])
    again = parse_scenario(show_scenario(scenario), base_dir="/elsewhere")  # (paths are shown absolute)
    a, b = _builtins(scenario), _builtins(again)
    if "trace" in a["workload"]:  # the same file, from wherever the shown text is put
        assert resolve(again, again.workload.trace) == resolve(scenario, scenario.workload.trace).resolve()
        a["workload"]["trace"] = b["workload"]["trace"]
    assert a == b
