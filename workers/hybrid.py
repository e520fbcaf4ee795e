"""Deprecated alias of ``workers.vllm.hybrid`` (the flavours have their folders now), kept for one release."""

import warnings

from workers.vllm.hybrid import ALIGN, FULL, GroupKeys, HybridKV, max_blocks, ONE, SPEC_KIND, U64, WINDOW

__all__ = ["HybridKV", "GroupKeys", "max_blocks", "FULL", "WINDOW", "ONE", "ALIGN", "U64", "SPEC_KIND"]

warnings.warn("workers.hybrid is deprecated: import from workers.vllm.hybrid",
              DeprecationWarning, stacklevel=2)
