"""kvemu: an emulator of KV-cache-aware LLM serving clusters.

The names exported here (``__all__``) are the face for embedders, the stable embedding API (see
``docs/embedding.md``): the clocks, the routing core and its configuration, session affinity, the policy queue,
the request lifecycle and the messages it exchanges, the KV-event records, the request record and the error
families. Every other name lives in its own module; the names this face exported before are still reachable here
for one release, with a ``DeprecationWarning`` naming their module.
"""

from kvemu import _build  # first: it decides whether the compiled modules or their sources load (isort: skip)

import importlib
import warnings

from kvemu.affinity import SessionAffinity, sibling_group_key
from kvemu.clock import Clock, ManualClock, WallClock, ns_to_seconds, seconds_to_ns
from kvemu.config import BusyThresholds, RouterConfig, RouterOverrides
from kvemu.eligibility import EligibilityBuilder
from kvemu.errors import InvalidArgument, KvCacheEventError, KvemuError, SchedulerError
from kvemu.lifecycle import Lifecycle, LifecycleSettings
from kvemu.messages import Abort, ClientRequest, Dispatch, DispatchAck, Finished, RequestFailed, TokenBatch
from kvemu.policy import CustomPolicy
from kvemu.queue import PolicyQueue, QueueClass, QueueEntry, QueueRejected
from kvemu.records import RequestRecord
from kvemu.registry import WorkerSpec
from kvemu.router_events import AllCleared, BlocksRemoved, BlocksStored, RouterEvent, StorageTier
from kvemu.routing_core import RoutingCore
from kvemu.selector import Selection

__version__ = "0.1.0"

compiled: bool = _build.build_name() == "compiled"
"""Whether the compiled (mypyc) build of the hot modules is the one imported (``KVEMU_PURE_PYTHON=1``: false)."""

__all__ = [
    # time, owned by the host
    "Clock",
    "ManualClock",
    "WallClock",
    "seconds_to_ns",
    "ns_to_seconds",
    # the routing core: workers, eligibility, selection, configuration, custom policies
    "RoutingCore",
    "WorkerSpec",
    "EligibilityBuilder",
    "Selection",
    "RouterConfig",
    "RouterOverrides",
    "BusyThresholds",
    "CustomPolicy",
    # session affinity
    "SessionAffinity",
    "sibling_group_key",
    # the policy queue
    "PolicyQueue",
    "QueueClass",
    "QueueEntry",
    # the whole request lifecycle, and the messages it sends and is told
    "Lifecycle",
    "LifecycleSettings",
    "ClientRequest",
    "Dispatch",
    "Abort",
    "DispatchAck",
    "TokenBatch",
    "Finished",
    "RequestFailed",
    "RequestRecord",
    # what the engines' KV caches hold
    "RouterEvent",
    "BlocksStored",
    "BlocksRemoved",
    "AllCleared",
    "StorageTier",
    # error families (each family's members are in kvemu.errors)
    "KvemuError",
    "InvalidArgument",
    "SchedulerError",
    "KvCacheEventError",
    "QueueRejected",
    # the build
    "compiled",
    "__version__",
]

_MOVED: dict[str, str] = {
    "AffinityEvent": "kvemu.affinity",
    "AffinityMode": "kvemu.affinity",
    "Hold": "kvemu.affinity",
    "Lease": "kvemu.affinity",
    "Wait": "kvemu.affinity",
    "ApproxIndex": "kvemu.approx",
    "MAX_TIME_NS": "kvemu.clock",
    "AffinityTarget": "kvemu.eligibility",
    "Candidates": "kvemu.eligibility",
    "Ineligible": "kvemu.eligibility",
    "AllEligibleWorkersOverloaded": "kvemu.errors",
    "BlockNotFound": "kvemu.errors",
    "BookingFailed": "kvemu.errors",
    "DuplicateWorker": "kvemu.errors",
    "InvalidBlockSequence": "kvemu.errors",
    "NoEndpoints": "kvemu.errors",
    "ParentBlockNotFound": "kvemu.errors",
    "PinnedWorkerNotAllowed": "kvemu.errors",
    "PinnedWorkerOverloaded": "kvemu.errors",
    "ResourceExhausted": "kvemu.errors",
    "UnknownWorker": "kvemu.errors",
    "block_seed": "kvemu.hashing",
    "local_block_hashes": "kvemu.hashing",
    "sequence_hashes": "kvemu.hashing",
    "PrefixIndex": "kvemu.index",
    "WorkerKey": "kvemu.index",
    "Flight": "kvemu.lifecycle",
    "LoadProjection": "kvemu.load",
    "LoadTracker": "kvemu.load",
    "PolicyContext": "kvemu.policy",
    "WorkerRow": "kvemu.policy",
    "random_policy": "kvemu.policy",
    "round_robin_policy": "kvemu.policy",
    "DoNotQueue": "kvemu.queue",
    "QueueLimits": "kvemu.queue",
    "WorkerRegistry": "kvemu.registry",
    "PreparedRequest": "kvemu.routing_core",
    "TierHits": "kvemu.selector",
}
"""Names this face exported before it was cut to the embedder's, each with the module to import it from."""


def __getattr__(name: str) -> object:
    """Return a name that left the face, with a ``DeprecationWarning`` naming its module (for one release)."""
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'kvemu' has no attribute {name!r}")
    warnings.warn(f"kvemu.{name} is deprecated: import it from {module}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
