"""Deprecated alias of ``harness.workload.traces`` (the workload's modules have their folder now), kept for one
release: each of its old modules (``harness.traces.graph``, ...) is an alias of the module of the same name there."""

import warnings

warnings.warn("harness.traces is deprecated: import from harness.workload.traces",
              DeprecationWarning, stacklevel=2)
