"""Deprecated alias of ``harness.run.cluster`` and ``harness.run.factories`` (a run's modules have their folder now,
the factories their own module), kept for one release."""

import warnings

from harness.plugins import ALLOW_LOCAL_POLICIES_ENV
from harness.run.cluster import REQUEST_KINDS, Cluster, cluster
from harness.run.factories import (
    POOL_CONFIG, build_router, check_buildable, engine_config, make_policy, pool_ranks, pool_router, replica_front,
    replica_seed,
)

__all__ = ["Cluster", "cluster", "REQUEST_KINDS", "ALLOW_LOCAL_POLICIES_ENV", "POOL_CONFIG", "build_router",
           "check_buildable", "engine_config", "make_policy", "pool_ranks", "pool_router", "replica_front",
           "replica_seed"]

warnings.warn("harness.cluster is deprecated: import from harness.run.cluster (the in-process cluster) or "
              "harness.run.factories (routers and engines from a scenario)", DeprecationWarning, stacklevel=2)
