"""Deprecated alias of ``harness.workload.agentic_corpus`` (the workload's modules have their folder now), kept for one release."""

import warnings

from harness.workload.agentic_corpus import corpus_rows, write_corpus

__all__ = ["corpus_rows", "write_corpus"]

warnings.warn("harness.agentic_corpus is deprecated: import from harness.workload.agentic_corpus",
              DeprecationWarning, stacklevel=2)
