"""The PNG plots of ``kvemu run``'s report: ``write_plots`` and ``start_plots``, which draw them in process or in
the ``background_renderer()``'s child process, the same files either way.

Importing this module costs nothing: numpy and matplotlib are imported when plotting only. The parts, by job:
``plot_data`` (records and samples reduced to compact arrays, a plot job), ``plot_drawing`` (the plots drawn
from a job), ``figures`` (the figure helpers a sweep's and a plan's plots share) and ``plot_renderer`` (the
child process that imports matplotlib while a run runs, then draws).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from harness.report.plot_data import plot_job
from harness.report.plot_drawing import PLOTS, plot_names, render
from harness.report.plot_renderer import PLOTS_ERROR, background_renderer, submit_to_renderer

if TYPE_CHECKING:
    from harness.report.run_data import RunData

__all__ = ["PLOTS", "PLOTS_ERROR", "write_plots", "start_plots", "background_renderer"]


def start_plots(data: RunData, outdir: Path) -> Callable[[], list[str]]:
    """Start writing the plots of ``data`` into ``outdir``; call the result to finish (returns their names).

    With an active ``background_renderer()`` the plots are drawn by its process meanwhile (and, opened with
    ``wait=False``, on after this function's result has returned); otherwise (or if that process fails) the
    returned function draws them.
    """
    job = plot_job(data, Path(outdir))
    handed_over = submit_to_renderer(job)
    if handed_over is not None:
        def finish() -> list[str]:
            if not handed_over():  # the renderer failed: draw here, so a real error shows
                (Path(outdir) / PLOTS_ERROR).unlink(missing_ok=True)
                return render(job)
            return plot_names(job)
        return finish
    return lambda: render(job)


def write_plots(data: RunData, outdir: Path) -> list[str]:
    """Write the PNG plots (``PLOTS``, and ``routing_regret.png`` with routing truth; fixed size and dpi, default
    style, no timestamps); return their names."""
    return start_plots(data, outdir)()
