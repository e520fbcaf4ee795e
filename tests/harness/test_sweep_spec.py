"""The sweep file: validation that names the key and line (or the point), expansion order, seeds, figures,
and the Pareto front and chosen point of sweep.md."""

import pytest

from harness.sweep.spec import MAX_RUNS, MAX_SWEEP_BYTES, SweepError, load_sweep, parse_sweep, plan_runs
from harness.sweep.report import choose_point, pareto_front

TINY = "set: {run.duration_s: 2, workload.rate_rps: 1}\n"


def error_of(text: str) -> str:
    with pytest.raises(SweepError) as info:
        plan_runs(parse_sweep(text, source="s.yaml"))
    return str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("axes:\n  cluster.workers: [1, 2]\nfigurs: [p99_ttft_ms]\n", "s.yaml: figurs (line 3): unknown key"),
        ("axes:\n  cluster.workers: []\n", "axes.cluster.workers (line 2): give at least one value"),
        ("axes:\n  cluster.workers: [[1]]\n",
         "s.yaml: axes[...][0] (line 1): Expected `bool | int | float | str | null`, got `array`"),
        ("axes: {}\n", "axes (line 1): give at least one axis"),
        ("mode: zip\naxes:\n  cluster.workers: [1, 2]\n  router.policy: [kv]\n",
         "axes.router.policy (line 4): mode zip needs axes of equal length: 1 values here, 2 for cluster.workers"),
        ("mode: diagonal\naxes: {cluster.workers: [1]}\n", "mode (line 1): Invalid enum value 'diagonal'"),
        ("axes: {cluster.workers: [1]}\nseeds: 0\n", "seeds (line 2)"),
        ("axes: {cluster.workers: [1]}\nseeds: [3, 3]\n", "seeds (line 2): a seed is listed twice"),
        ("axes: {cluster.workers: [1]}\nset: {cluster.workers: 2}\n", "overlaps axes.cluster.workers"),
        ("axes: {cluster: [1]}\nset: {cluster.workers: 2}\n", "overlaps axes.cluster"),
        ("axes: {'cluster..workers': [1]}\n", "not a key path"),
        ("axes: {cluster.workers: [1]}\nfigures: [p99_ttft]\n",
         "figures[0] (line 2): 'p99_ttft' is not a summary.json key (did you mean p99_ttft_ms"),
        ("axes: {cluster.workers: [1]}\nfigures: [kvemu.routing]\n", "'kvemu.routing' is a section of summary.json"),
        ("axes: {cluster.workers: [1]}\nfigures: [p99_ttft_ms, p99_ttft_ms]\n", "'p99_ttft_ms' is listed twice"),
        ("axes: {cluster.workers: [1]}\nbase: nowhere.yaml\n", "base (line 2): nowhere.yaml: cannot read the scenario"),
        ("name: 'my sweep'\naxes: {cluster.workers: [1]}\n", "name (line 1): 'my sweep' is not a plain name"),
        ("- 1\n", "a sweep is a mapping"),
    ],
)
def test_an_invalid_sweep_file_is_refused_naming_the_key_and_line(text, expected):
    assert expected in error_of(text)


def test_too_many_runs_are_refused_before_anything_is_planned():
    text = f"axes:\n  cluster.workers: {list(range(1, 101))}\n  router.seed: {list(range(50))}\nseeds: 3\n"
    message = error_of(text)
    assert f"15,000 runs, more than the {MAX_RUNS:,}" in message and "axes (line 1)" in message


def test_an_oversize_sweep_file_is_refused(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("axes: {cluster.workers: [1]}\n" + "#" * MAX_SWEEP_BYTES + "\n")
    with pytest.raises(SweepError, match="larger than 1,048,576 bytes"):
        load_sweep(path)


@pytest.mark.parametrize(
    ("axes", "expected"),
    [
        ("cluster.workers: [2, 0]", ["point 1 (cluster.workers=0)", "cluster.workers", "got 0"]),
        ("cluster.wrokers: [2]", ["point 0 (cluster.wrokers=2)", "cluster.wrokers", "unknown key"]),
        ("router.policy: [kv, nosuchmodule_kvemu:make]",
         ["point 1 (router.policy=nosuchmodule_kvemu:make)", "router.policy: cannot import module"]),
        ("run.mode: [virtual, live]", ["point 1 (run.mode=live)", "run.mode: a sweep runs virtual time only"]),
        ("cluster.engine.num_gpu_blocks: [256, -1]", ["point 1 (cluster.engine.num_gpu_blocks=-1)",
                                                      "cluster.engine.num_gpu_blocks", "got -1"]),
    ],
)
def test_every_point_is_validated_up_front_naming_the_point_and_key(axes, expected):
    message = error_of(TINY + f"axes:\n  {axes}\n")
    for part in expected:
        assert part in message, message


def test_a_live_base_scenario_is_refused(tmp_path):
    (tmp_path / "live.yaml").write_text("run: {mode: live, duration_s: 2}\n")
    (tmp_path / "s.yaml").write_text("base: live.yaml\naxes: {cluster.workers: [1, 2]}\n")
    with pytest.raises(SweepError, match=r"point 0 \(cluster.workers=1\): run.mode: a sweep runs virtual time only"):
        plan_runs(load_sweep(tmp_path / "s.yaml"))


def test_grid_expands_last_axis_fastest_then_seeds_from_the_points_seed():
    runs = plan_runs(parse_sweep(TINY + "axes:\n  cluster.workers: [1, 2]\n  router.policy: [kv, round_robin]\n"
                                        "seeds: 2\n"))
    assert [(r.point, r.axes["cluster.workers"], r.axes["router.policy"], r.seed) for r in runs] == [
        (0, "1", "kv", 7), (0, "1", "kv", 8), (1, "1", "round_robin", 7), (1, "1", "round_robin", 8),
        (2, "2", "kv", 7), (2, "2", "kv", 8), (3, "2", "round_robin", 7), (3, "2", "round_robin", 8)]
    assert len({r.key for r in runs}) == 8  # every run is a distinct scenario and seed
    assert runs[2].overrides == ["run.duration_s=2", "workload.rate_rps=1", "cluster.workers=1",
                                 "router.policy=round_robin"]


def test_zip_pairs_values_and_explicit_seeds_are_used_as_given():
    runs = plan_runs(parse_sweep(TINY + "mode: zip\naxes:\n  cluster.workers: [1, 2, 3]\n"
                                        "  router.policy: [kv, round_robin, random]\nseeds: [11, 3]\n"))
    assert [(r.point, r.axes["cluster.workers"], r.axes["router.policy"], r.seed) for r in runs] == [
        (0, "1", "kv", 11), (0, "1", "kv", 3), (1, "2", "round_robin", 11), (1, "2", "round_robin", 3),
        (2, "3", "random", 11), (2, "3", "random", 3)]


def test_a_seed_axis_moves_each_points_seed_range_and_the_scenario_sees_it():
    runs = plan_runs(parse_sweep(TINY + "axes: {run.seed: [1, 5]}\nseeds: 2\n"))
    assert [r.seed for r in runs] == [1, 2, 5, 6]
    assert runs[3].scenario().run.seed == 6


def test_values_keep_their_yaml_type_and_set_overrides_join_the_files():
    sweep = parse_sweep(TINY + "axes: {name: ['8', x]}\n", overrides=["run.duration_s=3"])
    runs = plan_runs(sweep)
    assert runs[0].axes == {"name": "'8'"} and runs[0].scenario().name == "8"  # a string stays a string
    assert runs[0].scenario().run.duration_s == 3.0
    assert dict(sweep.spec.set)["run.duration_s"] == 3


def test_paths_in_the_sweep_file_resolve_against_it_and_paths_given_with_set_against_the_working_directory(
        tmp_path, monkeypatch):
    row = '{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}\n'
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "scenarios" / "base.yaml").write_text("workload: {kind: trace, trace: base.jsonl}\n")
    (tmp_path / "scenarios" / "base.jsonl").write_text(row)
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "sweeps" / "near-sweep.jsonl").write_text(row)
    (tmp_path / "near-cwd.jsonl").write_text(row)
    sweep = tmp_path / "sweeps" / "s.yaml"
    sweep.write_text("base: ../scenarios/base.yaml\naxes: {workload.trace: [near-sweep.jsonl]}\n")
    [run] = plan_runs(load_sweep(sweep))
    assert run.scenario().workload.trace == str(tmp_path / "sweeps" / "near-sweep.jsonl")
    assert run.axes == {"workload.trace": "near-sweep.jsonl"}  # sweep.csv shows the value as written
    sweep.write_text("base: ../scenarios/base.yaml\nset: {workload.trace: near-sweep.jsonl}\n"
                     "axes: {run.seed: [1]}\n")
    [run] = plan_runs(load_sweep(sweep))
    assert run.scenario().workload.trace == str(tmp_path / "sweeps" / "near-sweep.jsonl")
    monkeypatch.chdir(tmp_path)  # the CLI makes --set paths absolute against the working directory first
    from harness.scenario import paths_from_cwd

    [run] = plan_runs(load_sweep(sweep, paths_from_cwd(["workload.trace=near-cwd.jsonl"])))
    assert run.scenario().workload.trace == str(tmp_path / "near-cwd.jsonl")


def test_the_objective_reads_floats_as_yaml_1_2_writes_them():
    sweep = parse_sweep(TINY + "axes: {cluster.workers: [1]}\nobjective: {ttft_ms: 2e3, goodput: 9.5e-1}\n")
    assert (sweep.spec.objective.ttft_ms, sweep.spec.objective.goodput) == (2000.0, 0.95)


def test_reports_put_each_run_in_its_own_directory(tmp_path):
    runs = plan_runs(parse_sweep(TINY + "axes: {cluster.workers: [1, 2]}\nseeds: 2\n"), reports=tmp_path / "points")
    assert [r.report_dir for r in runs] == [str((tmp_path / "points" / name).absolute())
                                            for name in ("0-seed7", "0-seed8", "1-seed7", "1-seed8")]


# ------------------------------------------------------------------------------------- Pareto front


POINTS = [(100.0, 10.0), (50.0, 5.0), (80.0, 10.0), (60.0, 4.0), (120.0, 12.0), (80.0, 10.0)]
"""(p99 TTFT, throughput per GPU) of six hand-made points."""


def test_pareto_front_keeps_points_no_other_beats_on_both():
    assert pareto_front(POINTS) == [1, 2, 4]  # 0 and 3 are dominated, 5 equals 2 (the first is kept)
    assert pareto_front([]) == []


def test_the_chosen_point_meets_the_objective_with_the_best_throughput():
    front = pareto_front(POINTS)
    assert choose_point(POINTS, front, 90.0)[0] == 2
    assert choose_point(POINTS, front, 500.0)[0] == 4
    chosen, why = choose_point(POINTS, front, 40.0)
    assert chosen is None and "no point meets the objective" in why


def test_without_an_objective_the_knee_is_chosen():
    front = pareto_front(POINTS)
    chosen, why = choose_point(POINTS, front, None)
    assert chosen == 2 and "knee" in why  # (80, 10) is farthest from the line between (50, 5) and (120, 12)
    assert choose_point([(10.0, 1.0), (20.0, 3.0)], [0, 1], None)[0] == 1  # two points: the higher throughput
