"""Scenario files: validation errors name the key path and its line, ``--set`` overrides, the examples."""

import json
import re
from pathlib import Path

import pytest

from harness.scenario import (
    Scenario,
    ScenarioError,
    SyntheticWorkload,
    TraceWorkload,
    apply_overrides,
    default_scenario_text,
    load_scenario,
    parse_scenario,
    resolve,
)
from harness import scenario as scenario_module
from harness.workload.build import build_sessions

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml") if not p.name.startswith("sweep-"))
"""Example scenarios (``sweep-*.yaml`` are sweep files: tests/harness/test_sweep_cli.py checks them)."""


def error_of(text: str, **kwargs) -> str:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(text, source="s.yaml", **kwargs)
    return str(info.value)


def write_trace(path: Path, rows: int = 3) -> Path:
    path.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 40, "output_length": 2,
                                        "hash_ids": [1, 2 + i]}) + "\n" for i in range(rows)))
    return path


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        ("name: x\nbogus: 1\n", "bogus", 2),
        ("cluster:\n  workers: 2\n  wrokers: 3\n", "cluster.wrokers", 3),
        ("cluster:\n  workers: 2\n  engine:\n    block_sz: 16\n", "cluster.engine.block_sz", 4),
        ("router:\n  affinity:\n    enabled: true\n    ttl: 5\n", "router.affinity.ttl", 4),
        ("workload:\n  kind: synthetic\n  rate: 3\n", "workload.rate", 3),
        ("run:\n  seed: 1\n  mode_: live\n", "run.mode_", 3),
        ("chaos:\n  - at_s: 1\n    action: add_worker\n  - at_s: 2\n    acton: add_worker\n", "chaos[1].acton", 5),
    ],
)
def test_unknown_keys_name_the_key_path_and_line(text, key, line):
    msg = error_of(text)
    assert msg.startswith("s.yaml: ")
    assert f"{key} (line {line}): unknown key" in msg


@pytest.mark.parametrize(
    ("text", "key", "line", "expected"),
    [
        ("cluster:\n  workers: two\n", "cluster.workers", 2, "expected an integer, got 'two'"),
        ("cluster:\n  engine:\n    enable_prefix_caching: maybe\n", "cluster.engine.enable_prefix_caching", 3,
         "expected true or false, got 'maybe'"),
        ("run:\n  seed: 1.5\n", "run.seed", 2, "expected an integer, got 1.5"),
        ("router:\n  affinity:\n    mode: sticky\n", "router.affinity.mode", 3, "Invalid enum value 'sticky'"),
        ("workload:\n  kind: weird\n", "workload.kind", 2, "Invalid value 'weird'"),
        ("chaos:\n  - at_s: 1\n    action: explode\n", "chaos[0].action", 3, "Invalid enum value 'explode'"),
        ("cluster:\n  kv_events_hash_form: hex\n", "cluster.kv_events_hash_form", 2, "Invalid enum value 'hex'"),
        ("cluster: 4\n", "cluster", 1, "expected a mapping of keys, got 4"),
    ],
)
def test_wrong_types_name_the_key_path_and_line(text, key, line, expected):
    msg = error_of(text)
    assert f"{key} (line {line}): {expected}" in msg


@pytest.mark.parametrize(
    ("text", "key", "line", "expected"),
    [
        ("cluster:\n  workers: 0\n", "cluster.workers", 2, "Expected `int` >= 1, got 0"),
        ("cluster:\n  workers: 2\n  dp_size: -1\n", "cluster.dp_size", 3, "Expected `int` >= 1, got -1"),
        ("workload:\n  kind: synthetic\n  rate_rps: -1\n", "workload.rate_rps", 3, "Expected `float` > 0.0, got -1"),
        ("workload:\n  turns: 0\n", "workload.turns", 2, "Expected `int` >= 1, got 0"),
        ("workload:\n  pin_fraction: 1.5\n", "workload.pin_fraction", 2, "Expected `float` <= 1.0, got 1.5"),
        ("run:\n  duration_s: 0\n", "run.duration_s", 2, "Expected `float` > 0.0, got 0"),
        ("run:\n  max_requests: 0\n", "run.max_requests", 2, "Expected `int` >= 1, got 0"),
        ("router:\n  policy: fastest\n", "router.policy", 2, "got 'fastest'"),
        ("router:\n  network_latency_ms: -2\n", "router.network_latency_ms", 2, "Expected `float` >= 0.0, got -2"),
        ("chaos:\n  - at_s: 1\n    action: add_worker\n  - at_s: -1\n    action: add_worker\n", "chaos[1].at_s", 4,
         "Expected `float` >= 0.0, got -1"),
        ("router:\n  router_ttl_secs: .inf\n", "router.router_ttl_secs", 2,
         "Expected `float` <= 100000000000.0, got inf"),
        # every knob has an upper bound too (#43): absurd values are refused, naming the key
        ("router:\n  overlap_score_credit: 1e300\n", "router.overlap_score_credit", 2,
         "Expected `float` <= 1000000.0, got 1e+300"),
        ("router:\n  dispatch_timeout_s: 1e12\n", "router.dispatch_timeout_s", 2, "Expected `float` <= 100000000000.0"),
        ("cluster:\n  engine:\n    num_gpu_blocks: 10000000000000\n", "cluster.engine.num_gpu_blocks", 3,
         "Expected `int` <= 4294967296, got 10000000000000"),
        ("cluster:\n  engine:\n    speedup_ratio: 1e9\n", "cluster.engine.speedup_ratio", 3,
         "Expected `float` <= 1000000.0"),
        ("cluster:\n  engine:\n    speculative: {method: mtp, num_speculative_tokens: 2, acceptance_rates: ["
         + ", ".join(["0.5"] * 17) + "]}\n", "cluster.engine.speculative.acceptance_rates", 3,
         "Expected `array` of length <= 16"),
        ("run:\n  seed: 18446744073709551616\n", "run.seed", 2, "Expected `int` <= 9223372036854775807"),
        ("router:\n  policy: " + "m" * 5000 + ":f\n", "router.policy", 2, "Expected `str` of length <= 4096"),
        ("chaos:\n  - {at_s: 1, action: kill_rank, worker: 3000000000}\n", "chaos[0].worker", 2,
         "Expected `int` <= 2147483647, got 3000000000"),
        ("router:\n  router_prune_target_ratio: 1.5\n", "router.router_prune_target_ratio", 2,
         "Expected `float` <= 1.0, got 1.5"),
        ("router:\n  router_queue_policy: sjf\n", "router.router_queue_policy", 2, "Invalid enum value 'sjf'"),
        ("cluster:\n  engine:\n    max_num_seqs: 16\n    max_num_batched_tokens: 8\n",
         "cluster.engine.max_num_batched_tokens", 4, "(8) must be >= max_num_seqs (16)"),
        ("workload:\n  isl: {low: 9, high: 3}\n", "workload.isl.low", 2, "low (9) must be <= high (3)"),
        ("cluster:\n  kv_events_version: '0.2'\n", "cluster.kv_events_version", 2, "older than 0.9"),
        ("cluster:\n  kv_events_version: '0.10'\n  kv_events_hash_form: bytes\n", "cluster.kv_events_hash_form", 3,
         "kv_events_hash_form 'bytes' with kv_events_version '0.10': vLLM '0.10' sends block hashes as integers "
         "only; bytes hashes need vLLM 0.11 or later"),
        ("cluster:\n  kv_events_hash_form: bytes\n  kv_events_version: '0.9.2'\n", "cluster.kv_events_hash_form", 2,
         "bytes hashes need vLLM 0.11"),
        # bounds on what a run would have to build (a typo must not exhaust the machine)
        ("cluster:\n  workers: 1000000000\n", "cluster.workers", 2, "Expected `int` <= 4096, got 1000000000"),
        ("cluster:\n  workers: 4096\n  dp_size: 4\n", "cluster.workers", 2, "more than the 8192 ranks"),
        ("run:\n  duration_s: 1.0e+12\n", "run.duration_s", 2, "Expected `float` <= 320000000.0"),
        ("run:\n  drain_timeout_s: .inf\n", "run.drain_timeout_s", 2, "Expected `float` <= 320000000.0"),
        ("workload:\n  isl: {high: 100000000}\n", "workload.isl.high", 2, "Expected `int` <= 4194304"),
        ("workload:\n  turns: 5000\n  isl: {kind: constant, mean: 1000}\n", "workload.turns", 2,
         "a session's last prompt would average 5,"),
        ("workload:\n  rate_rps: 100000\n", "workload.rate_rps", 2, "more than the 10,000,000 a scenario may send"),
        ("workload:\n  rate_rps: 100\n  turns: 20\nrun:\n  duration_s: 3600\n", "workload.rate_rps", 2,
         "prompt tokens up front"),
        ("name: ../../x\n", "name", 1, "'../../x' is not a plain name"),
        ("name: ''\n", "name", 1, "is not a plain name"),
    ],
)
def test_out_of_range_values_name_the_key_path_and_line(text, key, line, expected):
    msg = error_of(text)
    assert f"{key} (line {line}): " in msg
    assert expected in msg


def test_engine_values_are_range_checked_at_validation():
    msg = error_of("cluster:\n  engine:\n    num_gpu_blocks: 0\n")
    assert "cluster.engine.num_gpu_blocks (line 3)" in msg


def test_trace_path_errors_name_the_key_line_and_resolved_path(tmp_path):
    text = "name: t\nworkload:\n  kind: trace\n  trace: missing.jsonl\n"
    msg = error_of(text, base_dir=tmp_path)
    assert f"workload.trace (line 4): file not found: {tmp_path / 'missing.jsonl'}" in msg


def test_trace_kind_is_inferred_and_the_path_resolves_against_the_scenario_file(tmp_path):
    write_trace(tmp_path / "traces.jsonl")
    sub = tmp_path / "scenarios"
    sub.mkdir()
    (sub / "s.yaml").write_text("workload:\n  trace: ../traces.jsonl\n  trace_block_size: 16\n")
    scenario = load_scenario(sub / "s.yaml")
    assert isinstance(scenario.workload, TraceWorkload)
    assert resolve(scenario, scenario.workload.trace).resolve() == (tmp_path / "traces.jsonl").resolve()
    assert len(build_sessions(scenario)) == 3


def test_syntax_errors_and_non_mappings_are_scenario_errors(tmp_path):
    assert "not valid YAML" in error_of("cluster: [\n")
    assert "must be a mapping of sections, got list" in error_of("- 1\n- 2\n")
    with pytest.raises(ScenarioError, match="cannot read the scenario"):
        load_scenario(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("chaos", "key", "expected"),
    [
        ("- {at_s: 1, action: remove_worker, worker: 9}", "chaos[0].worker", "worker 9 is not running then (running: 0, 1)"),
        ("- {at_s: 1, action: remove_worker, worker: 1}\n- {at_s: 2, action: kill_rank, worker: 1}", "chaos[1].worker",
         "chaos[1] (kill_rank at 2 s): worker 1 is not running then (running: 0)"),
        ("- {at_s: 5, action: slow_worker, worker: 2}\n- {at_s: 6, action: add_worker}", "chaos[0].worker",
         "worker 2 is not running then"),  # the worker added later does not exist yet at 5 s
        ("- {at_s: 1, action: kill_rank}", "chaos[0].worker", "kill_rank at 1 s) needs a worker id"),
        ("- {at_s: 1, action: drop_kv_events, worker: 0, dp_rank: 3}", "chaos[0].dp_rank",
         "dp_rank 3 does not exist (worker 0 has 2 DP ranks)"),
        ("- {at_s: 1, action: add_worker, worker: 7}", "chaos[0].worker", "takes no worker (the new worker will be 2)"),
        ("- {at_s: 1, action: remove_worker}\n- {at_s: 1, action: remove_worker}\n- {at_s: 2, action: remove_worker}",
         "chaos[2]", "no worker is running then"),
    ],
)
def test_a_chaos_timeline_must_name_workers_and_ranks_that_exist_when_it_fires(chaos, key, expected):
    text = "cluster:\n  workers: 2\n  dp_size: 2\nchaos:\n" + "".join(f"  {line}\n" for line in chaos.splitlines())
    msg = error_of(text)
    assert f"{key} (line " in msg
    assert expected in msg


def test_a_chaos_timeline_may_target_workers_it_added_in_time_order():
    text = ("cluster:\n  workers: 2\nchaos:\n  - {at_s: 9, action: kill_rank, worker: 2}\n"
            "  - {at_s: 3, action: add_worker}\n  - {at_s: 3, action: remove_worker}\n"
            "  - {at_s: 4, action: slow_worker, worker: 1, factor: 2}\n")
    assert len(parse_scenario(text).chaos) == 4


def test_nesting_encoding_and_size_fail_as_scenario_errors(tmp_path, monkeypatch):
    nested = error_of("a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert re.search(r"nested too deeply|exceeded maximum nesting depth", nested)
    path = tmp_path / "s.yaml"
    path.write_bytes(b"name: ok\ncluster:\n  workers: 2 # caf\xe9\n")
    with pytest.raises(ScenarioError, match=r"s.yaml: line 3: not UTF-8 text"):
        load_scenario(path)
    monkeypatch.setattr(scenario_module.loading, "MAX_SCENARIO_BYTES", 16)
    path.write_text("name: a-longer-name-than-sixteen-bytes\n")
    with pytest.raises(ScenarioError, match="larger than 16 bytes"):
        load_scenario(path)


def test_trace_sessions_that_would_arrive_past_ten_years_name_the_row(tmp_path):
    rows = [{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1], "session_id": "a"}]
    rows += [{"delay": 3.0e11, "input_length": 4, "output_length": 1, "hash_ids": [1], "session_id": "a"}] * 2
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    scenario = parse_scenario("workload:\n  trace: t.jsonl\n", base_dir=tmp_path)
    with pytest.raises(ScenarioError, match=r"t.jsonl:3: this row arrives 6e\+08 s into the run"):
        build_sessions(scenario)


def test_empty_scenario_is_all_defaults():
    scenario = parse_scenario("")
    assert scenario == Scenario(base_dir=".")
    assert isinstance(scenario.workload, SyntheticWorkload)
    assert scenario.cluster.engine.block_size == 64 and scenario.cluster.engine.num_gpu_blocks == 16384
    assert (scenario.cluster.kv_events_version, scenario.cluster.kv_events_hash_form) == ("0.33", "int")


# ---------------------------------------------------------------------------------------- overrides


def test_overrides_replace_nested_values_parsed_as_yaml_scalars():
    scenario = parse_scenario(default_scenario_text(), overrides=[
        "cluster.workers=8", "router.affinity.enabled=false", "workload.rate_rps=0.5", "run.seed=11",
        "router.seed=null", "name=renamed", "cluster.engine.num_gpu_blocks=128",
    ])
    assert scenario.name == "renamed"
    assert scenario.cluster.workers == 8
    assert scenario.cluster.dp_size == 2  # untouched
    assert scenario.cluster.engine.num_gpu_blocks == 128
    assert scenario.cluster.engine.block_size == 64
    assert scenario.router.affinity.enabled is False
    assert scenario.router.affinity.ttl_secs == 60
    assert scenario.workload.rate_rps == 0.5
    assert scenario.run.seed == 11
    assert scenario.router.seed is None


def test_overrides_create_missing_sections_and_later_ones_win():
    scenario = parse_scenario("name: x\n", overrides=["router.affinity.ttl_secs=100", "run.duration_s=5",
                                                      "run.duration_s=7"])
    assert scenario.router.affinity.ttl_secs == 100
    assert scenario.run.duration_s == 7


def test_overrides_are_validated_like_the_file():
    assert "cluster.workers (from --set): Expected `int` >= 1, got 0" in error_of("cluster:\n  workers: 4\n",
                                                                            overrides=["cluster.workers=0"])
    msg = error_of("name: x\n", overrides=["cluster.wrokers=3"])
    assert "cluster.wrokers" in msg and "unknown key" in msg
    assert "cluster.workers (from --set): expected an integer, got 'many'" in error_of(
        "name: x\n", overrides=["cluster.workers=many"])
    with pytest.raises(ScenarioError, match="expected key.path=value"):
        parse_scenario("", overrides=["cluster.workers"])
    with pytest.raises(ScenarioError, match="name is not a mapping"):
        parse_scenario("name: x\n", overrides=["name.first=y"])


def test_a_key_of_another_workload_kind_names_the_kind_it_belongs_to(tmp_path):
    write_trace(tmp_path / "t.jsonl")
    msg = error_of("workload:\n  kind: trace\n  trace: t.jsonl\n  turns: 3\n", base_dir=tmp_path)
    assert msg == "s.yaml: workload.turns (line 4): belongs to workload.kind=synthetic; with workload.kind=trace, " \
                  "remove it"
    msg = error_of("workload:\n  kind: synthetic\n  trace: t.jsonl\n", base_dir=tmp_path)
    assert "workload.trace (line 3): belongs to workload.kind=trace; with workload.kind=synthetic, remove it" in msg


def test_override_can_point_the_workload_at_another_trace(tmp_path):
    write_trace(tmp_path / "other.jsonl", rows=5)
    text = "workload:\n  kind: trace\n  trace: missing.jsonl\n"
    scenario = parse_scenario(text, base_dir=tmp_path, overrides=["workload.trace=other.jsonl"])
    assert len(build_sessions(scenario)) == 5
    absolute = parse_scenario(text, base_dir="/", overrides=[f"workload.trace={tmp_path / 'other.jsonl'}"])
    assert len(build_sessions(absolute)) == 5


def test_apply_overrides_on_raw_data():
    data = apply_overrides({"cluster": {"workers": 1}}, ["cluster.workers=3", "cluster.engine.block_size=16",
                                                         "name="])
    assert data == {"cluster": {"workers": 3, "engine": {"block_size": 16}}, "name": ""}


# ----------------------------------------------------------------------------------------- examples


def test_the_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"quickstart.yaml", "mooncake-3600s.yaml", "agentic-sessions-600s.yaml"} <= names


def test_quickstart_example_is_the_built_in_default():
    assert (ROOT / "examples" / "quickstart.yaml").read_text() == default_scenario_text()


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_validates(path, tmp_path):
    short = ["run.duration_s=5", "run.max_requests=20"]  # building the whole workload is not the point here
    try:
        scenario = load_scenario(path, short)
    except ScenarioError as exc:  # allowed only for a checkout without the (uncommitted) trace beside it
        assert "workload.trace" in str(exc) and "file not found" in str(exc), exc
        scenario = load_scenario(path, [*short, f"workload.trace={write_trace(tmp_path / 't.jsonl', rows=4)}"])
    assert load_scenario(path, [f"workload.trace={path}"] if isinstance(scenario.workload, TraceWorkload) else [])
    assert build_sessions(scenario)


def test_mooncake_example_matches_the_reference_replay_setup():
    scenario = load_scenario(ROOT / "examples" / "mooncake-3600s.yaml",
                             [f"workload.trace={ROOT / 'examples' / 'quickstart.yaml'}"])  # any existing file
    assert scenario.cluster.workers == 16 and scenario.cluster.dp_size == 1
    assert scenario.router.policy == "kv"
    assert isinstance(scenario.workload, TraceWorkload)
    assert scenario.workload.trace_block_size == 512
    engine = scenario.cluster.engine
    assert (engine.block_size, engine.num_gpu_blocks, engine.max_num_seqs, engine.max_num_batched_tokens) == (
        64, 16384, 256, 8192)
    text = (ROOT / "examples" / "mooncake-3600s.yaml").read_text()
    assert "trace: ../../shared/traces/mooncake_conversation_trace.jsonl" in text
    assert "FAST25-release/traces/" in text and "--set workload.trace=" in text


def test_agentic_example_has_sub_agents_and_affinity():
    scenario = load_scenario(ROOT / "examples" / "agentic-sessions-600s.yaml")
    assert isinstance(scenario.workload, SyntheticWorkload)
    assert scenario.workload.sub_agents >= 1 and scenario.workload.turns > 1
    assert scenario.router.affinity.enabled
    assert scenario.run.duration_s == 600


# ------------------------------------------------------------------------------ what a person means


@pytest.mark.parametrize(("written", "value"), [("1e2", 100.0), ("1E-3", 0.001), ("+1.5e3", 1500.0), (".5", 0.5),
                                                 ("2.5E+1", 25.0), ("3", 3.0)])
def test_floats_as_yaml_1_2_writes_them_are_floats_in_the_file_and_in_overrides(written, value):
    """PyYAML reads ``1e2`` as a string (YAML 1.1); a person and YAML 1.2 mean a number."""
    from_file = parse_scenario(f"run:\n  duration_s: {written}\n  sla: {{ttft_ms: {written}}}\n"
                               f"router:\n  affinity: {{ttl_secs: {written}}}\n")
    assert from_file.run.duration_s == from_file.run.sla.ttft_ms == from_file.router.affinity.ttl_secs == value
    from_set = parse_scenario("name: x\n", overrides=[f"run.duration_s={written}", f"workload.rate_rps={written}",
                                                      "run.max_requests=10"])
    assert from_set.run.duration_s == from_set.workload.rate_rps == value


def test_a_string_that_looks_like_a_float_stays_a_string_where_a_string_is_expected():
    assert parse_scenario("name: 1e2\n").name == "1e2"
    assert parse_scenario("name: x\n", overrides=["name=1e2"]).name == "1e2"
    assert "run.duration_s (line 2): expected a number (or null), got '1e2x'" in error_of("run:\n  duration_s: 1e2x\n")


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        ("router:\n  polcy: kv\n", [], "router.polcy (line 2): unknown key; did you mean router.policy?"),
        ("name: x\n", ["router.polcy=kv"], "router.polcy (from --set): unknown key; did you mean router.policy?"),
        ("cluster:\n  wrokers: 3\n", [], "did you mean cluster.workers?"),
        ("workload:\n  kind: trace\n  trace: t.jsonl\n  trace_blok_size: 16\n", [],
         "did you mean workload.trace_block_size?"),
        ("chaos:\n  - {at_s: 1, acton: add_worker}\n", [], "chaos[0].acton (line 2): unknown key; did you mean "
                                                          "chaos[0].action?"),
        ("clustr:\n  workers: 3\n", [], "clustr (line 1): unknown key; did you mean cluster?"),
        ("name: x\nzzzz: 1\n", [], "zzzz (line 2): unknown key (check its spelling and section)"),
    ],
)
def test_an_unknown_key_suggests_the_closest_valid_key_at_its_level(text, overrides, expected):
    assert expected in error_of(text, overrides=overrides)


def test_a_wrong_type_says_what_was_expected_and_the_value_once():
    msg = error_of("cluster:\n  workers: four\n")
    assert msg == "s.yaml: cluster.workers (line 2): expected an integer, got 'four'"
    assert error_of("run: 5\n").endswith("run (line 1): expected a mapping of keys, got 5")


def test_an_override_is_cited_as_such_not_by_the_line_it_replaced(tmp_path):
    text = "name: x\nworkload:\n  kind: trace\n  trace: t.jsonl\n"
    write_trace(tmp_path / "t.jsonl")
    msg = error_of(text, base_dir=tmp_path, overrides=[f"workload.trace={tmp_path / 'nope.jsonl'}"])
    assert msg.startswith(f"s.yaml: workload.trace (from --set): file not found: {tmp_path / 'nope.jsonl'}. To try "
                          "the scenario on a generated Mooncake-format trace instead: kvemu trace synth ")
    assert "workload.trace (line 4): file not found" in error_of(text.replace("t.jsonl", "gone.jsonl"),
                                                                 base_dir=tmp_path)


def test_paths_given_with_set_are_made_absolute_against_the_working_directory(tmp_path):
    from harness.scenario import paths_from_cwd

    out = paths_from_cwd(["workload.trace=./t.jsonl", "cluster.engine.timing_model={type: interpolated, path: p.json}",
                          "cluster.prefill.engine.timing_model.path=q.json", "cluster.workers=3", "name=t.jsonl",
                          "workload.trace=/abs/t.jsonl"], cwd=tmp_path)
    assert out[0] == f'workload.trace="{tmp_path / "t.jsonl"}"'
    assert out[1] == ('cluster.engine.timing_model={"type": "interpolated", "path": "' + str(tmp_path / "p.json")
                      + '"}')
    assert out[2] == f'cluster.prefill.engine.timing_model.path="{tmp_path / "q.json"}"'
    assert out[3:] == ["cluster.workers=3", "name=t.jsonl", 'workload.trace="/abs/t.jsonl"']


def test_the_package_face_is_its_modules_public_names() -> None:
    """``harness.scenario.__all__`` is spelt out (mypy reads only a literal list): it stays the modules' lists, in
    order, and the three YAML helpers, so a name added to a module is re-exported (and seen by mypy)."""
    from harness.scenario import loading, origin, schema, sections

    assert scenario_module.__all__ == [*sections.__all__, *schema.__all__, *loading.__all__, *origin.__all__,
                                       "floats_where_expected", "describe_validation_error", "line_of"]
    assert all(hasattr(scenario_module, name) for name in scenario_module.__all__)
