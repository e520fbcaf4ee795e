"""The one percentile definition of kvemu's reports and benchmarks.

``summary.json``'s ``median``/``p75``/``p90``/``p95``/``p99`` keys mirror Dynamo's replay report, and
``bench.replay`` compares them with it, so they are computed as that report does: the value at the
rounded rank, with no interpolation between neighbours. For ``n`` sorted values the ``q``-th percentile
(0..100) is ``values[round((n - 1) * q / 100)]``, ties rounding up (away from zero), e.g. the median of
two values is the larger one. Checked against ``ai-dynamo-runtime`` 1.6.1's offline trace replay
(``summary`` vs its per-request values, bit for bit, for 1 to 301 requests).
"""

from __future__ import annotations

import math
from typing import Protocol, SupportsFloat

__all__ = ["percentile"]


class _SortedValues(Protocol):
    """What ``percentile`` reads: a length and values by index (a sequence, or a 1-D numpy array)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> SupportsFloat: ...


def percentile(sorted_values: _SortedValues, q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values: the value at rank round((n-1)·q/100).

    Raises ``ValueError`` for an empty sequence or a ``q`` outside [0, 100].
    """
    n = len(sorted_values)
    if n == 0:
        raise ValueError("percentile of an empty set")
    if not 0.0 <= q <= 100.0:  # also rejects NaN
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    pos = (n - 1) * q / 100.0  # evaluated in this order, as the reference does
    rank = math.floor(pos)
    if pos - rank >= 0.5:  # exact for pos >= 0: round half away from zero, not Python's half to even
        rank += 1
    return float(sorted_values[min(rank, n - 1)])
