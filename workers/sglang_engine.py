"""Deprecated alias of ``workers.sglang.engine`` (the flavours have their folders now), kept for one release."""

import warnings

from workers.sglang.engine import SglangCore, SglangEngineCore

__all__ = ["SglangEngineCore", "SglangCore"]

warnings.warn("workers.sglang_engine is deprecated: import from workers.sglang.engine",
              DeprecationWarning, stacklevel=2)
