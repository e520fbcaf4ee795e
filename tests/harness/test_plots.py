"""The report's plots: drawn in process or by the warmed-up renderer process of ``kvemu run``, the same files."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.report import figures, plot_data, plot_drawing, plot_renderer
from harness.report.plots import PLOTS, PLOTS_ERROR, background_renderer, write_plots
from harness.report.files import write_report
from harness.report.run_data import Sample
from harness.report.summary import rank_series
from tests.harness.test_report import PNG_SIGNATURE, sample_run

FILES = ("summary.json", "requests.jsonl", "report.md", *PLOTS)


def _two_cpus(monkeypatch):
    monkeypatch.setattr(plot_renderer, "_usable_cpus", lambda: 2)


def test_importing_the_cli_and_the_report_imports_neither_matplotlib_nor_numpy():
    code = ("import sys, harness.cli, harness.report.summary, harness.report.plots, harness.report.recorder; "
            "print(sorted(m for m in ('matplotlib', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_renderer_process_writes_the_same_files_as_in_process(tmp_path, monkeypatch):
    _two_cpus(monkeypatch)
    write_report(sample_run(), tmp_path / "here")
    with background_renderer():
        renderer = plot_renderer._RENDERER
        assert renderer is not None
        write_report(sample_run(), tmp_path / "there")
        assert renderer.result() and renderer.proc.returncode == 0  # the child drew them
    assert plot_renderer._RENDERER is None and renderer.proc.poll() is not None
    for name in FILES:
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "there" / name).read_bytes(), name


def test_a_failed_renderer_falls_back_to_drawing_in_process(tmp_path, monkeypatch):
    _two_cpus(monkeypatch)
    monkeypatch.setattr(plot_renderer, "_renderer_command", lambda: [sys.executable, "-c", "import sys; sys.exit(3)"])
    with background_renderer():
        assert write_plots(sample_run(), tmp_path) == list(PLOTS)
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE


def test_an_unused_renderer_is_stopped_and_one_cpu_starts_none(monkeypatch):
    _two_cpus(monkeypatch)
    with background_renderer():
        renderer = plot_renderer._RENDERER
        assert renderer is not None
    assert renderer.proc.poll() is not None and plot_renderer._RENDERER is None
    monkeypatch.setattr(plot_renderer, "_usable_cpus", lambda: 1)
    with background_renderer():
        assert plot_renderer._RENDERER is None


def test_a_renderer_takes_one_job_then_plots_are_drawn_in_process(tmp_path, monkeypatch):
    _two_cpus(monkeypatch)
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    with background_renderer():
        write_plots(sample_run(), tmp_path / "first")
        write_plots(sample_run(), tmp_path / "second")
    for name in PLOTS:
        assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes(), name


ROOT = Path(__file__).resolve().parents[2]


def _gated_renderer(gate: Path, prelude: str = "") -> list[str]:
    """A renderer that reads its job, then waits for ``gate`` to exist before drawing it (after ``prelude``)."""
    code = (f"import io, os, sys, time; sys.path.insert(0, {str(ROOT)!r}); data = sys.stdin.buffer.read()\n"
            f"while not os.path.exists({str(gate)!r}): time.sleep(0.01)\n"
            f"sys.stdin = io.TextIOWrapper(io.BytesIO(data))\n"
            f"import harness.report.plot_renderer as r\n{prelude}\nr._serve()")
    return [sys.executable, "-P", "-c", code]


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    """Until ``path`` exists (a process this test does not wait for writes it), at most ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.02)


_FAIL = "r.render = lambda *a: (_ for _ in ()).throw(RuntimeError('no fonts'))"


def test_a_renderer_left_drawing_ends_the_report_at_once_and_draws_the_same_files(tmp_path, monkeypatch):
    _two_cpus(monkeypatch)
    write_report(sample_run(), tmp_path / "here")
    gate = tmp_path / "gate"
    monkeypatch.setattr(plot_renderer, "_renderer_command", lambda: _gated_renderer(gate))
    with background_renderer(wait=False):
        renderer = plot_renderer._RENDERER
        write_report(sample_run(), tmp_path / "there")  # returns while the renderer cannot draw yet
    assert renderer.proc.poll() is None  # left drawing, not killed
    there = tmp_path / "there"
    assert not any((there / name).exists() for name in PLOTS)
    assert all(f"]({name})" in (there / "report.md").read_text() for name in PLOTS)  # the report names them
    gate.touch()
    assert renderer.proc.wait(60) == 0
    assert sorted(p.name for p in there.iterdir()) == sorted(FILES)  # no temporary file left behind
    for name in FILES:
        assert (tmp_path / "here" / name).read_bytes() == (there / name).read_bytes(), name
    assert not (there / PLOTS_ERROR).exists()


def test_a_renderer_left_drawing_that_fails_says_why_in_the_report_directory(tmp_path, monkeypatch):
    _two_cpus(monkeypatch)
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setattr(plot_renderer, "_renderer_command", lambda: _gated_renderer(gate, _FAIL))
    with background_renderer(wait=False):
        assert write_plots(sample_run(), tmp_path) == list(PLOTS)
    _wait_for(tmp_path / PLOTS_ERROR)
    assert "RuntimeError: no fonts" in (tmp_path / PLOTS_ERROR).read_text()
    assert not any((tmp_path / name).exists() for name in PLOTS)


def test_a_renderer_that_fails_while_waited_for_is_replaced_by_drawing_in_process(tmp_path, monkeypatch):
    _two_cpus(monkeypatch)
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setattr(plot_renderer, "_renderer_command", lambda: _gated_renderer(gate, _FAIL))
    with background_renderer():
        assert write_plots(sample_run(), tmp_path) == list(PLOTS)
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE
    assert not (tmp_path / PLOTS_ERROR).exists()  # the child's complaint went with its failure


def test_a_renderer_done_before_it_is_left_drawing_is_not_drawn_again(tmp_path, monkeypatch):
    """Released after it already finished: its result stands, and the plots are not drawn a second time here."""
    from harness.report import plots

    _two_cpus(monkeypatch)
    with background_renderer(wait=False):
        renderer = plot_renderer._RENDERER
        job = plot_data.plot_job(sample_run(), tmp_path)
        handed_over = plot_renderer.submit_to_renderer(job)
        assert renderer.proc.wait(60) == 0  # it drew every plot and ended
        monkeypatch.setattr(plots, "render", lambda *a: pytest.fail("drawn again in process"))
        assert handed_over() is True
    assert all((tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE for name in PLOTS)


def test_a_plot_is_never_seen_half_written(tmp_path, monkeypatch):
    """Each PNG is written under a temporary name and renamed; a failed write leaves neither."""
    from matplotlib.figure import Figure

    fig = Figure()
    fig.add_subplot().plot([1, 2])
    figures.save_png(fig, tmp_path / "a.png")
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]
    assert (tmp_path / "a.png").read_bytes()[:8] == PNG_SIGNATURE

    def broken(self, path, **kwargs):
        Path(path).write_bytes(PNG_SIGNATURE)  # half a file, then the disk fills up
        raise OSError(28, "No space left on device")

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    monkeypatch.setattr(FigureCanvasAgg, "print_png", broken)
    with pytest.raises(OSError):
        figures.save_png(fig, tmp_path / "b.png")
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]


@pytest.mark.parametrize("n", [0, 1, 5, 4500])
def test_cdf_points_start_at_zero_and_keep_the_extremes(n):
    points = plot_data._cdf_points(range(n, 0, -1), n)
    if n == 0:
        assert points is None
        return
    xs, ys = points
    assert len(xs) == len(ys) <= plot_data._MAX_POINTS + 2
    assert (xs[0], ys[0]) == (1 / plot_data.NS_PER_MS, 0.0) and (xs[-1], ys[-1]) == (n / plot_data.NS_PER_MS, 1.0)
    assert list(xs) == sorted(xs) and list(ys) == sorted(ys)


# ---------------------------------------------------------------------------------- per-rank plots


def _ranks_run(workers: int, dp: int = 2, capacity: int = 1000):
    """A run whose ranks (``workers`` x ``dp``) each sampled 30 times, one second apart."""
    from harness.report.run_data import RunData, Sample

    samples = [Sample(t * plot_data.NS_PER_S, w, r, (w + t) % 5, min(capacity, 10 * t * (w + 1)))
               for t in range(30) for w in range(workers) for r in range(dp)]
    return RunData(samples=samples, pools={"aggregated": {"workers": workers, "dp_size": dp, "kv_blocks": capacity}})


def _figure(data, field="kv_blocks"):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = plot_drawing.series_figure(plot_data._rank_panels(data, rank_series(data.samples), field), "title", "KV blocks")
    FigureCanvasAgg(fig).draw()
    return fig


def test_up_to_eight_ranks_are_lines_past_that_a_heatmap():
    assert [plot_data.series_form(n) for n in (1, 8, 9, 16, 64)] == ["lines", "lines", "heatmap", "heatmap", "heatmap"]


def test_eight_ranks_get_eight_colours_and_the_capacity():
    ax = _figure(_ranks_run(4)).axes[0]
    ranks = [line for line in ax.get_lines() if line.get_label().startswith("w")]
    assert len(ranks) == 8 and len({line.get_color() for line in ranks}) == 8
    capacity = [line for line in ax.get_lines() if line.get_label().startswith("capacity")]
    assert len(capacity) == 1 and list(capacity[0].get_ydata()) == [1000, 1000]


@pytest.mark.parametrize("workers", [8, 32])
def test_many_ranks_are_a_heatmap_under_the_pools_mean_and_max(workers):
    fig = _figure(_ranks_run(workers, capacity=10**6))
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert len(images) == 1 and images[0].get_array().shape == (2 * workers, 30)
    assert images[0].get_clim() == (0, 10 * 29 * workers)  # the colour scale runs to the largest value
    capacity = [line for line in fig.axes[0].get_lines() if line.get_label().startswith("capacity")]
    assert list(capacity[0].get_ydata()) == [10**6, 10**6]  # the capacity is a line above
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels[:2] == [f"mean of {2 * workers} ranks", "busiest rank"]


@pytest.mark.parametrize("workers", [2, 4, 8, 32])
def test_legends_are_outside_every_axes(workers):
    fig = _figure(_ranks_run(workers), "active_requests")
    renderer = fig.canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), ax


def test_a_disaggregated_run_gets_a_panel_per_pool():
    from harness.report.run_data import RunData, Sample

    samples = [Sample(t * plot_data.NS_PER_S, w, 0, 1, 5 * t, "prefill" if w < 2 else "decode")
               for t in range(10) for w in range(14)]
    data = RunData(samples=samples, pools={"prefill": {"workers": 2, "dp_size": 1, "kv_blocks": 100},
                                           "decode": {"workers": 12, "dp_size": 1, "kv_blocks": 200}})
    panels = plot_data._rank_panels(data, rank_series(data.samples), "kv_blocks")
    assert [(p.pool, p.form, p.capacity) for p in panels] == [("prefill", "lines", 100),
                                                                       ("decode", "heatmap", 200)]


def test_a_value_axis_spanning_decades_is_logarithmic(tmp_path):
    from harness.sweep.report import PointRow, _draw_against_axis

    assert figures.value_scale([2.0, 50.0, 90.0]) == "log" and figures.value_scale([10.0, 200.0]) == "linear"
    rows = [PointRow(point=i, axes={"cluster.workers": str(w)}, runs=1, ok=1, figures={"p99_ttft_ms": ttft})
            for i, (w, ttft) in enumerate([(1, 14_000.0), (2, 190.0), (4, 118.0)])]
    fig = _draw_against_axis(rows, "cluster.workers", ["1", "2", "4"], [("p99_ttft_ms", "p99")], "TTFT", "ms",
                             tmp_path / "t.png")
    assert fig.axes[0].get_yscale() == "log"
    rows[0].figures["p99_ttft_ms"] = 300.0
    fig = _draw_against_axis(rows, "cluster.workers", ["1", "2", "4"], [("p99_ttft_ms", "p99")], "TTFT", "ms",
                             tmp_path / "t.png")
    assert fig.axes[0].get_yscale() == "linear"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["decode", "prefill", "aggregated"]), st.integers(0, 3), st.integers(0, 1),
                          st.integers(0, 5), st.integers(0, 50), st.integers(0, 500)), max_size=60))
def test_rank_series_groups_the_samples_by_pool_and_rank_in_time_order(rows):
    """``rank_series`` (numpy) equals the plain grouping: per (pool, worker, rank), in key order, the samples by
    time, samples at one time in the order they came."""
    samples = [Sample(time_ns=t, worker_id=w, dp_rank=r, active_requests=a, kv_blocks=b, pool=p)
               for p, w, r, t, a, b in rows]
    expected: dict[tuple[str, int, int], list[tuple[int, int, int]]] = {}
    for smp in sorted(samples, key=lambda x: (x.worker_id, x.dp_rank, x.time_ns)):
        expected.setdefault((smp.pool, smp.worker_id, smp.dp_rank), []).append(
            (smp.time_ns, smp.active_requests, smp.kv_blocks))
    got = rank_series(samples)
    assert list(got) == sorted(expected)
    for key, (times_s, active, blocks) in got.items():
        assert [(round(t * 1e9), a, b) for t, a, b in zip(times_s.tolist(), active.tolist(), blocks.tolist())] \
            == expected[key]
