"""The timing-model protocols (re-exported by ``workers.timing``).

They live apart because ``workers.timing`` is compiled by mypyc, which cannot compile a ``@runtime_checkable``
Protocol.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["TimingModel", "BatchAwareTimingModel"]


@runtime_checkable
class TimingModel(Protocol):
    """Unscaled forward-pass latencies in milliseconds (speedup ratios are applied by ``PassTimer``).

    A model whose decode latency depends on the batch as well sets ``batch_aware = True`` and takes a third
    argument, the number of requests decoding in the pass (``decode_ms(active, total, batch_size)``).
    """

    def prefill_ms(self, new_tokens: int) -> float:
        """Latency of computing ``new_tokens`` uncached prompt tokens in one pass (0 tokens -> 0 ms)."""
        ...

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int) -> float:
        """Latency of one decode step for the batch, given KV tokens in use out of the pool's capacity."""
        ...


@runtime_checkable
class BatchAwareTimingModel(Protocol):
    """A ``TimingModel`` whose decode latency depends on the batch too (``workers.profile.ProfileTiming``):
    ``batch_aware`` is true and ``decode_ms`` takes the number of requests decoding in the pass."""

    batch_aware: bool

    def prefill_ms(self, new_tokens: int) -> float:
        """Latency of computing ``new_tokens`` uncached prompt tokens in one pass (0 tokens -> 0 ms)."""
        ...

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int, batch_size: int) -> float:
        """Latency of one decode step for ``batch_size`` decoding requests holding ``active_kv_tokens``."""
        ...
