"""Mock engines: per-DP-rank engine cores (KV block pool, vLLM-flavour scheduler, timing) that are told the time.

Depends on ``kvemu`` only. The names exported here are the workers' public API (``EngineCore``: the old name of
``VllmEngineCore``). Each flavour has its folder (``workers/vllm/``, ``workers/sglang/``); what they share sits
here; the async shell around them has its own folder (``workers/actor/``).
"""

import kvemu  # noqa: F401  first: kvemu._build picks the compiled or pure-Python modules before any loads (isort: skip)
from workers.admission import RejectReason, RequestRejected
from workers.blocks import BlockPool
from workers.config import EngineConfig
from workers.vllm.engine import AdvanceResult, EngineCore, StepResult, VllmEngineCore
from workers.pass_events import PassEvents
from workers.request import Request
from workers.timing import PassTimer, PolynomialTiming, TimingModel
from workers.trace import HashIdTokens, expand_hash_ids, mooncake_request
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
    "mooncake_request",
]
