"""Typed errors of kvemu's policy core; every message names the worker, rank or field involved."""

from __future__ import annotations

__all__ = [
    "KvemuError",
    "InvalidArgument",
    "ResourceExhausted",
    "KvCacheEventError",
    "ParentBlockNotFound",
    "BlockNotFound",
    "InvalidBlockSequence",
    "SchedulerError",
    "NoEndpoints",
    "AllEligibleWorkersOverloaded",
    "PinnedWorkerNotAllowed",
    "PinnedWorkerOverloaded",
    "DuplicateWorker",
    "UnknownWorker",
    "BookingFailed",
]


class KvemuError(Exception):
    """Base class of every error kvemu raises on purpose."""


class InvalidArgument(KvemuError, ValueError):
    """A caller passed a value that is out of range or inconsistent; nothing was changed.

    ``field`` names the offending field when one field is at fault (scenario errors use it for the key path).
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ResourceExhausted(KvemuError):
    """A bounded table or queue is full; nothing was changed."""


class KvCacheEventError(KvemuError):
    """A KV event could not be applied to the prefix index."""


class ParentBlockNotFound(KvCacheEventError):
    """A store named a parent block the worker does not hold; the whole store was rejected."""


class BlockNotFound(KvCacheEventError):
    """A removal named blocks the worker does not hold; the other blocks of the event were removed."""


class InvalidBlockSequence(KvCacheEventError):
    """A store repeats a block hash (within the event, with its parent, or elsewhere for the worker)."""


class SchedulerError(KvemuError):
    """Worker selection failed; the message says which workers were considered and why none fit."""


class NoEndpoints(SchedulerError):
    """No worker/rank is eligible for this request (or the pinned one does not exist)."""


class AllEligibleWorkersOverloaded(SchedulerError):
    """Every worker that would otherwise be eligible is over a busy threshold."""


class PinnedWorkerNotAllowed(SchedulerError):
    """The request pins a worker that its own allow-list excludes."""


class PinnedWorkerOverloaded(SchedulerError):
    """The request pins a worker that is over a busy threshold."""


class DuplicateWorker(KvemuError, ValueError):
    """A worker id was registered twice."""


class UnknownWorker(KvemuError, KeyError):
    """An operation named a worker that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown worker"


class BookingFailed(KvemuError):
    """Load booking was refused (e.g. the request id already holds a booking)."""
