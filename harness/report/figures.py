"""The figure helpers every plot of kvemu's reports shares (a run's, a sweep's, a plan's): matplotlib's object API
(``Figure`` and ``FigureCanvasAgg``: no pyplot, no backend selection), fixed sizes and dpi (800×450 px; wider
with a legend, which sits right of the axes, never over the data) and fixed margins (a layout engine measures
every text first and costs as much as the drawing). matplotlib is imported when drawing only."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["DPI", "FIGSIZE", "legend_right", "new_figure", "no_data", "save_png", "value_scale"]

FIGSIZE = (8.0, 4.5)
DPI = 100
_MARGINS = {"left": 0.12, "right": 0.96, "bottom": 0.115, "top": 0.92}
"""Room for the titles and 6-digit tick labels (matplotlib writes 1e6 and beyond with an offset)."""
_PNG_COMPRESS_LEVEL = 3
"""zlib level of the PNG files: about 9% larger than the default level 6, a quarter faster to encode."""
_LOG_SPAN = 30.0
"""A value axis spanning more than this ratio (max / min) is drawn on a log scale."""


def value_scale(values: Iterable[float]) -> str:
    """``log`` when the positive ``values`` span decades (max / min > ``_LOG_SPAN``), else ``linear``."""
    positive = [v for v in values if v is not None and v > 0]
    return "log" if positive and max(positive) / min(positive) > _LOG_SPAN else "linear"


def new_figure(title: str, xlabel: str, ylabel: str, legend: bool = False) -> tuple[Any, Any]:
    """A one-axes figure; with ``legend``, wider, with room right of the axes for one (``legend_right``)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIGSIZE[0] + 2.4, FIGSIZE[1]) if legend else FIGSIZE, dpi=DPI)
    fig.subplots_adjust(**{**_MARGINS, "left": 0.095, "right": 0.7} if legend else _MARGINS)
    ax = fig.add_subplot()
    ax.set_title(title, y=1.0)  # where matplotlib puts it anyway, without measuring every tick label first
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def save_png(fig: Any, path: Path) -> None:
    """Write the PNG under a temporary name, then rename it: a reader (the plots may be drawn after ``kvemu run``
    has ended) never sees half a file."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    part = path.with_name(f".{path.name}.part")
    try:
        FigureCanvasAgg(fig).print_png(part, metadata={"Software": None},
                                       pil_kwargs={"compress_level": _PNG_COMPRESS_LEVEL})
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def legend_right(ax: Any, handles: list[Any] | None = None, offset: float = 0.01) -> Any:
    """A legend left-aligned just right of ``ax`` (outside it: it hides no data)."""
    if handles is None:
        handles, _ = ax.get_legend_handles_labels()
    return ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1 + offset, 1), fontsize="small",
                     borderaxespad=0)
