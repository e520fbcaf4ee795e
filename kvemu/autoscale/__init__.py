"""Autoscaling: a policy told the time and a metrics snapshot returns add/remove-worker decisions.

Sans-IO like the rest of ``kvemu``: ``MetricsSnapshot`` in, ``ScaleDecision``s out; the ``Governor`` holds
them to the bounds and the cooldown and picks the workers to remove. A host (the harness's runner) builds
the snapshots and starts or stops the workers.
"""

from kvemu.autoscale.builtin import LoadSlaAutoscaler
from kvemu.autoscale.config import AutoscaleConfig
from kvemu.autoscale.governor import Governor
from kvemu.autoscale.policy import Autoscaler, AutoscalerFactory, ScaleDecision
from kvemu.autoscale.records import AutoscaleLog, DecisionRecord, WorkerCount
from kvemu.autoscale.snapshot import MetricsSnapshot, Percentiles, PoolMetrics, RankKv

__all__ = ["Autoscaler", "AutoscalerFactory", "AutoscaleConfig", "AutoscaleLog", "DecisionRecord", "Governor",
           "LoadSlaAutoscaler", "MetricsSnapshot", "Percentiles", "PoolMetrics", "RankKv", "ScaleDecision",
           "WorkerCount"]
