"""kvemu: an emulator of KV-cache-aware LLM serving clusters.

The names exported here are the public, stable embedding API (see ``docs/embedding.md``); anything
imported from a submodule and not listed here may change.
"""

from kvemu import _build  # first: it decides whether the compiled modules or their sources load (isort: skip)

from kvemu.affinity import AffinityEvent, AffinityMode, Hold, Lease, SessionAffinity, Wait, sibling_group_key
from kvemu.approx import ApproxIndex
from kvemu.clock import MAX_TIME_NS, Clock, ManualClock, WallClock, ns_to_seconds, seconds_to_ns
from kvemu.config import BusyThresholds, RouterConfig, RouterOverrides
from kvemu.eligibility import AffinityTarget, Candidates, EligibilityBuilder, Ineligible
from kvemu.errors import (
    AllEligibleWorkersOverloaded,
    BlockNotFound,
    BookingFailed,
    DuplicateWorker,
    InvalidArgument,
    InvalidBlockSequence,
    KvCacheEventError,
    KvemuError,
    NoEndpoints,
    ParentBlockNotFound,
    PinnedWorkerNotAllowed,
    PinnedWorkerOverloaded,
    ResourceExhausted,
    SchedulerError,
    UnknownWorker,
)
from kvemu.router_events import AllCleared, BlocksRemoved, BlocksStored, RouterEvent, StorageTier
from kvemu.hashing import block_seed, local_block_hashes, sequence_hashes
from kvemu.index import PrefixIndex, WorkerKey
from kvemu.lifecycle import Flight, Lifecycle, LifecycleSettings
from kvemu.load import LoadProjection, LoadTracker
from kvemu.policy import CustomPolicy, PolicyContext, WorkerRow, random_policy, round_robin_policy
from kvemu.queue import DoNotQueue, PolicyQueue, QueueClass, QueueEntry, QueueLimits, QueueRejected
from kvemu.records import RequestRecord
from kvemu.registry import WorkerRegistry, WorkerSpec
from kvemu.routing_core import PreparedRequest, RoutingCore
from kvemu.selector import Selection, TierHits

__version__ = "0.1.0"

compiled: bool = _build.build_name() == "compiled"
"""Whether the compiled (mypyc) build of the hot modules is the one imported (``KVEMU_PURE_PYTHON=1``: false)."""

__all__ = [
    "AffinityEvent",
    "AffinityMode",
    "AffinityTarget",
    "AllCleared",
    "AllEligibleWorkersOverloaded",
    "ApproxIndex",
    "BlockNotFound",
    "BlocksRemoved",
    "BlocksStored",
    "BookingFailed",
    "BusyThresholds",
    "Candidates",
    "Clock",
    "CustomPolicy",
    "DoNotQueue",
    "DuplicateWorker",
    "Flight",
    "EligibilityBuilder",
    "Hold",
    "Ineligible",
    "InvalidArgument",
    "InvalidBlockSequence",
    "KvCacheEventError",
    "KvemuError",
    "Lease",
    "Lifecycle",
    "LifecycleSettings",
    "LoadProjection",
    "LoadTracker",
    "MAX_TIME_NS",
    "ManualClock",
    "NoEndpoints",
    "ParentBlockNotFound",
    "PinnedWorkerNotAllowed",
    "PinnedWorkerOverloaded",
    "PolicyContext",
    "PolicyQueue",
    "PrefixIndex",
    "PreparedRequest",
    "QueueClass",
    "QueueEntry",
    "QueueLimits",
    "QueueRejected",
    "RequestRecord",
    "ResourceExhausted",
    "RouterConfig",
    "RouterEvent",
    "RouterOverrides",
    "RoutingCore",
    "SchedulerError",
    "Selection",
    "SessionAffinity",
    "StorageTier",
    "TierHits",
    "UnknownWorker",
    "Wait",
    "WallClock",
    "WorkerKey",
    "WorkerRegistry",
    "WorkerRow",
    "WorkerSpec",
    "block_seed",
    "local_block_hashes",
    "ns_to_seconds",
    "random_policy",
    "round_robin_policy",
    "seconds_to_ns",
    "sequence_hashes",
    "sibling_group_key",
    "__version__",
    "compiled",
]
