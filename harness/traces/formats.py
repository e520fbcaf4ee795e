"""Deprecated alias of ``harness.workload.traces.formats`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.traces.formats import FORMATS, WRITABLE, EMBEDDED_BLOCK_SIZE, detect_format, load_graph, writer

__all__ = ["FORMATS", "WRITABLE", "EMBEDDED_BLOCK_SIZE", "detect_format", "load_graph", "writer"]

warnings.warn("harness.traces.formats is deprecated: import from harness.workload.traces.formats",
              DeprecationWarning, stacklevel=2)
