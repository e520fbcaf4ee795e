"""Short virtual runs end to end: report contents, routing-truth consistency, determinism, policy comparison.

The trace replayed here is a small one generated into tmp_path (never the real Mooncake trace).
"""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from harness.report.files import write_requests
from harness.report.plots import PLOTS
from harness.report.summary import LATENCY_METRICS, STATS, dumps_summary, summarize
from harness.run.runner import run_scenario
from harness.scenario import default_scenario_text, load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[2]

REFERENCE_KEYS = {
    "num_requests", "completed_requests", "total_input_tokens", "total_output_tokens", "duration_ms",
    "wall_time_ms", "request_throughput_rps", "input_throughput_tok_s", "output_throughput_tok_s",
    "total_throughput_tok_s", "prefix_cache_reused_ratio",
} | {
    f"{stat}_{m}" if m == "output_token_throughput_per_user" else f"{stat}_{m}_ms"
    for m in LATENCY_METRICS for stat in STATS
}


def make_trace(path: Path, *, rows: int = 60, groups: int = 6, step_ms: float = 97.0, seed: int = 1) -> Path:
    """Rows whose prompts start with one of ``groups`` shared 3-block prefixes, then 1-2 blocks of their own."""
    rng = random.Random(seed)
    lines = []
    for i in range(rows):
        g = rng.randrange(groups)
        own = [10_000 + 10 * i + k for k in range(rng.randint(1, 2))]
        ids = [100 * g + 1, 100 * g + 2, 100 * g + 3, *own]
        lines.append(json.dumps({"timestamp": round(i * step_ms, 3), "input_length": len(ids) * 32 - rng.randrange(20),
                                 "output_length": rng.randint(2, 12), "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def trace_scenario_text(policy: str = "kv", workers: int = 3, dp_size: int = 2) -> str:
    return f"""
name: small-trace
cluster:
  workers: {workers}
  dp_size: {dp_size}
  engine: {{num_gpu_blocks: 96, block_size: 16, max_num_batched_tokens: 512, max_num_seqs: 8}}
router:
  policy: {policy}
workload:
  kind: trace
  trace: trace.jsonl
  trace_block_size: 32
run:
  seed: 3
"""


SYNTHETIC_OVERRIDES = ["run.duration_s=6", "cluster.workers=2", "cluster.engine.num_gpu_blocks=192",
                       "workload.rate_rps=1.5", "workload.turns=3", "workload.think_time_s=0.5",
                       "workload.isl.mean=256", "workload.isl.std=64", "workload.osl.mean=12", "workload.osl.std=4",
                       "workload.system_prefix_tokens=256"]


@pytest.fixture(scope="module")
def trace_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("trace-run")
    make_trace(d / "trace.jsonl")
    (d / "scenario.yaml").write_text(trace_scenario_text())
    out = run_scenario(load_scenario(d / "scenario.yaml"), d / "out")
    return d, out


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("synthetic-run")
    scenario = parse_scenario(default_scenario_text(), base_dir=d, overrides=SYNTHETIC_OVERRIDES)
    out = run_scenario(scenario, d / "out")
    return d, out


def without_wall_time(text: str) -> str:
    """summary.json text without its one line that may differ between identical runs."""
    lines = text.splitlines(keepends=True)
    kept = [line for line in lines if not line.startswith('  "wall_time_ms": ')]
    assert len(kept) == len(lines) - 1
    return "".join(kept)


# ------------------------------------------------------------------------------------------ report


@pytest.mark.parametrize("which", ["trace_run", "synthetic_run"])
def test_report_files_and_summary_keys(which, request):
    d, out = request.getfixturevalue(which)
    files = {p.name for p in (d / "out").iterdir()}
    assert {"summary.json", "requests.jsonl", "report.md", *PLOTS} <= files
    summary = json.loads((d / "out" / "summary.json").read_text())
    assert summary == out.summary.to_builtins()
    assert REFERENCE_KEYS <= set(summary)
    assert summary["partial"] is False
    assert summary["num_requests"] > 10
    assert summary["completed_requests"] == summary["num_requests"]
    assert summary["kvemu"]["failed_requests"] == 0 and summary["kvemu"]["unfinished_requests"] == 0
    for key in REFERENCE_KEYS:
        assert summary[key] is not None, key
    assert 0 < summary["prefix_cache_reused_ratio"] < 1
    assert summary["min_ttft_ms"] <= summary["median_ttft_ms"] <= summary["p99_ttft_ms"] <= summary["max_ttft_ms"]
    report = (d / "out" / "report.md").read_text()
    assert report.startswith("# kvemu run: ") and "## Routing truth" in report and "## Per rank" in report


@pytest.mark.parametrize("which", ["trace_run", "synthetic_run"])
def test_requests_jsonl_agrees_with_the_summary(which, request):
    d, out = request.getfixturevalue(which)
    summary = out.summary.to_builtins()
    lines = (d / "out" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == summary["num_requests"]
    records = [json.loads(line) for line in lines]
    assert len({r["request_id"] for r in records}) == len(records)
    assert [(r["arrival_ns"], r["request_id"]) for r in records] == sorted((r["arrival_ns"], r["request_id"])
                                                                           for r in records)
    assert sum(r["isl"] for r in records) == summary["total_input_tokens"]
    assert sum(len(r["token_times_ns"]) for r in records) == summary["total_output_tokens"]
    assert all(len(r["token_times_ns"]) == r["max_tokens"] for r in records)
    cached = sum(r["engine_cached_tokens"] for r in records)
    assert summary["prefix_cache_reused_ratio"] == pytest.approx(cached / summary["total_input_tokens"], rel=1e-5)
    ttft = [(r["token_times_ns"][0] - r["arrival_ns"]) / 1e6 for r in records]
    assert summary["mean_ttft_ms"] == pytest.approx(sum(ttft) / len(ttft), rel=1e-5)
    assert summary["max_ttft_ms"] == pytest.approx(max(ttft), rel=1e-5)


@pytest.mark.parametrize("which", ["trace_run", "synthetic_run"])
def test_every_rank_appears_in_per_rank(which, request):
    d, out = request.getfixturevalue(which)
    summary = out.summary.to_builtins()
    data = out.data
    per_rank = summary["kvemu"]["per_rank"]
    workers = 3 if which == "trace_run" else 2
    assert [(r["worker_id"], r["dp_rank"]) for r in per_rank] == [(w, r) for w in range(workers) for r in range(2)]
    assert sorted(map(tuple, data.ranks)) == [(w, r) for w in range(workers) for r in range(2)]
    assert sum(r["requests"] for r in per_rank) == summary["num_requests"]
    assert sum(r["completed_requests"] for r in per_rank) == summary["completed_requests"]
    assert sum(r["input_tokens"] for r in per_rank) == summary["total_input_tokens"]
    assert sum(r["output_tokens"] for r in per_rank) == summary["total_output_tokens"]
    records = [json.loads(line) for line in (d / "out" / "requests.jsonl").read_text().splitlines()]
    for row in per_rank:
        mine = [r for r in records if (r["worker_id"], r["dp_rank"]) == (row["worker_id"], row["dp_rank"])]
        assert row["requests"] == len(mine)


@pytest.mark.parametrize("which", ["trace_run", "synthetic_run"])
def test_routing_truth_numbers_are_consistent(which, request):
    d, out = request.getfixturevalue(which)
    summary = out.summary.to_builtins()
    rt = summary["kvemu"]["routing"]
    records = [json.loads(line) for line in (d / "out" / "requests.jsonl").read_text().splitlines()]
    n = summary["num_requests"]
    assert rt["routed_requests"] == n and rt["requests_compared"] == summary["completed_requests"]
    assert sum(rt["reasons"].values()) == n
    assert rt["engine_cached_tokens"] == sum(r["engine_cached_tokens"] for r in records)
    bs = summary["kvemu"]["block_size"]
    assert rt["predicted_cached_tokens"] == sum(min(r["predicted_overlap_blocks"] * bs, r["isl"]) for r in records)
    assert rt["selection_overlap_blocks"] == sum(r["predicted_overlap_blocks"] for r in records)
    assert rt["best_overlap_blocks"] == sum(r["best_overlap_blocks"] for r in records)
    assert all(r["predicted_overlap_blocks"] <= r["best_overlap_blocks"] for r in records)
    assert rt["overestimated_requests"] + rt["underestimated_requests"] <= rt["requests_compared"]
    if rt["predicted_cached_tokens"]:
        assert rt["engine_to_predicted_ratio"] == pytest.approx(
            rt["engine_cached_tokens"] / rt["predicted_cached_tokens"], rel=1e-5)
    if rt["best_overlap_blocks"]:
        assert rt["selection_to_best_ratio"] == pytest.approx(
            rt["selection_overlap_blocks"] / rt["best_overlap_blocks"], rel=1e-5)
    assert rt["mean_attempts"] == 1 and rt["dispatch_rejections"] == 0
    hooks = summary["kvemu"]["hook_counts"]
    assert hooks["request_arrived"] == hooks["completed"] == n


def test_synthetic_run_exercises_sub_agents_and_affinity(synthetic_run):
    _, out = synthetic_run
    summary = out.summary.to_builtins()
    records = out.data.records
    subs = [r for r in records if r.parent_session_id is not None]
    assert subs and all("-a" in r.request_id for r in subs)
    affinity = summary["kvemu"]["affinity"]
    assert affinity is not None and affinity["binds"] > 0 and affinity["hits"] > 0


# ------------------------------------------------------------------------------------- determinism


def test_two_runs_in_one_process_give_identical_reports(trace_run):
    d, _ = trace_run
    again = run_scenario(load_scenario(d / "scenario.yaml"), None)
    a = without_wall_time((d / "out" / "summary.json").read_text())
    b = without_wall_time(dumps_summary(summarize(again.data)))
    assert a == b
    write_requests(again.data.records, d / "again.jsonl")
    assert (d / "again.jsonl").read_bytes() == (d / "out" / "requests.jsonl").read_bytes()


def test_synthetic_sessions_are_deterministic_too(synthetic_run):
    d, _ = synthetic_run
    again = run_scenario(parse_scenario(default_scenario_text(), base_dir=d, overrides=SYNTHETIC_OVERRIDES), None)
    assert without_wall_time(dumps_summary(summarize(again.data))) == without_wall_time(
        (d / "out" / "summary.json").read_text())
    other_seed = run_scenario(parse_scenario(default_scenario_text(), base_dir=d,
                                             overrides=[*SYNTHETIC_OVERRIDES, "run.seed=8"]), None)
    assert dumps_summary(summarize(other_seed.data)) != dumps_summary(summarize(again.data))


def test_the_quickstart_twice_differs_only_where_the_readme_says(tmp_path):
    """README: requests.jsonl byte for byte; summary.json except its wall-clock keys, which it names."""
    import msgspec

    from harness.report.summary import WALL_CLOCK_KEYS

    outcomes = [run_scenario(load_scenario(ROOT / "examples" / "quickstart.yaml", ["run.duration_s=10"]),
                             tmp_path / name) for name in ("a", "b")]
    a, b = (json.loads((tmp_path / name / "summary.json").read_text()) for name in ("a", "b"))
    assert a["num_requests"] > 50 and set(WALL_CLOCK_KEYS) <= set(a)
    for key in WALL_CLOCK_KEYS:
        del a[key], b[key]
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert (tmp_path / "a" / "requests.jsonl").read_bytes() == (tmp_path / "b" / "requests.jsonl").read_bytes()
    # the list is complete: a run's only wall-clock figure changes exactly these keys
    data = outcomes[0].data
    slower = summarize(msgspec.structs.replace(data, wall_time_ns=data.wall_time_ns * 3 + 12_345_678)).to_builtins()
    assert {k for k, v in summarize(data).to_builtins().items() if slower[k] != v} == set(WALL_CLOCK_KEYS)
    readme = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    keys = ", ".join(f"`{k}`" for k in WALL_CLOCK_KEYS)
    assert (f"byte-identical `requests.jsonl` on every run, and the same `summary.json` except its one wall-clock "
            f"key, {keys} (`harness.report.summary.WALL_CLOCK_KEYS`)") in readme
    assert "byte-identical `summary.json`" not in readme


def test_two_processes_give_identical_reports(tmp_path):
    make_trace(tmp_path / "trace.jsonl", rows=30)
    (tmp_path / "scenario.yaml").write_text(trace_scenario_text(workers=2, dp_size=1))
    outs = []
    for name in ("a", "b"):
        proc = subprocess.run([sys.executable, "-m", "harness.cli", "run", "scenario.yaml", "-o", name, "--quiet"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        outs.append(tmp_path / name)
    a, b = ((o / "summary.json").read_text() for o in outs)
    assert a != "" and without_wall_time(a) == without_wall_time(b)
    assert json.loads(a)["num_requests"] == 30
    assert (outs[0] / "requests.jsonl").read_bytes() == (outs[1] / "requests.jsonl").read_bytes()


# ---------------------------------------------------------------------------------------- policies


def test_kv_routing_reuses_at_least_as_much_prefix_as_round_robin(tmp_path):
    make_trace(tmp_path / "trace.jsonl", rows=80, groups=8, step_ms=61.0, seed=5)
    results = {}
    for policy in ("round_robin", "kv"):
        scenario = parse_scenario(trace_scenario_text(policy=policy, workers=4, dp_size=1), base_dir=tmp_path,
                                  overrides=["cluster.engine.num_gpu_blocks=512"])
        out = run_scenario(scenario, None)
        results[policy] = summarize(out.data).to_builtins()
    rr, kv = results["round_robin"], results["kv"]
    assert rr["completed_requests"] == kv["completed_requests"] == 80
    assert rr["kvemu"]["routing"]["reasons"] == {"policy": 80}
    assert kv["kvemu"]["routing"]["reasons"] == {"cost": 80}
    assert kv["prefix_cache_reused_ratio"] >= rr["prefix_cache_reused_ratio"]
    assert kv["prefix_cache_reused_ratio"] > 0.3
    # every request lands on a rank that had the deepest cached prefix the router saw
    assert kv["kvemu"]["routing"]["selection_to_best_ratio"] >= rr["kvemu"]["routing"]["selection_to_best_ratio"]


def test_kv_routing_sees_the_load_of_earlier_requests_of_the_same_instant(tmp_path):
    rows = [{"timestamp": 0, "input_length": 128, "output_length": 4, "hash_ids": [1, 2, 3, 4]}]
    rows += [{"timestamp": 1000, "input_length": 128, "output_length": 4, "hash_ids": [1, 2, 3, 100 + i]}
             for i in range(12)]
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    scenario = parse_scenario(trace_scenario_text(workers=4, dp_size=1), base_dir=tmp_path)
    out = run_scenario(scenario, None)
    burst = [r.worker_id for r in out.data.records if r.arrival_ns >= 1_000_000_000]
    assert len(burst) == 12
    # the first burst request goes to the rank holding the prefix; its booked load must steer later ones away
    assert max(burst.count(w) for w in set(burst)) <= 8, burst


@pytest.mark.parametrize("vocab", [1, 2, 3, 1000, 32000, 2**17 + 1])
def test_synthetic_tokens_are_the_randrange_stream_drawn_in_bulk(vocab):
    """Same values and same generator state as one ``randrange`` per token: seeds keep their workloads."""
    import random

    from harness.workload.build import _tokens

    a, b = random.Random(5), random.Random(5)
    for count in (0, 1, 7, 500):
        assert _tokens(a, vocab, count) == [b.randrange(vocab) for _ in range(count)]
    assert a.random() == b.random()


def test_closed_loop_keeps_at_most_n_sessions_in_flight_and_fills_every_slot():
    """``workload.concurrency``: synthetic sessions (turns, think times, sub-agents) start as slots free."""
    scenario = parse_scenario(default_scenario_text(), overrides=["workload.concurrency=3", "run.duration_s=20",
                                                                  "run.sla.ttft_ms=200"])
    data = run_scenario(scenario, None).data
    spans: dict[str, list[int]] = {}
    for r in data.records:
        assert r.done, r
        sid = r.session_id or r.parent_session_id
        span = spans.setdefault(sid, [r.arrival_ns, r.completion_ns])
        span[0], span[1] = min(span[0], r.arrival_ns), max(span[1], r.completion_ns)
    starts = sorted(s for s, _ in spans.values())
    assert starts[:3] == [0, 0, 0] and len(spans) > 3
    ends = sorted(e for _, e in spans.values())
    assert starts[3:] == ends[: len(starts) - 3]  # each later session starts the moment one ended
    summary = summarize(data)
    assert summary.kvemu.concurrency == 3 and 0 < summary.goodput_completed_requests <= len(data.records)


def test_a_speculative_run_reports_its_bursts_and_the_gaps_between_passes(tmp_path):
    make_trace(tmp_path / "trace.jsonl", rows=40)
    spec = "{method: eagle, num_speculative_tokens: 3, acceptance_rates: [0.9, 0.7, 0.5], draft_cost: 0.1}"
    scenario = parse_scenario(trace_scenario_text(), base_dir=tmp_path,
                              overrides=[f"cluster.engine.speculative={spec}"])
    out = run_scenario(scenario, tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    section = summary["kvemu"]["speculative"]
    rows = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    times = [r["token_times_ns"] for r in rows if r.get("token_times_ns")]
    # the first token comes alone; every later pass stamps all its tokens with its end
    passes = sum(len(set(t[1:]) - {t[0]}) for t in times)
    tokens = sum(len(t) - 1 for t in times)
    assert (section["decode_tokens"], section["decode_passes"]) == (tokens, passes) and passes < tokens
    assert section["tokens_per_decode_pass"] == pytest.approx(tokens / passes, rel=1e-5)
    assert section["expected_tokens_per_decode_pass"] == pytest.approx(1 + 0.9 + 0.9 * 0.7 + 0.9 * 0.7 * 0.5)
    assert section["conditional_acceptance_rates"] == [0.9, 0.7, 0.5] and section["method"] == "eagle"
    gaps = sorted(b - a for t in times for a, b in zip(t, t[1:]) if b > a)
    assert section["itl_per_pass_ms"]["max"] == pytest.approx(gaps[-1] / 1e6, rel=1e-5)
    assert summary["min_itl_ms"] == 0  # a burst's tokens are 0 ms apart
    assert "Speculative decoding (eagle, 3 draft tokens)" in (tmp_path / "out" / "report.md").read_text()
    assert out.data.speculative is not None


def test_a_run_without_speculative_decoding_has_no_such_section(trace_run):
    d, _ = trace_run
    assert "speculative" not in json.loads((d / "out" / "summary.json").read_text())["kvemu"]
