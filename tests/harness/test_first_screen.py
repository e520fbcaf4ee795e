"""A run ends with its answer: the summary table ``kvemu run`` (and ``up``, ``loadgen``, ``bench-router``) prints on
standard output, read from summary.json's figures, the report's path last."""

import json

import msgspec

from harness.report.first_screen import first_screen, render_first_screen
from harness.report.run_data import RunData
from harness.report.summary import summarize
from harness.report.summary_types import Summary

from tests.harness.test_cli import TINY, kvemu

REGRET = {"requests_compared": 117, "requests_with_loss": 9, "lost_blocks": 83, "novel_blocks": 917,
          "regret_ratio": 0.083, "recoverable_prefill_blocks": {"peer": 83, "cache_owner": 0, "shared": 0},
          "unrecoverable_prefill_blocks": 917, "over_time": []}


def _typed(figures: dict) -> Summary:
    """An empty run's summary with ``figures`` laid over it (section by section)."""
    plain = summarize(RunData()).to_builtins()
    for key, value in figures.items():
        if isinstance(value, dict) and isinstance(plain.get(key), dict):
            for inner, v in value.items():
                plain[key][inner] = {**plain[key][inner], **v} if isinstance(v, dict) and isinstance(
                    plain[key].get(inner), dict) else v
        else:
            plain[key] = value
    return msgspec.convert(plain, Summary)


def _summary(**over):
    summary = {
        "num_requests": 120, "completed_requests": 117, "total_input_tokens": 10_000,
        "duration_ms": 60_000.0, "wall_time_ms": 1_935.0, "request_throughput_rps": 1.95,
        "output_throughput_tok_s": 187.25, "prefix_cache_reused_ratio": 0.6124, "partial": False,
        "median_ttft_ms": 41.25, "p99_ttft_ms": 180.5, "median_itl_ms": 7.125, "p99_itl_ms": 12.0,
        "median_e2e_latency_ms": 757.4, "p99_e2e_latency_ms": 1286.0,
        "kvemu": {"scenario": "quickstart", "mode": "virtual", "seed": 7, "failed_requests": 2,
                  "unfinished_requests": 1, "failed_requests_by_reason": {"worker_lost": 2},
                  "routing": {"regret": REGRET}},
    }
    summary.update(over)
    return _typed(summary)


def test_the_table_gives_each_figure_and_ends_with_the_report_path():
    lines = first_screen("kvemu run", _summary(), "out/quickstart/report.md").splitlines()
    assert lines[0] == "kvemu run: quickstart (virtual time, seed 7)"
    rows = {line.split("   ")[0].strip(): line.split("   ", 1)[1].strip() for line in lines[1:]}
    assert rows["requests"] == "117/120 completed, 2 failed (worker_lost 2), 1 unfinished"
    assert rows["TTFT (ms)"].split() == ["p50", "41.2", "p99", "180.5"]  # (format's round half to even)
    assert rows["E2E (ms)"].split() == ["p50", "757.4", "p99", "1,286"]
    assert rows["throughput"] == "187.2 output tok/s, 1.95 req/s"
    assert rows["prefix reuse"] == "6,124 of 10,000 prompt tokens cached (61.2%)"
    assert rows["routing regret"].startswith("8.3% (83 of the 1,000 prompt blocks computed anew")
    assert rows["virtual clock"] == "60.0 s of cluster time in 1.9 s (31x)"
    assert lines[-1].split() == ["report", "out/quickstart/report.md"]


def test_a_figure_the_run_lacks_is_left_out_and_a_live_run_gives_its_duration():
    summary = _summary(partial=True)
    summary.kvemu.mode, summary.kvemu.routing.regret, summary.kvemu.stop_reason = "live", None, "SIGINT"
    text = first_screen("kvemu up", summary, None)
    assert text.splitlines()[0] == "kvemu up: quickstart (live time, seed 7) PARTIAL (SIGINT)"
    assert "routing regret" not in text and "virtual clock" not in text
    assert "  duration " in text and "60.0 s (live clock)" in text
    assert text.splitlines()[-1].split() == ["report", "none", "written"]
    summary.kvemu.hook_counts = {"engine_truth_matched": 0, "engine_truth_unmatched": 117}  # loadgen --http
    reuse = " ".join(first_screen("kvemu loadgen", summary, None).split("prefix reuse")[1].split("\n")[0].split())
    assert reuse == "unknown: no engine said what it found cached (loadgen --http: give --fleet)"


def test_several_runs_are_columns_side_by_side():
    text = render_first_screen("kvemu bench-router: quickstart", [("kvemu:kv", _summary()), ("mine", None)],
                               "out/r/routers.md")
    lines = text.splitlines()
    assert lines[1].split() == ["kvemu:kv", "mine"]
    assert lines[2].split() == ["requests", "117/120", "(2", "failed)", "(1", "open)", "no", "report"]
    assert "61.2%" in text and lines[-1].split() == ["report", "out/r/routers.md"]


def test_kvemu_run_prints_the_table_on_stdout_and_quiet_does_not(tmp_path):
    loud = kvemu("run", *TINY, "-o", "a", cwd=tmp_path)
    assert loud.returncode == 0, loud.stderr
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    lines = loud.stdout.splitlines()
    assert lines[0] == "kvemu run: quickstart (virtual time, seed 7)"
    assert lines[1].split()[:2] == ["requests", f"{summary['completed_requests']}/{summary['num_requests']}"]
    assert f"p50 {summary['median_ttft_ms']:,.1f}" in " ".join(loud.stdout.split())
    assert any(line.split()[:2] == ["virtual", "clock"] and line.endswith("x)") for line in lines)
    assert lines[-1].split() == ["report", "a/report.md"]
    assert loud.stderr.splitlines()[-1].startswith("kvemu: ")  # the one-line outcome stays on stderr
    quiet = kvemu("run", *TINY, "-o", "b", "--quiet", cwd=tmp_path)
    assert quiet.returncode == 0 and quiet.stdout == ""


def test_a_report_is_titled_after_the_command_that_ran_it():
    from harness.cli.parser import build_parser
    from harness.report.markdown import render_markdown
    from harness.report.run_data import RunData
    from harness.report.summary import summarize

    data = RunData(scenario_name="s", command="kvemu loadgen", mode="live")
    assert render_markdown(summarize(data), data, ()).startswith("# kvemu loadgen: s\n")
    assert render_markdown(summarize(RunData(scenario_name="s")), RunData(), ()).startswith("# kvemu run: s\n")
    assert build_parser().parse_args(["loadgen", "--router", "tcp://127.0.0.1:9"]).report_as == "kvemu loadgen"


def test_bench_router_sums_up_each_routers_report_in_a_column(tmp_path):
    from harness.cli.fleet import _first_screen

    summaries = {"kvemu:kv": _summary()}  # (the runs' summaries, kept in memory as each ended: no file is read back)
    lines = _first_screen("quickstart", [{"router": "kvemu:kv"}, {"router": "cmd:mine"}], summaries,
                          tmp_path).splitlines()
    assert lines[0] == "kvemu bench-router: quickstart"
    assert lines[1].split() == ["kvemu:kv", "cmd:mine"]
    assert lines[2].split()[-2:] == ["no", "report"]  # cmd:mine never started: no summary
    assert lines[-1].split() == ["report", str(tmp_path / "routers.md")]
    one = _first_screen("quickstart", [{"router": "kvemu:kv"}], summaries, tmp_path).splitlines()
    assert one[0] == "kvemu bench-router: quickstart through kvemu:kv"
