"""Routing regret over time (``routing_regret.png``) and report.md's router replicas section: the plot's series from
hand-built runs, the section's rows, and a small virtual run with two router replicas end to end."""

import json
import math

import pytest

from harness.chaos import ChaosMark
from harness.report import plot_data, plot_drawing, plot_renderer
from harness.report.files import write_report
from harness.report.markdown import render_markdown
from harness.report.plots import PLOTS, background_renderer, write_plots
from harness.report.run_data import ReplicaCounters, ReplicaRun, ReplicaSync, RunData
from harness.report.summary import summarize
from harness.run.runner import run_scenario
from harness.scenario import default_scenario_text, parse_scenario
from kvemu import RequestRecord
from tests.harness.test_report import PNG_SIGNATURE, sample_run

S = 1_000_000_000


def judged(rid: str, t_s: float, isl_blocks: int, chosen: int | None, best: int | None) -> RequestRecord:
    """A request routed at ``t_s`` whose chosen rank had ``chosen`` of its blocks cached and the best one ``best``
    (block size 16; arrival = routing time)."""
    t = round(t_s * S)
    return RequestRecord(request_id=rid, arrival_ns=t, isl=16 * isl_blocks, max_tokens=1, worker_id=0, dp_rank=0,
                         attempts=1, routed_ns=t, truth_overlap_blocks=chosen, truth_best_overlap_blocks=best,
                         token_times_ns=[t + 1], completion_ns=t + 1)


def two_replica_run(records: list[RequestRecord], replica_of: dict[str, int], chaos=()) -> RunData:
    rows = [ReplicaCounters(replica=i, restarts=i, kv_events={"batches": 10 + i, "gaps": i, "replays": 2 * i,
                                                              "replayed_batches": 0, "lost_batches": 0},
                            kv_feed_dropped_batches=3 * i, workers_registered=2,
                            sync={"announced": 5 + i, "applied": 7 + i, "ignored": 0, "refused": 0, "expired": 0})
            for i in range(2)]
    return RunData(records=records, block_size=16, ranks=[(0, 0)], replicas=ReplicaRun(
        count=2, front="round_robin", sync=ReplicaSync(enabled=True, delay_ms=25.0), replica_of=replica_of,
        per_replica=rows), chaos=list(chaos))


def records_over_30_s() -> list[RequestRecord]:
    # first arrival at 2 s (time zero); buckets of 10 s from there
    return [
        judged("a", 2.0, 10, 2, 6),    # bucket 0: lost 4, novel 4       (replica 0)
        judged("b", 5.0, 10, 10, 10),  # bucket 0: lost 0, novel 0       (replica 1)
        judged("c", 9.0, 8, 0, 0),     # bucket 0: lost 0, novel 8       (replica 1)
        judged("d", 25.0, 4, 1, 3),    # bucket 2: lost 2, novel 1       (replica 0); bucket 1 empty
        judged("e", 31.9, 4, None, None),  # no truth: not judged
    ]


def test_regret_curves_bucket_the_cluster_and_each_replica():
    data = two_replica_run(records_over_30_s(), {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1},
                           chaos=[ChaosMark(t_s=12.0, action="restart_router", replica=1),
                                  ChaosMark(t_s=7.0, action="delay_kv_events", replica=0, lag_ms=500.0),
                                  ChaosMark(t_s=20.0, action="kill_worker", worker=3)])
    curves = plot_data.regret_curves(data)
    assert curves.bucket_s == 10
    assert list(curves.times) == [5.0, 15.0, 25.0]  # bucket middles, since the first arrival (2 s)
    assert list(curves.lines) == ["cluster", "replica 0", "replica 1"]

    def same(got, want):
        return all((math.isnan(g) and w is None) or g == pytest.approx(w) for g, w in zip(got, want, strict=True))

    assert same(curves.lines["cluster"], [4 / 16, None, 2 / 3])
    assert same(curves.lines["replica 0"], [4 / 8, None, 2 / 3])
    assert same(curves.lines["replica 1"], [0.0, None, None])
    assert curves.overall == {"cluster": pytest.approx(6 / 19), "replica 0": pytest.approx(6 / 11),
                                 "replica 1": 0.0}
    # the overall figures are the summary's (which rounds to 6 digits)
    summary = summarize(data).to_builtins()
    assert curves.overall["cluster"] == pytest.approx(summary["kvemu"]["routing"]["regret"]["regret_ratio"],
                                                         abs=1e-6)
    per = summary["kvemu"]["replicas"]["per_replica"]
    assert [r["regret_ratio"] for r in per] == pytest.approx([6 / 11, 0.0], abs=1e-6)
    # chaos marks by time, since the first arrival, with short labels
    assert curves.marks == [(5.0, "delay_kv_events r0 500 ms"), (10.0, "restart_router r1"),
                               (18.0, "kill_worker w3")]


def test_one_router_gets_the_cluster_line_only_and_no_truth_no_plot():
    curves = plot_data.regret_curves(RunData(records=records_over_30_s(), block_size=16))
    assert list(curves.lines) == ["cluster"] and curves.marks == []
    assert plot_data.regret_curves(sample_run()) is None  # no record has routing truth
    assert plot_data.regret_curves(RunData()) is None


def test_long_runs_are_bucketed_by_the_minute():
    assert [plot_data.regret_bucket_s(s) for s in (0, 59.9, 600, 600.1, 7200)] == [10, 10, 10, 60, 60]
    records = [judged(f"r{i}", 60.0 * i, 4, 0, 1) for i in range(12)]  # 11 minutes
    curves = plot_data.regret_curves(RunData(records=records, block_size=16))
    assert curves.bucket_s == 60 and list(curves.times) == [30.0 + 60 * i for i in range(12)]
    assert list(curves.lines["cluster"]) == [pytest.approx(1 / 4)] * 12


def test_the_regret_plot_is_drawn_with_truth_only(tmp_path):
    data = two_replica_run(records_over_30_s(), {"a": 0, "b": 1, "c": 1, "d": 0},
                           chaos=[ChaosMark(t_s=12.0, action="restart_router", replica=1)])
    for sub in ("with", "again", "without"):
        (tmp_path / sub).mkdir()
    names = write_plots(data, tmp_path / "with")
    assert names == [*PLOTS, plot_drawing.REGRET_PLOT]
    png = (tmp_path / "with" / plot_drawing.REGRET_PLOT).read_bytes()
    assert png[:8] == PNG_SIGNATURE
    write_plots(data, tmp_path / "again")
    assert (tmp_path / "again" / plot_drawing.REGRET_PLOT).read_bytes() == png  # deterministic
    assert write_plots(sample_run(), tmp_path / "without") == list(PLOTS)
    assert not (tmp_path / "without" / plot_drawing.REGRET_PLOT).exists()
    with pytest.raises(ValueError, match="no plot named"):
        plot_drawing.render(plot_data.plot_job(data, tmp_path), ["nope.png"])


def test_the_renderer_process_draws_the_regret_plot_as_in_process(tmp_path, monkeypatch):
    monkeypatch.setattr(plot_renderer, "_usable_cpus", lambda: 2)  # (its fork draws half of the plots)
    data = two_replica_run(records_over_30_s(), {"a": 0, "b": 1, "c": 1, "d": 0})
    write_report(data, tmp_path / "here")
    with background_renderer():
        renderer = plot_renderer._RENDERER
        write_report(data, tmp_path / "there")
        assert renderer is not None and renderer.result()  # the child drew them
    for name in ("report.md", *PLOTS, plot_drawing.REGRET_PLOT):
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "there" / name).read_bytes(), name


def test_report_md_has_a_row_per_replica_and_links_the_plot():
    data = two_replica_run(records_over_30_s(), {"a": 0, "b": 1, "c": 1, "d": 0})
    md = render_markdown(summarize(data), data, [*PLOTS, plot_drawing.REGRET_PLOT])
    section = md.split("## Router replicas", 1)[1].split("\n## ", 1)[0]
    assert "2 router replicas, front `round_robin`, replica sync on, 25.00 ms delay" in section
    assert "[routing_regret.png](routing_regret.png)" in section
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert rows[0].split(" | ")[-1] == "sync announced / applied |"
    # replica, requests, completed, reuse, regret, lost / novel, KV batches, gaps, replays, dropped, restarts, sync
    assert rows[1] == "| 0 | 2 | 2 | 0.0% | 54.5% | 6 / 5 | 10 | 0 | 0 | 0 | 0 | 5 / 7 |"
    assert rows[2] == "| 1 | 2 | 2 | 0.0% | 0.0% | 0 / 8 | 11 | 1 | 2 | 3 | 1 | 6 / 8 |"
    assert "Over time: [routing_regret.png]" in md.split("### Routing regret", 1)[1]
    # without the plot no link; without replicas no section
    assert "routing_regret.png" not in render_markdown(summarize(data), data, PLOTS)
    one = RunData(records=records_over_30_s(), block_size=16, ranks=[(0, 0)])
    assert "## Router replicas" not in render_markdown(summarize(one), one, PLOTS)


SCENARIO_OVERRIDES = ["run.duration_s=12", "cluster.workers=2", "cluster.engine.num_gpu_blocks=192",
                      "workload.rate_rps=2", "workload.turns=3", "workload.think_time_s=0.5",
                      "workload.isl.mean=256", "workload.isl.std=64", "workload.osl.mean=12", "workload.osl.std=4",
                      "workload.system_prefix_tokens=256", "router.replicas=2"]


def test_a_run_with_two_replicas_writes_the_plot_and_the_section(tmp_path):
    text = default_scenario_text() + "chaos: [{at_s: 4, action: restart_router, replica: 1}]\n"
    out = run_scenario(parse_scenario(text, base_dir=tmp_path, overrides=SCENARIO_OVERRIDES), tmp_path / "out")
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {*PLOTS, plot_drawing.REGRET_PLOT} <= files
    md = (tmp_path / "out" / "report.md").read_text()
    section = md.split("## Router replicas", 1)[1].split("\n## ", 1)[0]
    per = json.loads((tmp_path / "out" / "summary.json").read_text())["kvemu"]["replicas"]["per_replica"]
    assert len(per) == 2 and per[1]["restarts"] == 1 and sum(r["requests"] for r in per) == out.summary.num_requests
    for r in per:
        assert f"| {r['replica']} | {r['requests']:,} | {r['completed_requests']:,} |" in section
    curves = plot_data.regret_curves(out.data)
    assert list(curves.lines) == ["cluster", "replica 0", "replica 1"]
    assert [label for _, label in curves.marks] == ["restart_router r1"]
