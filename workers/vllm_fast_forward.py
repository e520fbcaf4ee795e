"""Deprecated alias of ``workers.vllm.fast_forward`` (the flavours have their folders now), kept for one release."""

import warnings

from workers.vllm.fast_forward import FastForward

__all__ = ["FastForward"]

warnings.warn("workers.vllm_fast_forward is deprecated: import from workers.vllm.fast_forward",
              DeprecationWarning, stacklevel=2)
