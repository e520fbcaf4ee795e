"""The ``kvemu`` command line as a user runs it: separate processes, exit codes, files and printed output."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_script = Path(sys.executable).with_name("kvemu")
KVEMU = [str(_script)] if _script.exists() else ([shutil.which("kvemu")] if shutil.which("kvemu")
                                                   else [sys.executable, "-m", "harness.cli"])

TINY = ["--set", "run.duration_s=4", "--set", "cluster.workers=2", "--set", "cluster.engine.num_gpu_blocks=256",
        "--set", "workload.isl.mean=256", "--set", "workload.osl.mean=16", "--set", "workload.osl.std=4"]


def kvemu(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*KVEMU, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The built-in quickstart, shortened with --set, run with two policies (report dirs a/ and b/)."""
    d = tmp_path_factory.mktemp("cli")
    a = kvemu("run", *TINY, "-o", "a", "--quiet", cwd=d)
    b = kvemu("run", *TINY, "--set", "router.policy=round_robin", "--seed", "9", "-o", "b", "--quiet", cwd=d)
    return d, a, b


# ------------------------------------------------------------------------------------------ validate


def test_validate_an_example():
    proc = kvemu("validate", str(ROOT / "examples" / "quickstart.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok: quickstart: 4 workers × 2 DP ranks, ")
    assert "virtual mode" in proc.stdout


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("nosuchmodule_kvemu:make", "router.policy: cannot import module 'nosuchmodule_kvemu'"),
        ("json:nosuch", "router.policy: module 'json' has no 'nosuch'"),
        ("json:JSONDecoder", "returned JSONDecoder, not a CustomPolicy"),
    ],
)
def test_validate_and_run_reject_a_custom_policy_that_cannot_be_built(tmp_path, policy, message):
    for command in ("validate", "run"):
        proc = kvemu(command, "--set", f"router.policy={policy}", "-o", "out", cwd=tmp_path) if command == "run" \
            else kvemu(command, "--set", f"router.policy={policy}", cwd=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr, (command, proc.stderr)
    assert not (tmp_path / "out").exists()  # nothing started


def test_validate_the_built_in_default_with_overrides(tmp_path):
    proc = kvemu("validate", "--set", "cluster.workers=7", "--set", "run.duration_s=10", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "7 workers" in proc.stdout


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        ("cluster:\n  workers: 2\n  wrokers: 3\n", [], "cluster.wrokers (line 3): unknown key"),
        ("cluster:\n  workers: two\n", [], "cluster.workers (line 2): expected an integer, got 'two'"),
        ("run:\n  duration_s: -5\n", [], "run.duration_s (line 2): Expected `float` > 0.0, got -5"),
        ("name: x\n", ["--set", "router.policy=fastest"], "router.policy"),
        ("workload:\n  kind: trace\n  trace: nowhere.jsonl\n", [], "workload.trace (line 3): file not found"),
    ],
)
def test_validate_an_invalid_scenario_exits_2_naming_the_key(tmp_path, text, overrides, expected):
    (tmp_path / "bad.yaml").write_text(text)
    proc = kvemu("validate", "bad.yaml", *overrides, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("invalid: bad.yaml: ")
    assert expected in proc.stderr
    assert proc.stdout == ""


def test_validate_reports_the_line_of_a_bad_trace_row(tmp_path):
    good = json.dumps({"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]})
    (tmp_path / "t.jsonl").write_text(f"{good}\n{good}\n{{oops\n")
    (tmp_path / "s.yaml").write_text("workload:\n  trace: t.jsonl\n")
    proc = kvemu("validate", "s.yaml", cwd=tmp_path)
    assert proc.returncode == 2
    assert "t.jsonl:3: not JSON" in proc.stderr


def _mooncake(path: Path, rows: int) -> Path:
    path.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 40, "output_length": 2,
                                        "hash_ids": [1, 2 + i]}) + "\n" for i in range(rows)))
    return path


def test_run_and_validate_take_a_trace_as_plan_does(tmp_path):
    """A trace .jsonl is a scenario (KV routing, default cluster) for run and validate, not "not valid YAML"."""
    _mooncake(tmp_path / "my trace.jsonl", 3)
    proc = kvemu("validate", "my trace.jsonl", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok: my-trace: ") and "3 requests" in proc.stdout
    proc = kvemu("run", "my trace.jsonl", "-o", "r", "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "3/3 requests completed" in proc.stderr
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["completed_requests"] == 3


@pytest.mark.parametrize("command", [["validate"], ["run", "-o", "r", "--quiet"],
                                     ["loadgen", "--router", "tcp://127.0.0.1:9", "-o", "r"]])
def test_an_empty_trace_is_refused_before_it_runs(tmp_path, command):
    (tmp_path / "empty.jsonl").write_text("\n")
    proc = kvemu(command[0], "empty.jsonl", *command[1:], cwd=tmp_path)
    assert proc.returncode == 2
    assert "empty.jsonl: the trace has no requests" in proc.stderr
    assert not (tmp_path / "r" / "summary.json").exists()


def test_switching_the_built_in_to_a_trace_names_the_synthetic_keys_it_keeps(tmp_path):
    proc = kvemu("validate", "--set", "workload.kind=trace", cwd=tmp_path)
    assert proc.returncode == 2
    assert ("workload.rate_rps (line 16): belongs to workload.kind=synthetic; with workload.kind=trace, remove it"
            in proc.stderr)
    assert "set workload.trace" in proc.stderr and "unknown key" not in proc.stderr
    assert "give the trace itself as the scenario: kvemu run TRACE.jsonl" in proc.stderr


# ----------------------------------------------------------------------------------------------- run


def test_run_with_overrides_writes_the_report(two_runs):
    d, a, _ = two_runs
    assert a.returncode == 0, a.stderr
    assert "kvemu: running quickstart (virtual time, seed 7) on 2 workers × 2 DP ranks" in a.stderr
    assert "requests completed; report in a/report.md" in a.stderr
    out = d / "a"
    for name in ("summary.json", "requests.jsonl", "report.md", "ttft_cdf.png", "e2e_cdf.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed_requests"] == summary["num_requests"] > 0
    assert {r["worker_id"] for r in summary["kvemu"]["per_rank"]} == {0, 1}
    assert summary["kvemu"]["seed"] == 7 and summary["kvemu"]["scenario"] == "quickstart"
    assert len((out / "requests.jsonl").read_text().splitlines()) == summary["num_requests"]


def test_run_seed_and_policy_overrides_take_effect(two_runs):
    d, _, b = two_runs
    assert b.returncode == 0, b.stderr
    summary = json.loads((d / "b" / "summary.json").read_text())
    assert summary["kvemu"]["seed"] == 9
    assert set(summary["kvemu"]["routing"]["reasons"]) == {"policy"}  # round robin, not the cost argmin


def test_run_an_invalid_scenario_exits_2_and_writes_nothing(tmp_path):
    proc = kvemu("run", "--set", "cluster.workers=0", "-o", "out", "--quiet", cwd=tmp_path)
    assert proc.returncode == 2
    assert "invalid scenario" in proc.stderr and "cluster.workers" in proc.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- compare


def test_compare_prints_deltas(two_runs):
    d, a, b = two_runs
    assert a.returncode == b.returncode == 0
    proc = kvemu("compare", "a", "b", cwd=d)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "A: a (scenario quickstart, mode virtual, seed 7)"
    assert lines[1] == "B: b (scenario quickstart, mode virtual, seed 9)"
    header = lines[3].split()
    assert header == ["metric", "A", "B", "delta", "delta", "%"]
    end = lines.index("", 5)  # the figures, then what differs between the scenarios
    rows = {line.split()[0]: line.split() for line in lines[5:end]}
    assert lines[end + 1] == "Scenarios: 2 keys differ (scenario.yaml)"
    assert [line.split() for line in lines[end + 5:]] == [["router.policy", "kv", "round_robin"],
                                                          ["run.seed", "7", "9"]]
    sa = json.loads((d / "a" / "summary.json").read_text())
    sb = json.loads((d / "b" / "summary.json").read_text())
    ttft = rows["mean_ttft_ms"]
    assert float(ttft[1]) == pytest.approx(sa["mean_ttft_ms"], rel=1e-5)
    assert float(ttft[2]) == pytest.approx(sb["mean_ttft_ms"], rel=1e-5)
    assert float(ttft[3]) == pytest.approx(sb["mean_ttft_ms"] - sa["mean_ttft_ms"], rel=1e-4, abs=1e-6)
    assert ttft[4].endswith("%")
    assert "prefix_cache_reused_ratio" in rows and "num_requests" in rows
    assert "kvemu" not in rows  # only the numeric top-level keys


def test_compare_a_missing_report_exits_2(tmp_path):
    proc = kvemu("compare", "nope-a", "nope-b", cwd=tmp_path)
    assert proc.returncode == 2
    assert "no summary.json in nope-a" in proc.stderr


# ---------------------------------------------------------------------------------------------- demo


def test_demo():
    proc = kvemu("demo", "--workers", "3", "--dp-size", "2", "--sessions", "4", "--turns", "3")
    assert proc.returncode == 0, proc.stderr
    assert "12 requests routed on 3 workers x 2 DP ranks" in proc.stdout
    assert "prefix blocks found cached at routing time" in proc.stdout
    assert proc.stdout == kvemu("demo", "--workers", "3", "--dp-size", "2", "--sessions", "4", "--turns", "3").stdout


def test_usage_errors_exit_2():
    assert kvemu("demo", "--workers", "0").returncode == 2
    unknown = kvemu("nope")  # (plain kvemu prints the help: test_cli_help)
    assert unknown.returncode == 2 and "usage: kvemu" in unknown.stderr


def test_a_policy_module_in_the_working_directory_is_used_only_when_allowed(tmp_path):
    """``python -m`` puts the working directory first on the import path: a file next to the scenario must not
    stand in for the module a scenario names unless the user says so."""
    (tmp_path / "localpolicy_kvemu.py").write_text(
        "from kvemu.policy import round_robin_policy\n\ndef make():\n    return round_robin_policy()\n")
    args = ["validate", "--set", "router.policy=localpolicy_kvemu:make"]
    run = [sys.executable, "-m", "harness.cli"]
    refused = subprocess.run([*run, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert refused.returncode == 2
    assert "the working directory is not searched (--allow-local-policies searches it)" in refused.stderr
    allowed = subprocess.run([*run, *args, "--allow-local-policies"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert allowed.returncode == 0, allowed.stderr


def test_tokenizer_export_and_http_options_are_checked_before_anything_starts(tmp_path):
    import json as _json

    out = subprocess.run([sys.executable, "-m", "harness.cli", "tokenizer", "export", str(tmp_path / "tok")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--tokenizer" in out.stdout
    assert _json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    for args, why in ((["--http", "localhost"], "expected HOST:PORT"), (["--http", "127.0.0.1:x"], "not a number"),
                      (["--tokenizer", str(tmp_path / "none")], "no tokenizer.json")):
        res = subprocess.run([sys.executable, "-m", "harness.cli", "serve", *args], capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 2 and why in res.stderr, res.stderr


README = (ROOT / "docs" / "autoscaling.md").read_text()


def _readme_queue_follower() -> str:
    """The docs' custom autoscaler policy example, as a user would paste it into a file."""
    start = README.index("```python\nfrom kvemu.autoscale import")
    return README[start:README.index("```", start + 3)].removeprefix("```python\n")


@pytest.mark.skipif(not _script.exists(), reason="needs the installed kvemu console script")
@pytest.mark.parametrize(
    ("module", "source", "overrides"),
    [
        ("mypol", "from kvemu.policy import round_robin_policy\n\ndef make():\n    return round_robin_policy()\n",
         ["router.policy=mypol:make"]),
        ("scaling", None, ["autoscaler.policy=scaling:QueueFollower", "autoscaler.min_workers=1",
                           "autoscaler.max_workers=8"]),
    ],
    ids=["router.policy", "autoscaler.policy"],
)
def test_the_console_script_imports_policies_from_the_working_directory_when_allowed(tmp_path, module, source,
                                                                                      overrides):
    """An installed console script never has the working directory on the import path: the flag must put it
    there (the refusal recommends the flag), for router and autoscaler policies alike."""
    (tmp_path / f"{module}.py").write_text(source or _readme_queue_follower())
    args = ["validate", *(a for o in overrides for a in ("--set", o))]
    refused = subprocess.run([str(_script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--allow-local-policies searches it" in refused.stderr, refused.stderr
    allowed = subprocess.run([str(_script), *args, "--allow-local-policies"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=60)
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout.startswith("ok: quickstart: ")


@pytest.mark.parametrize(
    "args",
    [["serve", "--http", "{addr}"], ["up", "--http", "{addr}"], ["router", "--http", "{addr}"],
     ["worker", "--router", "tcp://127.0.0.1:9", "--http", "{addr}"], ["router", "--listen", "tcp://{addr}"],
     ["worker", "--router", "tcp://127.0.0.1:9", "--kv-events", "tcp://{addr}"],
     ["worker", "--router", "tcp://127.0.0.1:9", "--kv-replay", "tcp://{addr}"]],
    ids=["serve", "up", "router-http", "worker-http", "router-listen", "worker-kv-events", "worker-kv-replay"],
)
def test_a_busy_port_is_one_line_naming_the_address_and_exit_2(tmp_path, args):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        addr = f"127.0.0.1:{busy.getsockname()[1]}"
        proc = kvemu(*(a.format(addr=addr) for a in args), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    # (a listener opened before the busy one, e.g. the worker's KV publisher, says it has no secret first)
    lines = [line for line in proc.stderr.splitlines() if "without a secret" not in line]
    assert len(lines) == 1 and addr in lines[0] and "pick another port" in lines[0], proc.stderr


def test_a_path_given_with_set_resolves_against_the_working_directory(tmp_path):
    """A path in the file is relative to the file; one typed on the command line, to where it was typed."""
    row = json.dumps({"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]})
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "t.jsonl").write_text(f"{row}\n")
    (tmp_path / "here.jsonl").write_text(f"{row}\n{row}\n")
    (tmp_path / "sub" / "s.yaml").write_text("name: s\nworkload:\n  trace: t.jsonl\n")
    assert kvemu("validate", "sub/s.yaml", cwd=tmp_path).returncode == 0
    moved = kvemu("validate", "sub/s.yaml", "--set", "workload.trace=./here.jsonl", cwd=tmp_path)
    assert moved.returncode == 0, moved.stderr
    assert ", 2 requests, " in moved.stdout
    missing = kvemu("validate", "sub/s.yaml", "--set", "workload.trace=./t.jsonl", cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip().startswith(f"invalid: sub/s.yaml: workload.trace (from --set): file not found: "
                                             f"{(tmp_path / 't.jsonl').resolve()}. To try the scenario on a ")


def test_a_float_written_as_yaml_1_2_does_on_the_command_line(tmp_path):
    proc = kvemu("validate", "--set", "run.duration_s=1e1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_version_prints_the_installed_package_version_and_build():
    from importlib.metadata import version

    import kvemu as package

    proc = kvemu("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"kvemu {version('kvemu')} ({'compiled' if package.compiled else 'pure'} build)"


def test_building_the_parser_leaves_the_version_unread_until_asked():
    """Every command builds the parser; only ``--version`` reads the package's metadata (~20 ms of imports)."""
    code = "import sys; from harness.cli import build_parser; build_parser(); print('importlib.metadata' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_option_and_argument_of_every_command_has_help():
    import argparse

    from harness.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                assert action.help, f"{path}: its subcommands"
                for choice in action._choices_actions:
                    assert choice.help, f"{path} {choice.dest}"
                for name, child in action.choices.items():
                    yield from walk(child, f"{path} {name}")
            else:
                yield path, action

    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}" for path, a in walk(build_parser(), "kvemu")
               if not (a.help or "").strip()]
    assert missing == []


@pytest.mark.parametrize("example", ["quickstart.yaml", "agentic-sessions-600s.yaml"])
def test_validate_counts_the_requests_run_sends_and_the_last_line_is_not_wrapped(tmp_path, example):
    """Sub-agent requests count (validate said "turns"); the report path printed last is one unbroken line even
    when the output is not a terminal (rich wraps at 80 columns there)."""
    args = [str(ROOT / "examples" / example), "--set", "run.duration_s=4", "--set", "cluster.engine.num_gpu_blocks=512"]
    checked = kvemu("validate", *args, cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    outdir = "reports/" + "a-rather-long-directory-name-" * 3 + example.removesuffix(".yaml")
    ran = kvemu("run", *args, "-o", outdir, "--quiet", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    requests = json.loads((tmp_path / outdir / "summary.json").read_text())["num_requests"]
    assert f", {requests} requests" in checked.stdout
    last = ran.stderr.splitlines()[-1]
    assert last == f"kvemu: {requests}/{requests} requests completed; report in {outdir}/report.md"


def test_counts_of_one_read_in_the_singular(tmp_path):
    proc = kvemu("validate", "--set", "cluster.workers=1", "--set", "cluster.dp_size=1", "--set", "run.max_requests=1",
                 "--set", "workload.sub_agents=0",
                 cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok: quickstart: 1 worker × 1 DP rank, 1 session, 1 request, ")
    demo = kvemu("demo", "--workers", "1", "--dp-size", "1", "--sessions", "1", "--turns", "1")
    assert "1 request routed on 1 worker x 1 DP rank" in demo.stdout


@pytest.mark.parametrize(("command", "path", "expected"), [
    ("validate", "sweep-workers.yaml", "a sweep file (it has axes:), not a scenario: run it with kvemu sweep "),
    ("run", "sweep-workers.yaml", "a sweep file (it has axes:), not a scenario: run it with kvemu sweep "),
    ("sweep", "quickstart.yaml", "a scenario, not a sweep file (a sweep has axes:): run it with kvemu run "),
])
def test_a_file_given_to_the_wrong_command_says_which_command_it_is_for(tmp_path, command, path, expected):
    proc = kvemu(command, str(ROOT / "examples" / path), cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and expected in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ plots


def test_plots_wait_unless_a_person_is_at_the_terminal_or_background_is_asked():
    from harness.cli.run import plots_in_background

    assert [plots_in_background(c, False) for c in ("auto", "wait", "background")] == [False, False, True]
    assert [plots_in_background(c, True) for c in ("auto", "wait", "background")] == [True, False, True]


def test_plots_left_drawing_in_the_background_are_the_files_a_waiting_run_writes(tmp_path):
    from harness.report.plots import PLOTS, PLOTS_ERROR

    waited = kvemu("run", *TINY, "-o", "w", "--quiet", "--plots", "wait", cwd=tmp_path)
    left = kvemu("run", *TINY, "-o", "b", "--quiet", "--plots", "background", cwd=tmp_path)
    assert waited.returncode == left.returncode == 0, left.stderr
    assert all((tmp_path / "w" / name).exists() for name in PLOTS)  # there when the command ends
    deadline = time.monotonic() + 60
    while not all((tmp_path / "b" / name).exists() for name in PLOTS):
        assert time.monotonic() < deadline and not (tmp_path / "b" / PLOTS_ERROR).exists()
        time.sleep(0.05)
    for name in ("requests.jsonl", *PLOTS):  # (summary.json and report.md say how long each run took)
        assert (tmp_path / "w" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
