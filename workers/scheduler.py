"""Deprecated alias of ``workers.vllm.scheduler`` (the flavours have their folders now), kept for one release."""

import warnings

from workers.vllm.scheduler import Schedule, Scheduler

__all__ = ["Scheduler", "Schedule"]

warnings.warn("workers.scheduler is deprecated: import from workers.vllm.scheduler",
              DeprecationWarning, stacklevel=2)
