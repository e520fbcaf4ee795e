"""The report's plots: drawn in process or by the warmed-up renderer process of ``kvemu run``, the same files."""

import subprocess
import sys

import pytest

from harness import plots
from harness.plots import PLOTS, background_renderer, write_plots
from harness.report import write_report
from test_report import PNG_SIGNATURE, sample_run

FILES = ("summary.json", "requests.jsonl", "report.md", *PLOTS)


def _two_cpus(monkeypatch):
    monkeypatch.setattr(plots, "_usable_cpus", lambda: 2)


def test_importing_the_cli_and_the_report_imports_neither_matplotlib_nor_numpy():
    code = ("import sys, harness.cli, harness.report, harness.plots, harness.recorder; "
            "print(sorted(m for m in ('matplotlib', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_renderer_process_writes_the_same_files_as_in_process(tmp_path, monkeypatch):
    _two_cpus(monkeypatch)
    write_report(sample_run(), tmp_path / "here")
    with background_renderer():
        renderer = plots._RENDERER
        assert renderer is not None
        write_report(sample_run(), tmp_path / "there")
        assert renderer.result() and renderer.proc.returncode == 0  # the child drew them
    assert plots._RENDERER is None and renderer.proc.poll() is not None
    for name in FILES:
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "there" / name).read_bytes(), name


def test_a_failed_renderer_falls_back_to_drawing_in_process(tmp_path, monkeypatch):
    _two_cpus(monkeypatch)
    monkeypatch.setattr(plots, "_renderer_command", lambda: [sys.executable, "-c", "import sys; sys.exit(3)"])
    with background_renderer():
        assert write_plots(sample_run(), tmp_path) == list(PLOTS)
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE


def test_an_unused_renderer_is_stopped_and_one_cpu_starts_none(monkeypatch):
    _two_cpus(monkeypatch)
    with background_renderer():
        renderer = plots._RENDERER
        assert renderer is not None
    assert renderer.proc.poll() is not None and plots._RENDERER is None
    monkeypatch.setattr(plots, "_usable_cpus", lambda: 1)
    with background_renderer():
        assert plots._RENDERER is None


def test_a_renderer_takes_one_job_then_plots_are_drawn_in_process(tmp_path, monkeypatch):
    _two_cpus(monkeypatch)
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    with background_renderer():
        write_plots(sample_run(), tmp_path / "first")
        write_plots(sample_run(), tmp_path / "second")
    for name in PLOTS:
        assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes(), name


@pytest.mark.parametrize("n", [0, 1, 5, 4500])
def test_cdf_points_start_at_zero_and_keep_the_extremes(n):
    points = plots._cdf_points(range(n, 0, -1), n)
    if n == 0:
        assert points is None
        return
    xs, ys = points
    assert len(xs) == len(ys) <= plots._MAX_POINTS + 2
    assert (xs[0], ys[0]) == (1 / plots.NS_PER_MS, 0.0) and (xs[-1], ys[-1]) == (n / plots.NS_PER_MS, 1.0)
    assert list(xs) == sorted(xs) and list(ys) == sorted(ys)
