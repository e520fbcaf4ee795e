"""Mock engines: per-DP-rank engine cores (KV block pool, vLLM-flavour scheduler, timing) that are told the time.

Depends on ``kvemu`` only. The names exported here are the workers' public API (``EngineCore``: the old name of
``VllmEngineCore``). Each flavour has its folder (``workers/vllm/``, ``workers/sglang/``); what they share sits
here; the async shell around them has its own folder (``workers/actor/``).
"""

import warnings

import kvemu  # noqa: F401  first: kvemu._build picks the compiled or pure-Python modules before any loads (isort: skip)
from workers.admission import RejectReason, RequestRejected
from workers.blocks import BlockPool
from workers.config import EngineConfig
from workers.vllm.engine import AdvanceResult, EngineCore, StepResult, VllmEngineCore
from workers.pass_events import PassEvents
from workers.request import Request
from workers.timing import PassTimer, PolynomialTiming, TimingModel
from workers.hash_id_prompt import HashIdTokens, expand_hash_ids
from workers.mock_worker import DispatchOutcome, MockWorker

__all__ = [
    "AdvanceResult",
    "BlockPool",
    "DispatchOutcome",
    "EngineConfig",
    "EngineCore",
    "HashIdTokens",
    "MockWorker",
    "PassEvents",
    "PassTimer",
    "PolynomialTiming",
    "RejectReason",
    "Request",
    "RequestRejected",
    "StepResult",
    "TimingModel",
    "VllmEngineCore",
    "expand_hash_ids",
]


def __getattr__(name: str) -> object:
    """``workers.mooncake_request``: deprecated for one release (reading traces is the workload's: import it from
    ``harness.workload.traces.mooncake``)."""
    if name == "mooncake_request":
        warnings.warn("workers.mooncake_request is deprecated: import it from harness.workload.traces.mooncake",
                      DeprecationWarning, stacklevel=2)
        from harness.workload.traces.mooncake import mooncake_request

        return mooncake_request
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
