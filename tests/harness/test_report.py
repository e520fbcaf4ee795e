"""The report writer of ``kvemu run`` and ``kvemu compare``: exact metrics from hand-built runs."""

import json
import math
import random
import statistics
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.report.compare import compare, main as compare_main
from kvemu import RequestRecord
from kvemu.records import JSONL_COLUMNS, EngineFacts
from harness.report.files import write_report
from harness.report.plots import PLOTS
from harness.report.recorder import WorkerEvent
from harness.report.run_data import RunData, Sample
from harness.report.summary import summarize
from harness.report.stats import percentile

MS = 1_000_000
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def ms(*values: float) -> list[int]:
    return [int(v * MS) for v in values]


def rec(rid: str, arrival: float, isl: int, worker: int | None, rank: int | None, tokens: list[float], *,
        pred: int | None = None, best: int | None = None, engine: int | None = None, failure: str | None = None,
        attempts: int = 1, reason: str | None = "best", queued: float | None = None,
        dispatch: float | None = None) -> RequestRecord:
    times = ms(*tokens)
    return RequestRecord(
        request_id=rid, arrival_ns=int(arrival * MS), isl=isl, max_tokens=len(times), worker_id=worker,
        dp_rank=rank, attempts=attempts, routing_reason=reason, predicted_overlap_blocks=pred,
        best_overlap_blocks=best, engine=EngineFacts(cached_tokens=None if failure else engine),
        first_token_ns=times[0] if times else None, token_times_ns=times,
        completion_ns=None if failure or not times else times[-1], failure=failure,
        queued_ns=None if queued is None else int(queued * MS),
        dispatch_ns=None if dispatch is None else int(dispatch * MS),
    )


def sample_run(**overrides) -> RunData:
    """Three completed requests, one failed, on ranks (1,0) and (1,1); rank (2,0) is idle."""
    records = [
        # ttft 100, ttst 10, tpot 15, itl 10 20, e2e 130, 2 tok / 30 ms; predicts 64 tokens, engine 48
        rec("a", 0, 100, 1, 0, [100, 110, 130], pred=4, best=4, engine=48, queued=0, dispatch=5),
        # ttft 50, ttst 40, tpot 40, itl 40 40 40, e2e 170, 3 tok / 120 ms; predicts 320 -> capped at 200
        rec("b", 10, 200, 1, 1, [60, 100, 140, 180], pred=20, best=20, engine=100, attempts=2,
            queued=10, dispatch=30),
        # a single token: ttft 200, e2e 200, no ttst/tpot/itl/per-user
        rec("c", 20, 50, 1, 0, [220], pred=0, best=2, engine=16, reason="load"),
        rec("d", 30, 80, 1, 1, [100], pred=3, best=5, failure="worker_removed: worker 1 left"),
    ]
    fields = dict(
        records=records, scenario_name="unit", mode="virtual", seed=7, wall_time_ns=12 * MS, block_size=16,
        ranks=[(1, 0), (1, 1), (2, 0)],
        samples=[Sample(0, 1, 0, 1, 10), Sample(100 * MS, 1, 0, 2, 20), Sample(0, 1, 1, 2, 30),
                 Sample(100 * MS, 1, 1, 2, 30), Sample(0, 2, 0, 0, 0), Sample(100 * MS, 2, 0, 0, 0)],
        kv_stats={1: {"batches": 5, "events": 9, "blocks_stored": 12, "gaps": 1},
                  2: {"batches": 1, "events": 1, "blocks_stored": 2}},
        affinity={"binds": 2, "hits": 1, "waits": 0, "rebinds": 0, "releases": 2, "expirations": 0,
                  "invalidations": 0, "mismatches": 0},
        counters={"queued": 2, "dispatch_rejected": 1},
        failures={"worker_removed": 1},
        worker_events=[WorkerEvent(kind="worker_removed", time_ns=90 * MS, worker_id=1)],
    )
    fields.update(overrides)
    return RunData(**fields)


def r6(x: float) -> float:
    return float(f"{x:.6g}")


def test_summary_percentiles_are_the_shared_rounded_rank_definition():
    """Every summary percentile is ``harness.report.stats.percentile`` (Dynamo's rounded rank), never interpolated."""
    rng = random.Random(3)
    for n in (1, 2, 3, 10, 101):
        ttfts = [rng.uniform(1, 100) for _ in range(n)]
        records = [rec(f"r{i}", 0, 10, 1, 0, [t]) for i, t in enumerate(ttfts)]
        s = summarize(sample_run(records=records)).to_builtins()
        exact = sorted(int(t * MS) / MS for t in ttfts)  # rec() truncates to whole ns
        for key, q in (("median", 50), ("p75", 75), ("p90", 90), ("p95", 95), ("p99", 99)):
            assert s[f"{key}_ttft_ms"] == r6(percentile(exact, q))
            assert s[f"{key}_ttft_ms"] in {r6(v) for v in exact}  # always one of the observed values


def test_latency_metrics_are_exact():
    s = summarize(sample_run()).to_builtins()
    ttft = [50, 100, 200]
    assert s["mean_ttft_ms"] == r6(350 / 3)
    assert (s["min_ttft_ms"], s["max_ttft_ms"], s["median_ttft_ms"]) == (50, 200, 100)
    # rounded rank over 3 values: ranks 1.5, 1.8, 1.9, 1.98 all round to the largest
    assert (s["p75_ttft_ms"], s["p90_ttft_ms"], s["p95_ttft_ms"], s["p99_ttft_ms"]) == (200, 200, 200, 200)
    assert s["std_ttft_ms"] == r6(statistics.pstdev(ttft))
    # second token - first token, requests with >= 2 tokens
    assert (s["mean_ttst_ms"], s["min_ttst_ms"], s["max_ttst_ms"], s["p90_ttst_ms"]) == (25, 10, 40, 40)
    # (completion - first token) / (tokens - 1)
    assert (s["mean_tpot_ms"], s["min_tpot_ms"], s["max_tpot_ms"]) == (27.5, 15, 40)
    # every gap pooled over requests: 10 20 | 40 40 40
    assert (s["mean_itl_ms"], s["min_itl_ms"], s["max_itl_ms"], s["median_itl_ms"]) == (30, 10, 40, 40)
    assert s["std_itl_ms"] == r6(statistics.pstdev([10, 20, 40, 40, 40]))
    assert (s["mean_e2e_latency_ms"], s["median_e2e_latency_ms"]) == (r6(500 / 3), 170)
    assert s["min_e2e_latency_ms"] == 130 and s["max_e2e_latency_ms"] == 200
    # (tokens - 1) / decode time, tok/s, no _ms suffix
    assert s["max_output_token_throughput_per_user"] == r6(2 / 0.030)
    assert s["min_output_token_throughput_per_user"] == 25
    assert s["mean_output_token_throughput_per_user"] == r6((2 / 0.030 + 25) / 2)
    assert "mean_output_token_throughput_per_user_ms" not in s


def test_totals_throughput_and_prefix_reuse():
    s = summarize(sample_run()).to_builtins()
    assert s["num_requests"] == 4 and s["completed_requests"] == 3
    assert s["total_input_tokens"] == 350 and s["total_output_tokens"] == 8  # completed requests only
    assert s["duration_ms"] == 220 and s["wall_time_ms"] == 12
    assert s["request_throughput_rps"] == r6(3 / 0.22)
    assert s["input_throughput_tok_s"] == r6(350 / 0.22)
    assert s["output_throughput_tok_s"] == r6(8 / 0.22)
    assert s["total_throughput_tok_s"] == r6(358 / 0.22)
    assert s["prefix_cache_reused_ratio"] == r6((48 + 100 + 16) / 350)
    assert s["partial"] is False
    k = s["kvemu"]
    assert (k["scenario"], k["mode"], k["seed"], k["partial"]) == ("unit", "virtual", 7, False)
    assert k["failed_requests"] == 1 and k["failed_requests_by_reason"] == {"worker_removed": 1}


def test_per_rank_rows_include_idle_ranks():
    rows = summarize(sample_run()).to_builtins()["kvemu"]["per_rank"]
    assert [(r["worker_id"], r["dp_rank"]) for r in rows] == [(1, 0), (1, 1), (2, 0)]
    r10, r11, r20 = rows
    assert (r10["requests"], r10["completed_requests"], r10["input_tokens"], r10["output_tokens"]) == (2, 2, 150, 4)
    assert r10["prefix_cache_reused_ratio"] == r6(64 / 150)
    assert (r10["mean_active_requests"], r10["max_active_requests"], r10["max_kv_blocks"]) == (1.5, 2, 20)
    assert (r11["requests"], r11["completed_requests"], r11["failed_requests"]) == (2, 1, 1)
    assert r11["prefix_cache_reused_ratio"] == 0.5 and r11["output_tokens"] == 5
    assert r20["requests"] == 0 and r20["prefix_cache_reused_ratio"] is None
    assert r20["max_active_requests"] == 0 and r20["max_kv_blocks"] == 0
    # a rank with neither requests nor samples still shows
    rows = summarize(sample_run(ranks=[(1, 0), (1, 1), (2, 0), (3, 1)], samples=[])).to_builtins()["kvemu"]["per_rank"]
    assert rows[-1]["worker_id"] == 3 and rows[-1]["requests"] == 0 and rows[-1]["mean_active_requests"] is None


def test_predicted_vs_engine_cache():
    rt = summarize(sample_run()).to_builtins()["kvemu"]["routing"]
    assert rt["requests_compared"] == 3
    assert rt["predicted_cached_tokens"] == 64 + 200 + 0  # overlap blocks x 16, capped at the prompt
    assert rt["engine_cached_tokens"] == 48 + 100 + 16
    assert rt["engine_to_predicted_ratio"] == r6(164 / 264)
    assert rt["mean_abs_diff_tokens"] == r6((16 + 100 + 16) / 3)
    assert (rt["overestimated_requests"], rt["underestimated_requests"]) == (2, 1)
    assert (rt["selection_overlap_blocks"], rt["best_overlap_blocks"]) == (27, 31)
    assert rt["selection_to_best_ratio"] == r6(27 / 31)
    assert rt["reasons"] == {"best": 3, "load": 1}
    assert rt["mean_attempts"] == 1.25 and rt["retried_requests"] == 1 and rt["dispatch_rejections"] == 1


def test_queue_affinity_and_kv_sections():
    k = summarize(sample_run()).to_builtins()["kvemu"]
    q = k["queue"]
    assert (q["queued_requests"], q["queued_events"], q["mean_queue_wait_ms"]) == (2, 2, 12.5)
    assert q["p99_queue_wait_ms"] == 20 and q["max_queue_wait_ms"] == 20  # waits 5, 20: rank 0.99 -> 1
    assert k["affinity"]["binds"] == 2 and list(k["affinity"]) == sorted(k["affinity"])
    kv = k["kv_events"]
    assert [w["worker_id"] for w in kv["per_worker"]] == [1, 2]
    assert kv["totals"]["batches"] == 6 and kv["totals"]["blocks_stored"] == 14 and kv["totals"]["lost_batches"] == 0
    assert k["worker_events"] == {"worker_removed": 1}


def _no_nan(obj) -> None:
    if isinstance(obj, float):
        assert math.isfinite(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _no_nan(v)
    elif isinstance(obj, list):
        for v in obj:
            _no_nan(v)


@pytest.mark.parametrize("records", [[], [rec("x", 0, 10, None, None, [], failure="no_endpoints", reason=None,
                                               attempts=0)]], ids=["empty", "failed-only"])
def test_empty_and_failed_only_runs_give_strict_json(tmp_path, records):
    data = RunData(records=records, ranks=[(0, 0)], affinity=None)
    summary = write_report(data, tmp_path).to_builtins()
    text = (tmp_path / "summary.json").read_text()
    parsed = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert parsed == summary
    _no_nan(parsed)
    assert parsed["completed_requests"] == 0 and parsed["mean_ttft_ms"] is None
    assert parsed["request_throughput_rps"] is None and parsed["prefix_cache_reused_ratio"] is None
    assert parsed["kvemu"]["per_rank"][0]["requests"] == 0
    if records:
        assert parsed["kvemu"]["failed_requests_by_reason"] == {"no_endpoints": 1}
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE


def test_identical_input_gives_identical_files(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_report(sample_run(), a)
    write_report(sample_run(), b)
    for name in ("summary.json", "requests.jsonl", "report.md", *PLOTS):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    text = (a / "summary.json").read_text()
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"


def test_requests_jsonl_one_line_per_request_by_arrival_then_id(tmp_path):
    records = sample_run().records + [rec("a0", 10, 5, 1, 0, [50], engine=0)]
    random.Random(1).shuffle(records)
    write_report(sample_run(records=records), tmp_path)
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 5
    rows = [json.loads(line) for line in lines]
    assert [r["request_id"] for r in rows] == ["a", "a0", "b", "c", "d"]
    assert list(rows[0]) == list(JSONL_COLUMNS)  # the engine's facts as flat columns, in the record's order
    assert rows[0]["token_times_ns"] == ms(100, 110, 130) and "engine" not in rows[0]


def test_report_md_sections_and_partial_flag(tmp_path):
    summary = write_report(sample_run(), tmp_path / "full")
    md = (tmp_path / "full" / "report.md").read_text()
    assert "PARTIAL" not in md
    for needle in ("unit", "Per rank", "Routing truth", "affinity", "queue", "KV events", "Failures",
                   "worker_removed", "Ranks that served no request: 2/0"):
        assert needle.lower() in md.lower(), needle
    for name in PLOTS:
        assert f"]({name})" in md
    assert summary.partial is False

    summary = write_report(sample_run(partial=True), tmp_path / "part")
    md = (tmp_path / "part" / "report.md").read_text()
    assert "PARTIAL RUN" in md.split("\n## ", 1)[0]  # before the first section
    assert summary.partial is True and summary.kvemu.partial is True
    assert json.loads((tmp_path / "part" / "summary.json").read_text())["partial"] is True


def test_plots_are_valid_pngs(tmp_path):
    write_report(sample_run(), tmp_path)
    for name in PLOTS:
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", name
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        if "cdf" in name:
            assert (width, height) == (800, 450), name
        else:  # room right of the axes for the legend; per-rank plots grow with their pools and ranks
            assert width > 800 and 400 <= height <= 1600, name


def test_compare_shows_deltas_and_missing_keys(tmp_path, capsys):
    write_report(sample_run(), tmp_path / "a")
    faster = [rec("a", 0, 100, 1, 0, [50, 60, 80], pred=4, best=4, engine=48)] + sample_run().records[1:]
    write_report(sample_run(records=faster), tmp_path / "b")
    summary_b = json.loads((tmp_path / "b" / "summary.json").read_text())
    del summary_b["wall_time_ms"]
    summary_b["extra_metric"] = 3
    (tmp_path / "b" / "summary.json").write_text(json.dumps(summary_b))

    table = compare(tmp_path / "a", tmp_path / "b")
    line = next(ln for ln in table.splitlines() if ln.startswith("min_ttft_ms "))
    assert line.split() == ["min_ttft_ms", "50", "50", "+0", "+0.0%"]
    line = next(ln for ln in table.splitlines() if ln.startswith("max_e2e_latency_ms "))
    assert line.split() == ["max_e2e_latency_ms", "200", "200", "+0", "+0.0%"]
    line = next(ln for ln in table.splitlines() if ln.startswith("median_ttft_ms "))
    assert line.split() == ["median_ttft_ms", "100", "50", "-50", "-50.0%"]
    assert next(ln for ln in table.splitlines() if ln.startswith("wall_time_ms ")).split()[2:] == ["—"] * 3
    assert next(ln for ln in table.splitlines() if ln.startswith("extra_metric ")).split()[1] == "—"
    assert "kvemu" not in [ln.split()[0] for ln in table.splitlines() if ln.strip()]

    assert compare_main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "median_ttft_ms" in capsys.readouterr().out
    assert compare_main([str(tmp_path / "a"), str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "no summary.json" in err and "nowhere" in err


def test_twelve_thousand_records_are_fast(tmp_path):
    rng = random.Random(5)
    ranks = [(w, r) for w in range(8) for r in range(2)]
    records = []
    for i in range(12_000):
        first = i * 10 * MS + rng.randint(10, 500) * MS
        times = [first]
        for _ in range(rng.randint(0, 250)):
            times.append(times[-1] + rng.randint(5, 30) * MS)
        w, r = rng.choice(ranks)
        records.append(RequestRecord(request_id=f"r{i}", arrival_ns=i * 10 * MS, isl=rng.randint(100, 4000),
                                     worker_id=w, dp_rank=r, attempts=1, routing_reason="best",
                                     predicted_overlap_blocks=rng.randint(0, 20), best_overlap_blocks=25,
                                     engine=EngineFacts(cached_tokens=rng.randint(0, 300)), first_token_ns=first,
                                     token_times_ns=times, completion_ns=times[-1]))
    samples = [Sample(t * 100 * MS, w, r, rng.randint(0, 30), rng.randint(0, 5000))
               for t in range(1300) for w, r in ranks]
    data = RunData(records=records, ranks=ranks, samples=samples)
    start = time.perf_counter()
    summary = write_report(data, tmp_path).to_builtins()
    elapsed = time.perf_counter() - start
    assert summary["completed_requests"] == 12_000
    assert elapsed < 6.0, f"report took {elapsed:.2f} s (target < 3 s)"  # 2x slack for loaded CI machines


def test_pooled_gaps_read_token_times_in_any_container_alike():
    """ITL pools every gap within each request, never across two: the same from a router's ``array('q')`` (read in
    place), an engine's list, or a mix; a list with a value outside 64 bits is refused, not wrapped."""
    from array import array

    from harness.report.summary import _pooled_gaps

    series = [[5, 15, 35], [100], [], [2**62, 2**62 + 7], [40, 41, 43, 46]]
    expected = [10, 20, 7, 1, 2, 3]
    as_arrays = [array("q", s) for s in series]
    mixed = [array("q", s) if i % 2 else s for i, s in enumerate(series)]
    for form in (series, as_arrays, mixed):
        assert _pooled_gaps(form).tolist() == expected
    assert _pooled_gaps([[1], []]).tolist() == []
    with pytest.raises(OverflowError):
        _pooled_gaps([[1, 2**64]])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-1e15, max_value=1e15, allow_nan=False), max_size=300), st.booleans())
def test_stats_are_numpys_mean_and_std_of_the_sorted_values_bit_for_bit(values, as_array):
    """``_stats`` spells numpy's mean and std out (to reuse the sorted array as their scratch): the same bits as
    ``ndarray.mean`` and ``.std``, and a caller's array is left as it was unless given up with ``in_place``."""
    import numpy as np

    from harness.report.summary import _stats

    given_values = np.array(values, dtype=np.float64) if as_array else list(values)
    got = _stats(given_values, 1.0)
    if not values:
        assert set(got.values()) == {None}
        return
    s = np.sort(np.array(values, dtype=np.float64))
    assert got["mean"] == float(s.mean()) and got["std"] == float(s.std())
    assert (got["min"], got["max"], got["median"]) == (s[0], s[-1], percentile(s, 50))
    if as_array:
        assert given_values.tolist() == [float(v) for v in values]  # untouched
        assert _stats(given_values, 1.0, in_place=True) == got


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(0, 2**31 - 1), st.integers(0, 1000)),
                max_size=60))
def test_per_rank_sample_figures_equal_the_exact_python_ones(rows):
    """The samples' per-rank mean and max, grouped by numpy, equal Python's exact ones (``math.fsum``); counts
    past numpy's exact range take the Python path."""
    from harness.report.summary import _sample_series, _sample_series_exact

    samples = [Sample(time_ns=i, worker_id=w, dp_rank=r, active_requests=a, kv_blocks=b)
               for i, (w, r, a, b) in enumerate(rows)]
    assert _sample_series(samples) == _sample_series_exact(samples)
    huge = [*samples, Sample(time_ns=0, worker_id=0, dp_rank=0, active_requests=2**62, kv_blocks=2**62)]
    assert _sample_series(huge) == _sample_series_exact(huge)


def test_the_plots_are_handed_over_before_the_summary_is_made_and_it_is_made_once(tmp_path, monkeypatch):
    """The renderer draws while this process summarizes; a report that falls back to a temporary directory
    summarizes once all the same."""
    import harness.report.files as files

    calls: list[str] = []
    real_start, real_summarize = files.start_plots, files.summarize
    monkeypatch.setattr(files, "start_plots", lambda *a: calls.append("plots") or real_start(*a))
    monkeypatch.setattr(files, "summarize", lambda data: calls.append("summary") or real_summarize(data))
    files.save_report(sample_run(), tmp_path / "ok")
    assert calls == ["plots", "summary"]
    calls.clear()
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(files.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "fallback"))
    summary, where = files.save_report(sample_run(), tmp_path / "file" / "report")
    assert where == tmp_path / "fallback" and calls == ["plots", "summary"]
    assert json.loads((where / "summary.json").read_text()) == summary.to_builtins()


@pytest.mark.parametrize("with_columns", [False, True])
def test_requests_jsonl_written_in_pieces_equals_the_records_in_one_piece(tmp_path, with_columns):
    """requests.jsonl is written ``RECORDS_PER_WRITE`` records at a time; the file is the records' flat JSON lines,
    in order, whatever the count against that piece size (with and without extra columns)."""
    import msgspec

    from harness.report import files
    from kvemu.records import flat_json, records_jsonl, sequences_as_lists

    n = 2 * files.RECORDS_PER_WRITE + 3
    records = [rec(f"r{i:03d}", i, 16 + i, 1, i % 2, [i + 1, i + 2.5], engine=i) for i in range(n)]
    encoder = msgspec.json.Encoder(enc_hook=sequences_as_lists)
    phases = {r.request_id: "warmup" for r in records[::3]} if with_columns else None
    assert files.write_requests(reversed(records), tmp_path / "r.jsonl", phases=phases) == n
    if with_columns:
        expected = b"".join(flat_json(r, encoder)[:-1] + b',"phase":'
                            + encoder.encode(phases.get(r.request_id, "profile")) + b"}\n" for r in records)
    else:
        expected = records_jsonl(records, encoder)
    assert (tmp_path / "r.jsonl").read_bytes() == expected
    assert [json.loads(line)["request_id"] for line in expected.splitlines()] == [r.request_id for r in records]
