"""Running a sweep: determinism per point, results recorded as runs finish, resume, failure isolation, outputs."""

import csv
import io
import json
from concurrent.futures import Executor, Future
from pathlib import Path

import pytest

import msgspec

from harness.sweep.spec import PointResult, load_sweep, parse_sweep, plan_runs, run_point
from harness.sweep.results import SweepStore
from harness.sweep.runner import run_sweep

TINY = ("set: {run.duration_s: 3, workload.rate_rps: 1, workload.turns: 2, workload.think_time_s: 0.5,\n"
        "      cluster.engine.num_gpu_blocks: 512}\n")
SWEEP = TINY + "axes:\n  cluster.workers: [1, 2]\nseeds: 2\n"


class InlineExecutor(Executor):
    """Runs each submitted call at once, in this process; counts them; stops the sweep after ``interrupt_after``."""

    def __init__(self, interrupt_after: int | None = None, fail_point: int | None = None) -> None:
        self.calls = 0
        self.interrupt_after = interrupt_after
        self.fail_point = fail_point

    def submit(self, fn, /, *args, **kwargs):
        if self.interrupt_after is not None and self.calls >= self.interrupt_after:
            raise KeyboardInterrupt
        self.calls += 1
        future: Future = Future()
        if self.fail_point is not None and args[0].point == self.fail_point:
            future.set_exception(RuntimeError("the worker running this point was lost"))
        else:
            future.set_result(fn(*args, **kwargs))
        return future


def sweep_of(text: str, tmp_path: Path, name: str = "s"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    sweep = load_sweep(path)
    return sweep, plan_runs(sweep)


def run(sweep, runs, outdir, executor, force=False, report=True):
    store = SweepStore(outdir, sweep, runs, force=force)
    return store, run_sweep(store, executor if store.todo() else None, report=report)


def rows(outdir: Path) -> list[dict]:
    return list(csv.DictReader(io.StringIO((outdir / "sweep.csv").read_text())))


def without_wall(result: PointResult) -> PointResult:
    return msgspec.structs.replace(result, wall_time_s=None, run_wall_time_ms=None)


def test_a_point_gives_the_same_result_every_time():
    runs = plan_runs(parse_sweep(SWEEP))
    first = run_point(runs[1])
    run_point(runs[2])  # another point in between: nothing carries over from one run to the next
    again = run_point(runs[1])
    assert isinstance(first, PointResult) and first.checked() == first
    assert first.status == "ok" and first.figures["completed_requests"] > 0
    assert without_wall(first) == without_wall(again)
    assert first.wall_time_s > 0 and first.run_wall_time_ms > 0
    assert first.figures["gpus"] == 2 and first.figures["goodput_request_throughput_rps"] is None
    assert first.figures["output_throughput_tok_s_per_gpu"] == pytest.approx(
        first.figures["output_throughput_tok_s"] / 2, rel=1e-5)


def test_outputs_csv_json_and_markdown_with_plots(tmp_path):
    sweep, runs = sweep_of(SWEEP + "objective: {ttft_ms: 100000}\n", tmp_path)
    out = tmp_path / "out"
    _, outcome = run(sweep, runs, out, InlineExecutor())
    assert outcome.counts == {"ok": 4} and outcome.ran == 4 and outcome.interrupted is None
    table = rows(out)
    header = next(csv.reader(io.StringIO((out / "sweep.csv").read_text())))
    assert header == ["point", "cluster.workers", "seed", "status", *sweep.spec.figures, "error"]
    assert "wall_time_ms" not in header
    assert [(r["point"], r["cluster.workers"], r["seed"], r["status"]) for r in table] == [
        ("0", "1", "7", "ok"), ("0", "1", "8", "ok"), ("1", "2", "7", "ok"), ("1", "2", "8", "ok")]
    assert all(float(r["p99_ttft_ms"]) > 0 for r in table) and {r["gpus"] for r in table} == {"2", "4"}
    document = json.loads((out / "sweep.json").read_text())
    assert document["format"] == "kvemu-sweep/1" and document["name"] == "s"
    assert document["spec"]["axes"] == {"cluster.workers": [1, 2]} and document["counts"] == {"ok": 4}
    assert [(r["point"], r["seed"]) for r in document["runs"]] == [(0, 7), (0, 8), (1, 7), (1, 8)]
    assert all(r["timing"]["wall_time_s"] > 0 and "wall_time_s" not in r for r in document["runs"])
    assert document["timing"]["runs_ran"] == 4
    md = (out / "sweep.md").read_text()
    assert "| point | cluster.workers | ok runs |" in md and "| 1 | 2 | 2/2 |" in md
    assert "## Chosen point" in md and "(objective.ttft_ms)" in md
    plots = [line.split("(")[1].rstrip(")") for line in md.splitlines() if line.startswith("![")]
    assert "sweep_pareto.png" in plots and "sweep_ttft_cluster.workers.png" in plots and len(plots) == 4
    for plot in plots:
        assert (out / plot).read_bytes().startswith(b"\x89PNG")


def test_an_interrupted_sweep_keeps_what_finished_and_a_rerun_resumes(tmp_path):
    sweep, runs = sweep_of(SWEEP, tmp_path)
    out = tmp_path / "out"
    _, outcome = run(sweep, runs, out, InlineExecutor(interrupt_after=3))
    assert outcome.interrupted == "SIGINT" and outcome.counts == {"ok": 3, "pending": 1}
    assert [r["status"] for r in rows(out)] == ["ok", "ok", "ok", "pending"]
    assert "Interrupted (SIGINT): 1 runs did not finish" in (out / "sweep.md").read_text()
    first = (out / "sweep.csv").read_text()

    executor = InlineExecutor()
    store, outcome = run(sweep, runs, out, executor)
    assert store.reused == 3 and executor.calls == 1 and outcome.counts == {"ok": 4}
    assert (out / "sweep.csv").read_text().splitlines()[:4] == first.splitlines()[:4]

    executor = InlineExecutor()
    run(sweep, runs, out, executor)
    assert executor.calls == 0  # all finished: nothing runs again


def test_resume_reuses_only_runs_of_the_same_resolved_scenario(tmp_path):
    sweep, runs = sweep_of(SWEEP, tmp_path)
    out = tmp_path / "out"
    run(sweep, runs, out, InlineExecutor(), report=False)
    wider, wider_runs = sweep_of(SWEEP.replace("[1, 2]", "[1, 2, 3]"), tmp_path)  # one more value: 2 new runs
    executor = InlineExecutor()
    store, _ = run(wider, wider_runs, out, executor, report=False)
    assert store.reused == 4 and executor.calls == 2
    changed, changed_runs = sweep_of(SWEEP.replace("run.duration_s: 3", "run.duration_s: 4"), tmp_path)
    executor = InlineExecutor()
    store, _ = run(changed, changed_runs, out, executor, report=False)
    assert store.reused == 0 and executor.calls == 4  # another scenario: no stale result is reused


def test_failed_runs_are_retried_and_a_torn_log_line_is_ignored(tmp_path):
    sweep, runs = sweep_of(SWEEP, tmp_path)
    out = tmp_path / "out"
    _, outcome = run(sweep, runs, out, InlineExecutor(fail_point=1))
    assert outcome.counts == {"failed": 2, "ok": 2} and outcome.failed == 2
    failed = [r for r in rows(out) if r["status"] == "failed"]
    assert [r["point"] for r in failed] == ["1", "1"]
    assert failed[0]["error"] == "RuntimeError: the worker running this point was lost"
    assert failed[0]["p99_ttft_ms"] == ""
    with (out / "sweep-log.jsonl").open("a") as log:
        log.write('{"key": "torn')
    executor = InlineExecutor()
    store, outcome = run(sweep, runs, out, executor)
    assert store.reused == 2 and executor.calls == 2 and outcome.counts == {"ok": 4}
    assert store.refused == ["sweep-log.jsonl line 5: Input data was truncated"]
    (out / "sweep.json").unlink()  # the log alone: the results written after the torn line start lines of their own
    executor = InlineExecutor()
    store, _ = run(sweep, runs, out, executor, report=False)
    assert store.reused == 4 and executor.calls == 0


def test_an_earlier_result_past_a_bound_is_refused_on_resume_naming_the_line_and_field(tmp_path):
    """sweep-log.jsonl is read back on resume; any program may have written it. A line past a bound was reused
    (a 10,000-character figure name), or crashed the sweep (a NaN wall time at the sweep.json rewrite, figures
    of the wrong type at the reuse check); each is now refused, named, and its run runs again."""
    sweep, runs = sweep_of(SWEEP, tmp_path)
    out = tmp_path / "out"
    run(sweep, runs, out, InlineExecutor(), report=False)
    good = [json.loads(line) for line in (out / "sweep-log.jsonl").read_text().splitlines()]
    hostile = [{**good[0], "figures": {**good[0]["figures"], "x" * 10_000: 1}},
               {**good[1], "wall_time_s": float("nan")},
               {**good[2], "figures": {f"f{i}": None for i in range(10**6)}},
               {**good[3], "seed": "seven"},
               {**good[0], "figures": 5}]
    (out / "sweep-log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hostile))
    (out / "sweep.json").unlink()  # (its copy of the runs is good: the log alone is on trial)
    executor = InlineExecutor()
    store, outcome = run(sweep, runs, out, executor, report=False)
    assert store.reused == 0 and executor.calls == 4 and outcome.counts == {"ok": 4}
    assert store.refusals == 5 and store.refused == [
        "sweep-log.jsonl line 1: Expected `str` of length <= 128 - at `key` in `$.figures`",
        "sweep-log.jsonl line 2: Expected `float` >= 0.0 - at `$.wall_time_s`",
        "sweep-log.jsonl line 3: Expected `object` of length <= 77 - at `$.figures`",
        "sweep-log.jsonl line 4: Expected `int`, got `str` - at `$.seed`",
        "sweep-log.jsonl line 5: Expected `object`, got `int` - at `$.figures`"]
    document = json.loads((out / "sweep.json").read_text())
    assert all(r["timing"]["wall_time_s"] > 0 and len(r["figures"]) < 20 for r in document["runs"])


def test_an_earlier_file_past_its_size_bound_is_refused_whole_and_its_runs_run_again(tmp_path, monkeypatch):
    """sweep.json and the log are read with a size bound (an earlier file may be any size): one past it is not
    read at all, is named, and every run it held runs again."""
    import harness.sweep.results as results

    sweep, runs = sweep_of(SWEEP, tmp_path)
    out = tmp_path / "out"
    run(sweep, runs, out, InlineExecutor(), report=False)
    size = min((out / "sweep-log.jsonl").stat().st_size, (out / "sweep.json").stat().st_size)
    monkeypatch.setattr(results, "MAX_RESULTS_BYTES", size - 1)
    executor = InlineExecutor()
    store, outcome = run(sweep, runs, out, executor, report=False)
    assert store.reused == 0 and executor.calls == 4 and outcome.counts == {"ok": 4}
    assert store.refused == [f"sweep.json: larger than {size - 1:,} bytes: not read",
                             f"sweep-log.jsonl: larger than {size - 1:,} bytes: not read"]


def test_a_result_read_back_re_encodes_to_the_bytes_written():
    """sweep-log.jsonl's bytes are the stdlib's sorted keys, as before PointResult: a line decodes and re-encodes
    to itself (texts, booleans, nulls, ints and floats alike)."""
    from harness.sweep.results import _decode, _json

    line = ('{"axes": {"cluster.workers": "2"}, "error": null, "figures": {"gpus": 4, "kvemu.mode": "virtual", '
            '"kvemu.partial": false, "kvemu.stop_reason": null, "p99_ttft_ms": 41.5, "ratio": 1e-07}, '
            '"key": "0123456789abcdef01234567", "point": 1, "run_wall_time_ms": 12.25, "seed": 7, "status": "ok", '
            '"wall_time_s": 0.5}')
    result = _decode(line.encode(), PointResult)
    assert _json(result) == line and result.figures["kvemu.partial"] is False


def test_the_executor_hands_back_a_point_result_checked_against_its_bounds():
    """Through a real local pool (a process boundary: the result comes back pickled) a run is a PointResult;
    a dict, or a PointResult past a bound, handed back by an executor is that run's failure, naming the field."""
    from harness.sweep.executors import open_executor, result_of

    runs = plan_runs(parse_sweep(TINY + "axes: {cluster.workers: [1]}\n"))
    with open_executor(None, 1) as executor:
        future = executor.submit(run_point, runs[0])
        result = result_of(future, runs[0])
    assert type(future.result()) is PointResult and result == future.result()
    assert result.status == "ok" and result.figures["gpus"] == 2
    for handed, expected in [(msgspec.to_builtins(result), "TypeError: the executor handed back a dict, not a "
                                                           "PointResult"),
                             (msgspec.structs.replace(result, wall_time_s=float("nan")),
                              "the run's result is out of bounds: Expected `float` >= 0.0 - at `$.wall_time_s`")]:
        done: Future = Future()
        done.set_result(handed)
        lost = result_of(done, runs[0])
        assert (lost.status, lost.error, lost.key) == ("failed", expected, runs[0].key)
        assert lost.figures == dict.fromkeys(runs[0].figures)


def test_a_point_that_fails_at_run_time_is_recorded_and_the_others_run(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "cluster: {workers: 2, dp_size: 2, engine: {num_gpu_blocks: 256, block_size: 16}}\n"
        "workload: {kind: synthetic, rate_rps: 2, turns: 2, think_time_s: 0.1}\n"
        "run: {duration_s: 3, seed: 1}\n"
        "chaos:\n"
        "  - {at_s: 0.5, action: kill_rank, worker: 0, dp_rank: 1}\n"
        "  - {at_s: 50, action: kill_rank, worker: 0, dp_rank: 1}  # reached only by the slow point\n")
    sweep, runs = sweep_of("base: base.yaml\naxes:\n  workload.think_time_s: [0.1, 100, 0.2]\n", tmp_path)
    _, outcome = run(sweep, runs, tmp_path / "out", InlineExecutor())
    assert outcome.counts == {"failed": 1, "ok": 2}
    statuses = {r["point"]: (r["status"], r["error"]) for r in rows(tmp_path / "out")}
    assert statuses["0"] == ("ok", "") and statuses["2"] == ("ok", "")
    assert statuses["1"][0] == "failed" and "chaos action 'kill_rank': worker 0 has no live rank 1" in statuses["1"][1]
    assert "## Failed and partial runs" in (tmp_path / "out" / "sweep.md").read_text()


def test_another_sweep_into_the_same_directory_is_refused_unless_forced(tmp_path):
    sweep, runs = sweep_of(SWEEP, tmp_path)
    out = tmp_path / "out"
    run(sweep, runs, out, InlineExecutor(), report=False)
    other, other_runs = sweep_of(SWEEP, tmp_path, name="other")
    from harness.sweep.spec import SweepError

    with pytest.raises(SweepError, match="holds sweep 's', not 'other'.*--force"):
        SweepStore(out, other, other_runs)
    executor = InlineExecutor()
    store, _ = run(other, other_runs, out, executor, force=True, report=False)
    assert store.reused == 0 and executor.calls == 4
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(SweepError, match="is not empty and holds no kvemu sweep"):
        SweepStore(stranger, sweep, runs)


def test_reports_write_each_runs_full_report(tmp_path):
    runs = plan_runs(parse_sweep(TINY + "axes: {cluster.workers: [1]}\n"), reports=tmp_path / "points")
    result = run_point(runs[0])
    summary = json.loads((tmp_path / "points" / "0-seed7" / "summary.json").read_text())
    assert summary["p99_ttft_ms"] == result.figures["p99_ttft_ms"]


def _result(point: int, seed: int, workers: int, met: int, ttft: float, per_gpu: float) -> PointResult:
    """A finished run of 100 requests, ``met`` of them within the SLA."""
    figures = {"num_requests": 100, "goodput_completed_requests": met, "p99_ttft_ms": ttft,
               "output_throughput_tok_s_per_gpu": per_gpu, "gpus": 2 * workers}
    return PointResult(point=point, seed=seed, axes={"cluster.workers": str(workers)}, key=f"{point}-{seed}",
                       status="ok", figures=figures)


def _without_sla(results: list[PointResult]) -> list[PointResult]:
    return [msgspec.structs.replace(r, figures={**r.figures, "goodput_completed_requests": None}) for r in results]


# Point 0 has the most throughput per GPU but misses the SLA; point 1 meets it at 96 % in one seed only.
SLA_RESULTS = [_result(0, 7, 1, 40, 300.0, 900.0), _result(0, 8, 1, 41, 310.0, 890.0),
               _result(1, 7, 2, 99, 120.0, 600.0), _result(1, 8, 2, 94, 130.0, 610.0),
               _result(2, 7, 3, 100, 90.0, 400.0), _result(2, 8, 3, 96, 95.0, 410.0),
               _result(3, 7, 4, 100, 80.0, 300.0), _result(3, 8, 4, 100, 85.0, 305.0)]
SLA_SWEEP = TINY + "axes:\n  cluster.workers: [1, 2, 3, 4]\nseeds: 2\n"


def _chosen(md: str) -> str:
    return md.split("## Chosen point\n\n")[1].splitlines()[0]


def test_with_an_sla_the_chosen_point_meets_it_at_the_goodput_target_in_every_seed(tmp_path):
    from harness.sweep.report import render_sweep_markdown

    sweep, _ = sweep_of(SLA_SWEEP + "objective: {ttft_ms: 500}\n", tmp_path)
    chosen = _chosen(render_sweep_markdown(sweep, SLA_RESULTS))
    assert chosen.startswith("**Point 2**")  # not point 0 (40 %) nor point 1 (94 % in seed 8)
    assert "at least 95 % of requests meeting run.sla in every seed" in chosen and "by default" in chosen
    assert "p99 TTFT <= 500.00 ms (objective.ttft_ms)" in chosen
    sweep, _ = sweep_of(SLA_SWEEP + "objective: {goodput: 0.9}\n", tmp_path, "lax")
    assert _chosen(render_sweep_markdown(sweep, SLA_RESULTS)).startswith("**Point 1**")
    sweep, _ = sweep_of(SLA_SWEEP + "objective: {goodput: 1.0}\n", tmp_path, "strict")
    md = render_sweep_markdown(sweep, SLA_RESULTS)
    assert _chosen(md).startswith("**Point 3**") and "(objective.goodput)" in _chosen(md)
    assert "| met SLA (worst seed) |" in md and "| 1 | 2 | 2/2 | 94.0% |" in md
    no_sla = _without_sla(SLA_RESULTS)
    sweep, _ = sweep_of(SLA_SWEEP + "objective: {ttft_ms: 500}\n", tmp_path, "nosla")
    assert _chosen(render_sweep_markdown(sweep, no_sla)).startswith("**Point 0**")  # the TTFT bound only


def test_the_pareto_plot_marks_the_points_that_missed_the_objective(tmp_path):
    """sweep_pareto.png drew every point alike: which met the objective was in sweep.md only."""
    import matplotlib

    matplotlib.use("Agg")
    from harness.sweep.report import _draw_pareto, _missed, _pareto, point_means

    sweep, _ = sweep_of(SLA_SWEEP + "objective: {ttft_ms: 500}\n", tmp_path)
    rows = point_means(SLA_RESULTS)
    usable, front, chosen, _ = _pareto(rows, SLA_RESULTS, sweep.spec.objective)
    missed = _missed(rows, SLA_RESULTS, sweep.spec.objective, usable)
    assert sorted(rows[k].point for k in missed) == [0, 1]  # 40 %, and 94 % in seed 8: under 95 %
    fig = _draw_pareto(rows, usable, front, chosen, 500.0, tmp_path / "p.png", missed)
    marks = [c for c in fig.axes[0].collections if c.get_label() == "missed the objective"]
    assert len(marks) == 1 and len(marks[0].get_offsets()) == 2
    sweep, _ = sweep_of(SWEEP, tmp_path, "plain")  # no objective, no SLA: nothing is marked
    assert _missed(rows, _without_sla(SLA_RESULTS), sweep.spec.objective, usable) == []


def test_the_goodput_objective_is_a_share(tmp_path):
    from harness.sweep.spec import SweepError

    with pytest.raises(SweepError, match="objective.goodput"):
        sweep_of(SWEEP + "objective: {goodput: 95}\n", tmp_path)


def test_a_sweep_interrupted_before_any_run_finished_still_writes_sweep_md(tmp_path):
    sweep, runs = sweep_of(SWEEP, tmp_path)
    _, outcome = run(sweep, runs, tmp_path / "a", InlineExecutor(interrupt_after=0))
    assert outcome.interrupted == "SIGINT" and outcome.counts == {"pending": 4}
    md = (tmp_path / "a" / "sweep.md").read_text()
    assert "Interrupted (SIGINT) before any run finished" in md and "None: no run finished yet." in md
    store = SweepStore(tmp_path / "b", sweep, runs)  # stopped while the executor started: nothing submitted
    outcome = run_sweep(store, None, stopped="SIGTERM")
    assert outcome.interrupted == "SIGTERM" and outcome.ran == 0
    assert "Interrupted (SIGTERM) before any run finished" in (tmp_path / "b" / "sweep.md").read_text()
