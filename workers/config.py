"""Mock engine configuration: the reference mocker's vLLM-flavour defaults, validated at construction.

``speedup_ratio`` divides every pass duration and ``decode_speedup_ratio`` additionally divides the
decode part, as the reference mocker does. A ratio of 0 is allowed and means "no engine delay": every
duration that ratio applies to is 0 ns, so passes take no virtual time and a live worker never sleeps;
live benchmarks use it to measure the system around the engines.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from kvemu.errors import InvalidArgument

__all__ = ["EngineConfig", "EvictionPolicyName", "PreemptionMode"]

EvictionPolicyName = Literal["lru", "lineage"]
PreemptionMode = Literal["lifo", "fifo"]


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgument(f"{name} must be an integer >= 1, got {value!r}")


def _ratio(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{name} must be a finite number >= 0 (0 = no engine delay), got {value!r}")


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One DP rank's engine knobs (names and defaults of the reference mocker, vLLM flavour).

    A speedup ratio of 0 means no engine delay (see the module docstring); live benchmarks use it.
    """

    num_gpu_blocks: int = 16384
    block_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    speedup_ratio: float = 1.0
    decode_speedup_ratio: float = 1.0
    preemption_mode: PreemptionMode = "lifo"
    eviction_policy: EvictionPolicyName = "lru"
    dp_size: int = 1
    record_token_times: bool = True
    """Keep every token's timestamp per request (off: only first token and completion are kept)."""

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "dp_size"):
            _positive_int(name, getattr(self, name))
        for name in ("speedup_ratio", "decode_speedup_ratio"):
            _ratio(name, getattr(self, name))
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidArgument(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode in one pass"
            )
        if self.preemption_mode not in ("lifo", "fifo"):
            raise InvalidArgument(f"preemption_mode must be 'lifo' or 'fifo', got {self.preemption_mode!r}")
        if self.eviction_policy not in ("lru", "lineage"):
            raise InvalidArgument(f"eviction_policy must be 'lru' or 'lineage', got {self.eviction_policy!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "record_token_times"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def capacity_tokens(self) -> int:
        """KV tokens one rank can hold (``num_gpu_blocks * block_size``)."""
        return self.num_gpu_blocks * self.block_size
