"""Deprecated alias of ``workers.vllm.host_tier`` (the flavours have their folders now), kept for one release."""

import warnings

from workers.vllm.host_tier import HOST_REMOVED, HOST_STORED, HostTier

__all__ = ["HostTier", "HOST_STORED", "HOST_REMOVED"]

warnings.warn("workers.host_tier is deprecated: import from workers.vllm.host_tier",
              DeprecationWarning, stacklevel=2)
