"""``kvemu plan``: the search finds the smallest passing cluster of any monotone model in few rounds, splits a
disaggregated cluster, and the command writes its answer, the bounding runs and the plot."""

from __future__ import annotations

import json
from concurrent.futures import Executor, Future
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cli import main
from harness.sweep.plan import PlanSpec, _candidates, parse_sla, plan_cluster
from harness.sweep.spec import PointResult
from harness.scenario import default_scenario_text
from harness.report.sla import Sla
from kvemu.errors import InvalidArgument


class ModelExecutor(Executor):
    """Runs nothing: a probe's share of requests meeting the SLA is ``share(prefill, decode or workers)``."""

    def __init__(self, share) -> None:
        self.share = share
        self.points = []

    def submit(self, fn, /, *args, **kwargs):
        (point,) = args
        self.points.append(point)
        sizes = dict(o.split("=", 1) for o in point.overrides if o.startswith("cluster."))
        if "cluster.workers" in sizes:
            met = self.share(int(sizes["cluster.workers"]))
        else:
            met = self.share(int(sizes["cluster.prefill.workers"]), int(sizes["cluster.decode.workers"]))
        future: Future = Future()
        future.set_result(PointResult(point=point.point, seed=point.seed, status="ok",
                                      figures={"num_requests": 1000, "goodput_completed_requests": round(met * 1000)}))
        return future


def _spec(**kw) -> PlanSpec:
    return PlanSpec(scenario_text=default_scenario_text(), sla=Sla(ttft_ms=500), **kw)


@settings(max_examples=100, deadline=None)
@given(threshold=st.integers(1, 70), hi=st.integers(1, 64), width=st.integers(1, 6))
def test_the_search_finds_the_smallest_passing_size_of_any_monotone_model(threshold, hi, width):
    ex = ModelExecutor(lambda n: 0.99 if n >= threshold else 0.5)
    plan = plan_cluster(_spec(min_workers=1, max_workers=hi), ex, width=width)
    if threshold > hi:
        assert plan.answer is None
        assert max(int(p.overrides[0].split("=")[1]) for p in ex.points) == hi  # the largest was tried
    else:
        assert plan.answer.workers == threshold and plan.answer.met_fraction == 0.99
        if threshold > 1:
            assert plan.largest_failing.workers == threshold - 1
    assert len({p.overrides[0] for p in ex.points}) == plan.runs == len(ex.points)  # no size probed twice
    rounds, span = 1, hi  # (k+1)-ary narrowing: far fewer runs than a grid over 1..hi
    while span > 1:
        span = -(-span // (width + 1))
        rounds += 1
    assert plan.runs <= width * rounds + 1


def test_two_probes_a_round_need_five_runs_for_a_range_of_sixty_four():
    ex = ModelExecutor(lambda n: 1.0 if n >= 23 else 0.0)
    plan = plan_cluster(_spec(max_workers=64), ex, width=2)
    assert plan.answer.workers == 23 and plan.runs <= 9
    assert [p.overrides[0] for p in ex.points[:2]] == ["cluster.workers=32", "cluster.workers=64"]


def test_candidates_probe_the_largest_size_first_then_split_the_interval_evenly():
    assert _candidates(0, None, 64, 2) == [32, 64]
    assert _candidates(0, 32, 64, 3) == [8, 16, 24]
    assert _candidates(10, 12, 64, 4) == [11]
    assert _candidates(10, 11, 64, 4) == []


def test_every_seed_must_pass():
    ex = ModelExecutor(lambda n: 0.97)
    seeds_share = {7: 0.97, 8: 0.9}

    def submit(fn, point):
        future = ModelExecutor.submit(ex, fn, point)
        future.result().figures["goodput_completed_requests"] = round(seeds_share[point.seed] * 1000)
        return future

    ex.submit = submit
    plan = plan_cluster(_spec(max_workers=4, seeds=[7, 8]), ex, width=1)
    assert plan.answer is None and all(p.met_fraction == 0.9 for p in plan.probes)


def test_a_disaggregated_cluster_is_searched_over_its_total_and_split():
    text = default_scenario_text().replace("  workers: 4\n  dp_size: 2\n  engine:\n    num_gpu_blocks: 4096\n"
                                           "    block_size: 64\n",
                                           "  prefill: {workers: 1}\n  decode: {workers: 3}\n")
    assert "prefill" in text

    def share(prefill: int, decode: int) -> float:  # needs 2 prefill and 5 decode workers
        return 0.99 if prefill >= 2 and decode >= 5 else 0.3

    ex = ModelExecutor(share)
    plan = plan_cluster(PlanSpec(scenario_text=text, sla=Sla(ttft_ms=500), max_workers=16), ex, width=2)
    assert plan.disaggregated
    assert (plan.answer.workers, plan.answer.prefill_workers, plan.answer.decode_workers) == (7, 2, 5)
    assert plan.largest_failing.workers == 6


def test_parse_sla_names_what_is_wrong():
    assert parse_sla("ttft_ms=500,itl_ms=20") == Sla(ttft_ms=500, itl_ms=20)
    assert parse_sla("e2e_ms=3000") == Sla(e2e_ms=3000)
    for bad, match in [("ttft=5", "expected"), ("ttft_ms=fast", "number"), ("ttft_ms=5,e2e_ms=9", "exclusive")]:
        with pytest.raises(InvalidArgument, match=match):
            parse_sla(bad)


QUICK = ["--set", "workload.rate_rps=8", "--set", "run.duration_s=12", "--jobs", "2"]


def test_kvemu_plan_on_the_built_in_workload_writes_the_answer_and_its_bounds(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", "--sla", "ttft_ms=500,itl_ms=30", "--goodput", "0.9", "--max-workers", "8", "-o", str(out),
                 *QUICK]) == 0
    plan = json.loads((out / "plan.json").read_text())
    answer, failing = plan["answer"], plan["largest_failing"]
    assert answer["met_fraction"] >= 0.9 and (failing is None or failing["workers"] == answer["workers"] - 1)
    assert failing is None or failing["met_fraction"] < 0.9
    assert (out / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "plan.md").read_text()
    assert f"{answer['workers']} workers meet TTFT ≤ 500 ms, ITL ≤ 30 ms" in md and "## Every probe" in md
    assert capsys.readouterr().out.startswith(f"{answer['workers']} workers meet")


def test_kvemu_plan_says_when_no_size_passes_and_refuses_bad_input(tmp_path, capsys):
    assert main(["plan", "--sla", "ttft_ms=0.001", "--max-workers", "2", "-o", str(tmp_path / "p"), *QUICK]) == 1
    assert "no cluster of up to 2 workers" in capsys.readouterr().out
    assert main(["plan", "--goodput", "1.5", "--sla", "ttft_ms=1"]) == 2
    assert main(["plan"]) == 2  # no SLA anywhere
    assert "give --sla" in capsys.readouterr().err
    assert main(["plan", "--sla", "ttft_ms=5", "--set", "cluster.engine.block_size=0"]) == 2
    assert main(["plan", str(Path(tmp_path) / "missing.jsonl"), "--sla", "ttft_ms=5"]) == 2


def test_plan_bounds_the_runs_a_round_and_names_seeds(capsys):
    from harness.sweep.plan import MAX_RUNS_A_ROUND
    from harness.sweep.spec import MAX_RUNS

    assert MAX_RUNS_A_ROUND == MAX_RUNS == 10_000  # the documented bound: as a sweep's
    # 10^6 seeds were accepted (2.4 GB, 14 min): refused before a list of them is built
    assert main(["plan", "--sla", "ttft_ms=5", "--seeds", "1000000"]) == 2
    err = capsys.readouterr().err
    assert "--seeds (1,000,000) must be <= 10,000" in err and "Traceback" not in err
    assert main(["plan", "--sla", "ttft_ms=5", "--seeds", "5000", "--width", "4"]) == 2
    assert "--seeds (5,000) x 4 probes a round = 20,000 runs a round" in capsys.readouterr().err
    with pytest.raises(InvalidArgument, match="--seeds"):
        plan_cluster(_spec(seeds=list(range(3000)), max_workers=8), ModelExecutor(lambda w: 1.0), width=4)


def test_plan_names_its_flags_not_the_scenario_values_they_become(capsys):
    for argv, flag in [(["--max-workers", "1000000"], "--max-workers (1000000) must be <= 4096"),
                       (["--min-workers", "5000", "--max-workers", "6000"], "--min-workers (5000) must be <= 4096"),
                       (["--max-workers", "4096", "--set", "cluster.dp_size=3"], "--max-workers (4096): a cluster"),
                       (["--sla", "ttft_ms=-1"], "--sla 'ttft_ms=-1': ttft_ms must be > 0")]:
        assert main(["plan", "--sla", "ttft_ms=5", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert flag in err and "line 4" not in err, (argv, err)
    assert "planning" not in err  # refused before anything is planned
    assert main(["plan", "--sla", "ttft_ms=5", "--jobs", "100000"]) == 2  # (a local pool that size)
    assert "--jobs (100000) must be <= 1024" in capsys.readouterr().err
    sweep = Path(__file__).resolve().parents[2] / "examples" / "sweep-workers.yaml"
    assert main(["sweep", str(sweep), "--jobs", "100000", "--validate"]) == 2
    assert "--jobs must be in 1..1024, got 100000" in capsys.readouterr().err


def test_a_huge_width_is_clamped_to_the_sizes_there_are():
    executor = ModelExecutor(lambda w: 1.0)
    plan = plan_cluster(_spec(max_workers=2), executor, width=10**12)  # a range(1, width) would never end
    assert plan.answer.workers == 1


@pytest.mark.process_supervision
def test_the_first_sigterm_stops_kvemu_plan_with_143(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "plan", "--sla", "ttft_ms=500", "--jobs", "1",
                             "--max-workers", "4", "--set", "run.duration_s=300", "--set", "workload.rate_rps=20",
                             "-o", str(tmp_path / "p")], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stderr.readline()
        assert "planning" in line, line
        time.sleep(1.0)  # a probe is running
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 143
        assert time.monotonic() - started < 20
        assert "interrupted (SIGTERM)" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.process_supervision
def test_the_first_sigterm_stops_a_command_without_a_handler_of_its_own_with_143():
    """kvemu validate building a large workload: the default SIGTERM killed it (-15, no word); now it says so."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "validate", "--set", "workload.rate_rps=25",
                             "--set", "run.duration_s=300"], stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2.5)  # imported, building some 60,000 requests (about 8 s)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 143
        assert "kvemu validate: interrupted (SIGTERM)" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_an_interrupted_plan_keeps_the_probes_that_finished(tmp_path):
    from harness.sweep.plan import write_partial_plan
    from harness.run.runner import Terminated

    class StopInRoundTwo(ModelExecutor):
        def submit(self, fn, /, *args, **kwargs):
            if len(self.points) >= 1:  # width 1: round one probes the largest size, round two is stopped
                raise Terminated("SIGTERM")
            return super().submit(fn, *args, **kwargs)

    with pytest.raises(Terminated) as info:
        plan_cluster(_spec(max_workers=8), StopInRoundTwo(lambda w: 1.0), width=1)
    partial = info.value.partial_plan
    assert [p.workers for p in partial.probes] == [8] and partial.answer.workers == 8
    md = write_partial_plan(partial, tmp_path / "p", "SIGTERM")
    assert json.loads((tmp_path / "p" / "plan.json").read_text())["interrupted"] == "SIGTERM"
    assert md.read_text().startswith("**Interrupted (SIGTERM) before the search ended")
