"""The autoscaler in runs: scaling on a burst, startup delay, custom policies, chaos, both modes, reports."""

import json
import os
import subprocess
import sys
from array import array
from pathlib import Path

import pytest

from tests import autoscale_policies
from harness.report.autoscale import provisioned_seconds
from harness.cli import main
from harness.report.plot_data import plot_job
from harness.report.request_window import RequestWindow, percentiles
from harness.run.runner import run_scenario
from harness.scenario import ScenarioError, load_scenario, parse_scenario
from kvemu.records import RequestRecord
from kvemu.hooks import Hooks

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "autoscale-burst.yaml"
S = 1_000_000_000
MS = 1_000_000

BASE = """
name: as
cluster: {workers: 2, dp_size: 1, engine: {block_size: 16, num_gpu_blocks: 1024}}
router: {policy: round_robin}
workload: {kind: synthetic, rate_rps: 3, turns: 2, think_time_s: 1, system_prefix_tokens: 64,
           isl: {kind: constant, mean: 128}, osl: {kind: constant, mean: 16}}
run: {mode: virtual, seed: 3, duration_s: 10}
"""
SCRIPTED = "autoscaler: {policy: 'tests.autoscale_policies:Scripted', interval_s: 2, startup_delay_s: 3, cooldown_s: 0, " \
           "max_workers: 4}\n"


def running_over_time(log):
    """(time, running workers) of the autoscaled pool at each change of its running count."""
    out = []
    for p in log.series:
        if p.pool == log.pool and (not out or out[-1][1] != p.running):
            out.append((p.time_ns, p.running))
    return out


# ------------------------------------------------------------------------------------------ the built-in policy


def test_the_builtin_scales_up_under_a_burst_and_back_down(tmp_path):
    out = run_scenario(load_scenario(EXAMPLE), tmp_path)
    log = out.data.autoscale
    counts = running_over_time(log)
    assert counts[0] == (0, 2) and counts[-1][1] == 2
    peak_t, peak = max(counts, key=lambda c: c[1])
    assert peak >= 5
    adds = [d for d in log.decisions if d.action == "add" and d.applied]
    removes = [d for d in log.decisions if d.action == "remove" and d.applied]
    assert adds and removes
    assert max(d.time_ns for d in adds) < min(d.time_ns for d in removes)  # up during the burst, down after it
    assert all(d.time_ns <= 20 * S for d in adds)  # arrivals stop at 20 s
    assert all(d.reason for d in adds + removes)
    assert not out.data.failures and not out.data.partial
    summary = json.loads((tmp_path / "summary.json").read_text())
    section = summary["kvemu"]["autoscaler"]
    assert section["workers_added"] == sum(d.applied for d in adds) == len({w for d in adds for w in d.worker_ids})
    assert section["workers_removed"] == sum(d.applied for d in removes)
    assert section["max_running_workers"] == peak
    assert [d["time_s"] for d in section["decisions"]] == [d.time_ns / S for d in log.decisions]
    # GPU time counts the workers each instant held (starting and draining ones too), not the initial 2
    start = min(r.arrival_ns for r in out.data.records)
    held = provisioned_seconds(log.series, "aggregated", start, start + round(summary["duration_ms"] * MS))
    assert summary["decode_worker_seconds"] == pytest.approx(held, rel=1e-5)
    assert 2 * summary["duration_ms"] / 1000 < held < 8 * summary["duration_ms"] / 1000
    report = (tmp_path / "report.md").read_text()
    assert "## Autoscaler" in report and f"{section['workers_added']} workers added" in report
    first = section["decisions"][0]
    assert f"| {first['time_s']:.3f} | {first['action']} {first['applied']}/{first['requested']} |" in report


def test_the_plots_get_the_decisions_and_the_worker_counts(tmp_path):
    out = run_scenario(load_scenario(EXAMPLE))
    log = out.data.autoscale
    marks = plot_job(out.data, tmp_path).autoscale
    assert marks.decisions == [(d.time_ns / S, d.action) for d in log.decisions if d.applied]
    points = [p for p in log.series if p.pool == "aggregated"]
    end = max(s.time_ns for s in out.data.samples)  # the last counts are drawn on to the run's last sample
    assert list(zip(marks.times, marks.running)) == [(p.time_ns / S, p.running) for p in points] + [
        (end / S, points[-1].running)]
    assert all(p >= r for p, r in zip(marks.provisioned, marks.running))
    plain = run_scenario(parse_scenario(BASE))
    assert plot_job(plain.data, tmp_path).autoscale is None


def test_same_scenario_and_seed_give_byte_identical_reports(tmp_path):
    outs = []
    for name in ("a", "b"):  # two processes: no hash seed or set order may leak into a decision
        proc = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(EXAMPLE), "-o", name, "--quiet"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr
        outs.append(tmp_path / name)

    def steady(path, marker):
        return [line for line in path.read_text().splitlines() if marker not in line]

    a, b = (steady(o / "summary.json", '"wall_time_ms"') for o in outs)
    assert a == b and any('"autoscaler"' in line for line in a)
    assert steady(outs[0] / "report.md", "wall time") == steady(outs[1] / "report.md", "wall time")
    assert (outs[0] / "requests.jsonl").read_bytes() == (outs[1] / "requests.jsonl").read_bytes()


# ------------------------------------------------------------------------------------------ custom policies


def test_a_new_worker_takes_no_request_before_its_startup_delay():
    out = run_scenario(parse_scenario(BASE + SCRIPTED))
    log = out.data.autoscale
    [added, removed] = [d for d in log.decisions if d.applied]
    assert (added.time_ns, added.worker_ids, added.ready_ns) == (2 * S, [2], [5 * S])
    served = [r.routed_ns for r in out.data.records if r.worker_id == 2]
    assert served and min(served) >= 5 * S  # round robin: it gets work as soon as it is routable, not before
    seen = {s.now_ns: s.pool for s in autoscale_policies.SEEN}
    assert (seen[4 * S].running, seen[4 * S].starting) == (2, 1)
    assert (seen[6 * S].running, seen[6 * S].starting, seen[6 * S].running_ids) == (3, 0, (0, 1, 2))
    assert removed.time_ns == 6 * S and removed.reason == "scripted: third tick" and len(removed.worker_ids) == 1
    assert running_over_time(log)[:3] == [(0, 2), (5 * S, 3), (6 * S, 2)]


@pytest.mark.parametrize(("policy", "message"), [
    ("nosuchmodule_kvemu:make", "autoscaler.policy: cannot import module 'nosuchmodule_kvemu'"),
    ("tests.autoscale_policies:nothing", "autoscaler.policy: module 'tests.autoscale_policies' has no 'nothing'"),
    ("tests.autoscale_policies:no_decide", "returned object, which has no decide(snapshot) method"),
])
def test_validate_and_run_refuse_a_policy_that_cannot_be_built(tmp_path, capsys, policy, message):
    path = tmp_path / "s.yaml"
    path.write_text(BASE + SCRIPTED.replace("tests.autoscale_policies:Scripted", policy))
    assert main(["validate", str(path)]) == 2
    assert message in capsys.readouterr().err
    assert main(["run", str(path), "-o", str(tmp_path / "out"), "--quiet"]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(ScenarioError, match="autoscaler.policy"):
        run_scenario(load_scenario(path))
    path.write_text(BASE + SCRIPTED)
    assert main(["validate", str(path)]) == 0


@pytest.mark.parametrize(("text", "key"), [
    ("autoscaler: {max_workers: 4, typo: 1}", "autoscaler.typo"),
    ("autoscaler: {min_workers: 5, max_workers: 6}", "autoscaler.min_workers"),
    ("autoscaler: {max_workers: 1}", "autoscaler.max_workers"),
    ("autoscaler: {max_workers: 4, pool: decode}", "autoscaler.pool"),
    ("autoscaler: {max_workers: 4, interval_s: 0}", "autoscaler.interval_s"),
    ("autoscaler: {max_workers: 4, target_kv_usage: 1.5}", "autoscaler.target_kv_usage"),
    ("cluster: {dp_size: 512}\nautoscaler: {max_workers: 20}", "autoscaler.max_workers"),
    ("autoscaler: {max_workers: 4}\nchaos: [{at_s: 1, action: add_worker}, {at_s: 2, action: remove_worker, worker: 4}]",
     "chaos[1].worker"),
])
def test_the_section_is_validated_naming_the_key(text, key):
    with pytest.raises(ScenarioError) as err:
        parse_scenario("name: x\n" + text)
    assert f"{key} (line" in str(err.value)


def test_processes_refuse_an_autoscaler_instead_of_ignoring_it(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(BASE + SCRIPTED)
    assert main(["up", str(path), "-o", str(tmp_path / "out")]) == 2
    assert "autoscaler: not supported with processes" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ chaos


def test_workers_chaos_takes_below_min_workers_are_replaced():
    text = BASE + ("autoscaler: {interval_s: 2, startup_delay_s: 1, cooldown_s: 60, min_workers: 2, max_workers: 4,"
                   " target_queue_per_worker: 1000, target_kv_usage: 1.0}\n"
                   "chaos: [{at_s: 3, action: remove_worker, worker: 1, graceful: false}]\n")
    out = run_scenario(parse_scenario(text))
    [floor] = [d for d in out.data.autoscale.decisions if d.applied]
    assert (floor.time_ns, floor.action, floor.detail, floor.worker_ids, floor.ready_ns) == (
        4 * S, "add", "min_workers floor", [2], [5 * S])
    assert running_over_time(out.data.autoscale)[:3] == [(0, 2), (3 * S, 1), (5 * S, 2)]
    assert not out.data.partial


def test_the_autoscaler_leaves_a_later_chaos_target_alone():
    text = BASE.replace("workers: 2", "workers: 3") + SCRIPTED.replace("max_workers: 4", "max_workers: 5") + (
        "chaos: [{at_s: 7, action: remove_worker, worker: 0}]\n")
    out = run_scenario(parse_scenario(text))
    [removed] = [d for d in out.data.autoscale.decisions if d.action == "remove"]
    assert removed.worker_ids and removed.worker_ids != [0]
    gone = sorted(e.worker_id for e in out.data.worker_events if e.kind == "worker_removed")
    assert gone == sorted([0, *removed.worker_ids]) and not out.data.partial


# ------------------------------------------------------------------------------------------ snapshots


def test_the_window_percentiles_match_a_hand_computed_case():
    hooks = Hooks()
    records = {}
    window = RequestWindow(hooks, records)
    # (id, arrival s, first token ms after arrival, token gaps ms, end s); "a" ends before the window
    for rid, arrival, ttft, gaps, end in [("a", 0.5, 100, [10], 1.0), ("b", 1.5, 200, [20, 40], 2.0),
                                          ("c", 2.5, 300, [30], 3.0), ("d", 3.0, 400, [50], 3.5)]:
        hooks.note("request_arrived", round(arrival * S), rid)
        first = round(arrival * S) + ttft * MS
        times = [first]
        for g in gaps:
            times.append(times[-1] + g * MS)
        records[rid] = RequestRecord(request_id=rid, arrival_ns=round(arrival * S), isl=1, max_tokens=len(times),
                                     first_token_ns=first, token_times_ns=array("q", times), completion_ns=times[-1])
        hooks.note("completed", round(end * S), rid)
    hooks.note("request_arrived", round(3.2 * S), "e")
    hooks.note("failed", round(3.4 * S), "e")
    hooks.note("request_arrived", round(3.5 * S), "f")
    window.prune(round(3.5 * S), round(2.5 * S))  # the window is (1.0 s, 3.5 s]
    ttft, itl, e2e = window.latencies()
    assert sorted(ttft) == [200 * MS, 300 * MS, 400 * MS]
    assert sorted(itl) == [20 * MS, 30 * MS, 40 * MS, 50 * MS]
    assert (len(window.arrivals), len(window.completions), len(window.failures), window.in_flight) == (5, 3, 1, 1)
    p = percentiles(ttft)  # rounded rank: p50 -> index 1, p90 -> round(1.8) = 2
    assert (p.p50, p.p90, p.p99, p.count) == (300.0, 400.0, 400.0, 3)
    assert percentiles(itl).p50 == 40.0 and percentiles([]) is None  # round(1.5) = 2 (halves up)


def test_snapshots_agree_with_the_run():
    out = run_scenario(parse_scenario(BASE + SCRIPTED))
    records = out.data.records
    for snap in autoscale_policies.SEEN:
        lo = snap.now_ns - snap.window_ns
        done = [r for r in records if r.done and lo < r.completion_ns <= snap.now_ns]
        assert snap.completed == len(done)
        if done:
            ttft = sorted(r.first_token_ns - r.arrival_ns for r in done)
            assert snap.ttft_ms.p90 == ttft[round((len(ttft) - 1) * 0.9 + 1e-9)] / MS
        assert snap.arrivals == sum(lo < r.arrival_ns <= snap.now_ns for r in records)
        pool = snap.pool
        assert [k.worker_id for k in pool.kv] == list(pool.running_ids)  # one rank each
        assert sum(pool.active_by_worker.values()) <= pool.active_requests
        assert all(0 <= k.usage <= 1 for k in pool.kv)
        assert snap.in_flight >= pool.active_requests - pool.router_queue


# ------------------------------------------------------------------------------------------ live


def test_live_mode_runs_the_same_autoscaler_on_the_wall_clock():
    text = BASE.replace("mode: virtual", "mode: live").replace("duration_s: 10", "duration_s: 1.5") \
        .replace("think_time_s: 1", "think_time_s: 0.5") \
        .replace("num_gpu_blocks: 1024", "num_gpu_blocks: 1024, speedup_ratio: 20") + \
        SCRIPTED.replace("interval_s: 2, startup_delay_s: 3", "interval_s: 0.4, startup_delay_s: 0.2")
    out = run_scenario(parse_scenario(text))
    assert not out.data.partial and not out.data.failures
    [added, removed] = [d for d in out.data.autoscale.decisions if d.applied]
    assert added.worker_ids == [2] and added.ready_ns[0] - added.time_ns >= 200 * MS
    assert removed.time_ns > added.ready_ns[0] and len(removed.worker_ids) == 1
    assert max(n for _, n in running_over_time(out.data.autoscale)) == 3
