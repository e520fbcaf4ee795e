"""A report says what ran: scenario.yaml beside it (the resolved scenario, which runs again to the same requests),
"What ran" in report.md (workload, engines, timing source, overrides) and ``kvemu compare`` listing what differs
between two runs' scenarios. summary.json is left as it was (the pinned reports digest it)."""

import json
import subprocess
from pathlib import Path

import msgspec
import pytest
import yaml

from harness.scenario import TraceWorkload, load_scenario, parse_scenario
from harness.workload.synthetic_trace import write_synthetic_trace
from harness.sweep.spec import load_sweep, plan_runs, run_point
from tests.harness.test_cli import KVEMU

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted(p for p in (ROOT / "examples").glob("*.yaml") if not p.name.startswith("sweep-"))
TINY = ["--set", "run.duration_s=3", "--set", "cluster.workers=2", "--set", "cluster.engine.num_gpu_blocks=512",
        "--set", "workload.isl.mean=256", "--set", "workload.osl.mean=16", "--set", "workload.osl.std=4"]
POLYNOMIAL = "a polynomial from Dynamo's mocker (prefill quadratic in new tokens, decode in KV occupancy), not a " \
             "measured GPU"


def kvemu(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVEMU, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_every_example_loads_back_from_its_scenario_yaml_as_the_same_scenario(tmp_path, path):
    """Written from one directory, read from another: the same scenario, every field (the trace's path made
    absolute, so it is found from anywhere)."""
    from harness.report.what_ran import scenario_document, scenario_yaml
    from harness.scenario import RunOrigin

    trace = write_synthetic_trace(tmp_path / "t.jsonl", 50)
    text = path.read_text()
    given = [f"workload.trace={trace}"] if "mooncake_conversation_trace" in text else []
    scenario = load_scenario(path, given)
    written = scenario_yaml(scenario, RunOrigin.of("kvemu run", str(path), given))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = parse_scenario(written, base_dir=elsewhere, source="scenario.yaml")
    assert scenario_document(again) == scenario_document(scenario)
    expected = msgspec.structs.replace(scenario, base_dir=str(elsewhere))
    if isinstance(scenario.workload, TraceWorkload):
        absolute = str((Path(scenario.base_dir) / scenario.workload.trace).resolve())
        assert again.workload.trace == absolute
        expected = msgspec.structs.replace(expected, workload=msgspec.structs.replace(scenario.workload,
                                                                                       trace=absolute))
    assert again == expected


def test_a_run_writes_what_ran_and_its_scenario_yaml_runs_again_to_the_same_requests(tmp_path):
    first = kvemu("run", *TINY, "--set", "router.policy=round_robin", "--seed", "5", "-o", "a", "--quiet", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    written = (tmp_path / "a" / "scenario.yaml").read_text()
    data = yaml.safe_load(written)
    assert data["cluster"]["workers"] == 2 and data["router"]["policy"] == "round_robin"
    assert data["run"]["seed"] == 5 and data["run"]["duration_s"] == 3.0
    assert data["cluster"]["engine"]["max_num_seqs"] == 256  # a default, filled in
    assert "--set router.policy=round_robin" in written and "--set run.seed=5" in written
    md = (tmp_path / "a" / "report.md").read_text()
    what_ran = md.split("## What ran", 1)[1].split("\n## ", 1)[0]
    assert "`kvemu run` on the built-in quickstart" in what_ran and "[scenario.yaml](scenario.yaml)" in what_ran
    assert "- overrides (`--set`): `run.duration_s=3`, `cluster.workers=2`, " in what_ran
    assert "`router.policy=round_robin`, `run.seed=5`" in what_ran
    assert "- workload: synthetic: arrival poisson, rate_rps 2.0, isl {kind normal, mean 256.0, " in what_ran
    assert "turns 4" in what_ran and "- router: policy `round_robin`" in what_ran
    assert f"| aggregated | 2 | 2 | vllm | Dynamo 1.6.1's mocker | 64 | 512 | 1, 1 | {POLYNOMIAL} |" in what_ran
    again = kvemu("run", "a/scenario.yaml", "-o", "b", "--quiet", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "b" / "requests.jsonl").read_bytes() == (tmp_path / "a" / "requests.jsonl").read_bytes()
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["kvemu"]["scenario"] == "quickstart" and "scenario.yaml" not in json.dumps(summary)
    assert "- overrides (`--set`): none" in (tmp_path / "b" / "report.md").read_text()

    other = kvemu("run", *TINY, "--set", "cluster.workers=3", "--seed", "5", "-o", "c", "--quiet", cwd=tmp_path)
    assert other.returncode == 0, other.stderr
    compared = kvemu("compare", "a", "c", cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    scenarios = compared.stdout.split("\nScenarios: ", 1)[1].splitlines()
    assert scenarios[0] == "2 keys differ (scenario.yaml)"
    assert [line.split() for line in scenarios[2:]] == [
        ["scenario", "key", "A", "B"], ["-" * 15, "-" * 11, "--"], ["cluster.workers", "2", "3"],
        ["router.policy", "round_robin", "kv"]]
    same = kvemu("compare", "a", "b", cwd=tmp_path)
    assert same.stdout.endswith("\nScenarios: the same (scenario.yaml)\n")


def test_a_report_of_an_earlier_kvemu_is_compared_on_its_figures_alone(tmp_path):
    ran = kvemu("run", *TINY, "-o", "a", "--quiet", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text((tmp_path / "a" / "summary.json").read_text())
    compared = kvemu("compare", "old", "a", cwd=tmp_path)
    assert compared.returncode == 0
    assert compared.stdout.endswith("Scenarios: not compared; A has no scenario.yaml (a report of an earlier "
                                    "kvemu)\n")


def test_a_sweep_point_report_lists_its_axis_value_and_seed_as_overrides(tmp_path):
    (tmp_path / "sweep.yaml").write_text("set: {run.duration_s: 2, cluster.engine.num_gpu_blocks: 512}\n"
                                         "axes:\n  cluster.workers: [1, 2]\n")
    runs = plan_runs(load_sweep(tmp_path / "sweep.yaml"), reports=tmp_path / "points")
    result = run_point(runs[1])
    assert result.status == "ok", result
    where = Path(runs[1].report_dir)
    md = (where / "report.md").read_text()
    assert "`kvemu sweep` on the built-in quickstart" in md
    assert "`cluster.workers=2`, `run.seed=7`" in md
    assert yaml.safe_load((where / "scenario.yaml").read_text())["cluster"]["workers"] == 2


def test_an_interpolated_profile_and_speedups_are_named_as_the_timing_source(tmp_path):
    profile = tmp_path / "gpu.csv"
    profile.write_text("kind,x,y,ms\nprefill,128,,14.2\nprefill,1024,,41.0\ndecode,8192,1024,9.8\n"
                       "decode,8192,4096,9.1\ndecode,65536,1024,21.7\ndecode,65536,4096,19.4\n")
    scenario = parse_scenario("cluster:\n  prefill: {workers: 1, engine: {timing_model: {type: interpolated, "
                              "path: gpu.csv}, speedup_ratio: 4}}\n  decode: {workers: 2, dp_size: 2}\n",
                              base_dir=tmp_path)
    from harness.report.what_ran import what_ran_lines

    lines = what_ran_lines(scenario, None)
    assert f"| prefill | 1 | 1 | vllm | Dynamo 1.6.1's mocker | 64 | 16,384 | 4, 1 | the profile `{profile}`: " \
           "measured points, interpolated as Dynamo's mocker does (docs/profiles.md); every pass 4× faster |" in lines
    assert f"| decode | 2 | 2 | vllm | Dynamo 1.6.1's mocker | 64 | 16,384 | 1, 1 | {POLYNOMIAL} |" in lines


@pytest.mark.parametrize("vllm, named", [
    ("{semantics: vllm-0.34}", "vLLM 0.34.0 (sync, priority)"),
    ("{semantics: vllm-0.34, async_scheduling: true, scheduling_policy: fcfs}", "vLLM 0.34.0 (async, fcfs)"),
])
def test_the_engines_table_names_whose_decisions_ran(vllm, named):
    from harness.report.what_ran import what_ran_lines

    lines = what_ran_lines(parse_scenario(f"cluster: {{workers: 1, engine: {{vllm: {vllm}}}}}\n"), None)
    assert f"| aggregated | 1 | 1 | vllm | {named} | 64 | 16,384 | 1, 1 | {POLYNOMIAL} |" in lines


@pytest.mark.parametrize("sglang, named", [
    ("{}", "Dynamo 1.6.1's mocker"),
    ("{semantics: sglang-0.5.23, schedule_policy: lpm}", "SGLang 0.5.23 (non-overlap loop, lpm)"),
])
def test_the_engines_table_names_whose_sglang_decisions_ran(sglang, named):
    from harness.report.what_ran import what_ran_lines

    scenario = parse_scenario(f"cluster: {{workers: 1, engine: {{backend: sglang, sglang: {sglang}}}}}\n")
    rows = [line for line in what_ran_lines(scenario, None) if line.startswith("| aggregated |")]
    assert len(rows) == 1 and f"| sglang | {named} |" in rows[0]


LIVE = """name: live-small
cluster: {workers: 2, dp_size: 1, engine: {speedup_ratio: 20, decode_speedup_ratio: 20, block_size: 16,
          num_gpu_blocks: 2048}}
workload: {kind: synthetic, rate_rps: 10, turns: 2, think_time_s: 0.2, system_prefix_tokens: 64,
           isl: {kind: constant, mean: 96}, osl: {kind: constant, mean: 8}}
run: {mode: live, seed: 4, duration_s: 1}
"""


def test_kvemu_up_writes_what_ran_beside_its_report(tmp_path):
    """``kvemu up``'s report is written by its load generator process: the overrides reach it on its command line
    and the report names ``kvemu up``, which runs the scenario.yaml again."""
    (tmp_path / "s.yaml").write_text(LIVE)
    res = kvemu("up", "s.yaml", "--set", "workload.turns=1", "-o", "out", cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "- `kvemu up` on `s.yaml`;" in md and "(`kvemu up scenario.yaml` runs it again)" in md
    assert "- overrides (`--set`): `workload.turns=1`" in md
    written = (tmp_path / "out" / "scenario.yaml").read_text()
    assert "# Run it again: kvemu up scenario.yaml -o OUTDIR" in written
    data = yaml.safe_load(written)
    assert data["workload"]["turns"] == 1 and data["run"]["mode"] == "live"


def test_bench_router_writes_what_ran_beside_each_routers_report(tmp_path):
    (tmp_path / "s.yaml").write_text(LIVE)
    res = kvemu("bench-router", "s.yaml", "--router", "kvemu", "--compress", "2", "--set", "cluster.workers=1",
                "-o", "bench", cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    (folder,) = [p for p in (tmp_path / "bench").iterdir() if p.is_dir()]
    md = (folder / "report.md").read_text()
    assert "- `kvemu bench-router` on `s.yaml`;" in md and "`cluster.workers=1`" in md
    data = yaml.safe_load((folder / "scenario.yaml").read_text())
    assert data["cluster"]["workers"] == 1
    assert data["cluster"]["engine"]["speedup_ratio"] == 40  # --compress 2 ran the engines twice as fast


def test_a_line_break_in_a_file_name_or_an_override_stays_in_the_comment(tmp_path):
    """scenario.yaml's header quotes the scenario's file name and the overrides: neither may add keys to it."""
    from harness.report.what_ran import scenario_yaml
    from harness.scenario import RunOrigin

    given = ["name=x", "workload.isl={kind: constant,\nmean: 300}"]
    scenario = parse_scenario("run: {duration_s: 2}\n", overrides=given)
    text = scenario_yaml(scenario, RunOrigin.of("kvemu run", "odd\nrouter: {policy: random}\n.yaml", given))
    assert "#   --set workload.isl={kind: constant,\\nmean: 300}" in text
    assert parse_scenario(text, base_dir=tmp_path).router.policy == "kv"
    assert [line[0] for line in text.splitlines()[:6]] == ["#"] * 5 + ["n"]  # five comment lines, then name:
