"""Deprecated alias of ``workers.sglang.radix`` (the flavours have their folders now), kept for one release."""

import warnings

from workers.sglang.radix import RadixCache, RadixNode

__all__ = ["RadixCache", "RadixNode"]

warnings.warn("workers.radix is deprecated: import from workers.sglang.radix",
              DeprecationWarning, stacklevel=2)
