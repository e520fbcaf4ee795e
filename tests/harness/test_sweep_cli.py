"""`kvemu sweep` as a user runs it: the example, exit codes, Ctrl-C and SIGTERM, resume, refusals."""

import contextlib
import csv
import io
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness.test_cli import KVEMU, kvemu

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sweep-workers.yaml"


def rows(outdir: Path) -> list[dict]:
    return list(csv.DictReader(io.StringIO((outdir / "sweep.csv").read_text())))


def test_the_example_validates_and_runs_shortened(tmp_path):
    proc = kvemu("sweep", "--validate", str(EXAMPLE))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok: sweep-workers: 6 points × 2 seeds = 12 runs, every point valid\n"
    proc = kvemu("sweep", str(EXAMPLE), "--set", "run.duration_s=4", "--jobs", "2", "-o", "out", "--quiet",
                 cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "12 ok (12 ran now, 0 reused)" in proc.stderr
    table = rows(tmp_path / "out")
    assert [(r["cluster.workers"], r["seed"]) for r in table] == [
        (w, s) for w in ("1", "2", "3", "4", "6", "8") for s in ("7", "8")]
    assert all(r["status"] == "ok" and float(r["p99_ttft_ms"]) > 0 for r in table)
    md = (tmp_path / "out" / "sweep.md").read_text()
    assert "## Chosen point" in md and "![Pareto front](sweep_pareto.png)" in md


def test_exit_codes_invalid_sweep_unknown_address_and_a_failing_point(tmp_path):
    (tmp_path / "bad.yaml").write_text("axes:\n  cluster.workers: [2, 0]\n")
    proc = kvemu("sweep", "bad.yaml", cwd=tmp_path)
    assert proc.returncode == 2 and "point 1 (cluster.workers=0)" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing started
    (tmp_path / "ok.yaml").write_text("set: {run.duration_s: 2}\naxes:\n  cluster.workers: [2]\n")
    proc = kvemu("sweep", "ok.yaml", "--address", "udp://127.0.0.1:1", cwd=tmp_path)
    assert proc.returncode == 2 and "expected tcp://HOST:PORT" in proc.stderr
    (tmp_path / "base.yaml").write_text(
        "cluster: {workers: 2, dp_size: 2}\nworkload: {kind: synthetic, rate_rps: 2, turns: 2}\n"
        "run: {duration_s: 2}\nchaos:\n  - {at_s: 0.5, action: kill_rank, worker: 0, dp_rank: 1}\n"
        "  - {at_s: 50, action: kill_rank, worker: 0, dp_rank: 1}\n")
    (tmp_path / "fails.yaml").write_text("base: base.yaml\naxes:\n  workload.think_time_s: [0.1, 100]\n")
    proc = kvemu("sweep", "fails.yaml", "--jobs", "2", "-o", "f", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "point 1 (workload.think_time_s=100) seed 0 failed" in proc.stderr
    assert "1 of 2 runs failed or stopped early" in proc.stderr
    assert [r["status"] for r in rows(tmp_path / "f")] == ["ok", "failed"]


def test_another_sweep_into_the_same_outdir_is_refused(tmp_path):
    (tmp_path / "a.yaml").write_text("set: {run.duration_s: 2}\naxes:\n  cluster.workers: [2]\n")
    (tmp_path / "b.yaml").write_text("set: {run.duration_s: 2}\naxes:\n  cluster.workers: [3]\n")
    assert kvemu("sweep", "a.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    proc = kvemu("sweep", "b.yaml", "-o", "out", cwd=tmp_path)
    assert proc.returncode == 2 and "holds sweep 'a', not 'b'" in proc.stderr
    proc = kvemu("sweep", "b.yaml", "-o", "out", "--force", cwd=tmp_path)
    assert proc.returncode == 0 and [r["cluster.workers"] for r in rows(tmp_path / "out")] == ["3"]


@pytest.mark.process_supervision
@pytest.mark.parametrize(("sig", "code", "reason"), [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_signal_stops_the_sweep_and_the_same_command_resumes(tmp_path, sig, code, reason):
    (tmp_path / "s.yaml").write_text("set: {run.duration_s: 30}\naxes:\n  cluster.workers: [1, 2, 3, 4, 5, 6]\n"
                                     "seeds: 2\n")
    command = [*KVEMU, "sweep", "s.yaml", "--jobs", "2", "-o", "out"]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "out" / "sweep-log.jsonl"
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:  # until the first run has finished
        if log.exists() and log.read_text().count("\n") >= 1:
            break
        time.sleep(0.02)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    finished = [r for r in rows(tmp_path / "out") if r["status"] == "ok"]
    assert (f"kvemu sweep: interrupted ({reason}): {len(finished)} of 12 runs finished, kept in out/sweep.md; run the "
            f"same command again to resume (the other {12 - len(finished)})") in err, err
    assert 1 <= len(finished) < 12 and {r["status"] for r in rows(tmp_path / "out")} <= {"ok", "pending"}
    assert f"Interrupted ({reason})" in (tmp_path / "out" / "sweep.md").read_text()
    again = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"({12 - len(finished)} to run, {len(finished)} finished before)" in again.stderr
    assert f"12 ok ({12 - len(finished)} ran now, {len(finished)} reused)" in again.stderr


def test_a_fully_reused_sweep_says_so(tmp_path):
    (tmp_path / "s.yaml").write_text("set: {run.duration_s: 2}\naxes:\n  cluster.workers: [1, 2]\n")
    assert kvemu("sweep", "s.yaml", "-o", "out", "--quiet", cwd=tmp_path).returncode == 0
    again = kvemu("sweep", "s.yaml", "-o", "out", "--quiet", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "all 2 runs reused from out; nothing to run" in again.stderr
    assert "pool of 0" not in again.stderr and "pool of 0" not in (tmp_path / "out" / "sweep.json").read_text()
    with (tmp_path / "out" / "sweep-log.jsonl").open("a") as log:  # (the good lines before them are still reused)
        log.write('{"point": 0, "seed": 7, "wall_time_s": NaN}\n{"key": "torn')
    third = kvemu("sweep", "s.yaml", "-o", "out", "--quiet", cwd=tmp_path)
    assert third.returncode == 0 and "all 2 runs reused" in third.stderr, third.stderr
    assert ("kvemu sweep: 2 earlier results refused, not reused: sweep-log.jsonl line 3: Expected `float` >= 0.0 - "
            "at `$.wall_time_s`; sweep-log.jsonl line 4: Input data was truncated") in " ".join(third.stderr.split())


def test_a_signal_while_the_executor_starts_writes_sweep_md_and_the_resume_hint(tmp_path, monkeypatch, capsys):
    from harness import cli
    from harness.sweep import executors
    from harness.run.runner import Terminated

    @contextlib.contextmanager
    def interrupted(address, jobs):
        raise Terminated("SIGTERM")
        yield

    monkeypatch.setattr(executors, "open_executor", interrupted)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text("set: {run.duration_s: 2}\naxes:\n  cluster.workers: [1, 2]\n")
    assert cli.main(["sweep", "s.yaml", "-o", "out", "--quiet"]) == 143
    assert ("kvemu sweep: interrupted (SIGTERM): 0 of 2 runs finished, kept in out/sweep.md; run the same command "
            "again to resume (the other 2)") in capsys.readouterr().err
    assert "Interrupted (SIGTERM) before any run finished" in (tmp_path / "out" / "sweep.md").read_text()
    assert {r["status"] for r in rows(tmp_path / "out")} == {"pending"}
