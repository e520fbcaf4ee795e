"""Deprecated alias of ``harness.workload.agentic_corpus`` (the workload's modules have their folder now), kept for one
release; ``python -m harness.agentic_corpus`` still writes the corpus."""

import sys
import warnings

from harness.workload.agentic_corpus import corpus_rows, main, write_corpus

__all__ = ["corpus_rows", "write_corpus", "main"]

warnings.warn("harness.agentic_corpus is deprecated: import from harness.workload.agentic_corpus",
              DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    print("harness.agentic_corpus is deprecated: run python -m harness.workload.agentic_corpus", file=sys.stderr)
    main(sys.argv[1:])
