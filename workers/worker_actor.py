"""Deprecated alias of ``workers.actor.actor`` (the actor shell has its folder now), kept for one release."""

import warnings

from workers.actor.actor import KvPublisher, WorkerActor, WorkerRejected

__all__ = ["KvPublisher", "WorkerRejected", "WorkerActor"]

warnings.warn("workers.worker_actor is deprecated: import from workers.actor.actor",
              DeprecationWarning, stacklevel=2)
