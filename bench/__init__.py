"""Benchmarks: each ``python -m bench.NAME`` prints one ``figure name: value unit`` line per figure."""

from __future__ import annotations

import sys

__all__ = ["verdict"]


def verdict(bench: str, problems: list[str]) -> int:
    """The exit status of ``bench.NAME``: each problem printed on stderr as ``bench.NAME: FAILED: ...``; 1 if
    there was any (a run that did not complete, figures that disagree), else 0."""
    for p in problems:
        print(f"bench.{bench}: FAILED: {p}", file=sys.stderr, flush=True)
    return 1 if problems else 0
