"""Deprecated alias of ``workers.vllm.engine`` (the flavours have their folders now), kept for one release."""

import warnings

from workers.vllm.engine import AdvanceResult, EngineCore, StepResult, VllmEngineCore

__all__ = ["VllmEngineCore", "EngineCore", "StepResult", "AdvanceResult"]

warnings.warn("workers.vllm_engine is deprecated: import from workers.vllm.engine",
              DeprecationWarning, stacklevel=2)
