"""Deprecated alias of ``harness.workload.traces.convert`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.traces.convert import Conversion, losses, notes, convert_trace, as_chains

__all__ = ["Conversion", "losses", "notes", "convert_trace", "as_chains"]

warnings.warn("harness.traces.convert is deprecated: import from harness.workload.traces.convert",
              DeprecationWarning, stacklevel=2)
