"""Typed errors of kvemu's policy core; every message names the worker, rank or field involved.

What a message names is also an attribute (``worker_id``, ``dp_rank``, ``field``, ``session_id``, ...), as
Dynamo's error variants carry it (``PinnedWorkerNotAllowed{worker_id}``, ``DpRankUnavailable{start, end}``):
hosts branch on the attributes, never on the text. An attribute the raise site did not know is ``None``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

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


def _rebuild(cls: type[KvemuError], args: tuple[object, ...], state: dict[str, Any]) -> KvemuError:
    """Unpickle without calling ``__init__`` (subclasses may take other positional arguments)."""
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class KvemuError(Exception):
    """Base class of every error kvemu raises on purpose.

    A subclass lists its attributes in ``attributes``; they are keyword arguments of ``__init__`` (default
    ``None``). Errors pickle with their attributes, so a sweep's worker process can ship them back.
    """

    attributes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, message: str = "", **attrs: Any) -> None:
        super().__init__(message)
        for name in type(self).attributes:
            setattr(self, name, attrs.pop(name, None))
        if attrs:
            raise TypeError(f"{type(self).__name__} has no attribute(s) {', '.join(sorted(attrs))}")

    def __reduce__(self) -> tuple[Callable[..., KvemuError], tuple[object, ...]]:
        return _rebuild, (type(self), self.args, dict(self.__dict__))


class InvalidArgument(KvemuError, ValueError):
    """A caller passed a value that is out of range or inconsistent; nothing was changed.

    ``field`` names the offending field when one field is at fault (scenario errors use it for the key path);
    ``session_id``, ``worker_id`` and ``dp_rank`` name the session, worker or rank involved, when one is.
    """

    attributes: ClassVar[tuple[str, ...]] = ("field", "session_id", "worker_id", "dp_rank")
    field: str | None
    session_id: str | None
    worker_id: int | None
    dp_rank: int | None


class ResourceExhausted(KvemuError):
    """A bounded table or queue is full; nothing was changed. ``resource`` names it, ``limit`` its size."""

    attributes = ("resource", "limit", "session_id")


class KvCacheEventError(KvemuError):
    """A KV event could not be applied to the prefix index; ``worker_id``/``dp_rank`` name the publisher."""

    attributes: ClassVar[tuple[str, ...]] = ("worker_id", "dp_rank", "block_hash")


class ParentBlockNotFound(KvCacheEventError):
    """A store named a parent block the worker does not hold; the whole store was rejected.

    ``block_hash`` is the missing parent."""


class BlockNotFound(KvCacheEventError):
    """A removal named blocks the worker does not hold; the other blocks of the event were removed.

    ``block_hash`` is the first missing block, ``block_hashes`` all of them."""

    attributes = KvCacheEventError.attributes + ("block_hashes",)


class InvalidBlockSequence(KvCacheEventError):
    """A store repeats a block hash (within the event, with its parent, or elsewhere for the worker).

    ``block_hash`` is the repeated block."""


class SchedulerError(KvemuError):
    """Worker selection failed; the message says which workers were considered and why none fit.

    ``worker_id``/``dp_rank`` name the pinned (or only) rank when the failure is about one."""

    attributes: ClassVar[tuple[str, ...]] = ("worker_id", "dp_rank")


class NoEndpoints(SchedulerError):
    """No worker/rank is eligible for this request (or the pinned one does not exist).

    ``reason`` is the ``Ineligible`` value of a pinned rank; for ``dp_rank_unavailable`` ``dp_start`` and
    ``dp_end`` (exclusive, as Dynamo's ``DpRankUnavailable{start, end}``) give the worker's valid ranks."""

    attributes = SchedulerError.attributes + ("reason", "dp_start", "dp_end")


class AllEligibleWorkersOverloaded(SchedulerError):
    """Every worker that would otherwise be eligible is over a busy threshold; ``ranks`` lists them."""

    attributes = SchedulerError.attributes + ("ranks",)


class PinnedWorkerNotAllowed(SchedulerError, InvalidArgument):
    """The request pins a worker its own allow-list excludes, or that disagrees with the eligible affinity
    target (the session's binding): Dynamo's ``PinnedWorkerNotAllowed{worker_id}``, HTTP 400.

    ``worker_id``/``dp_rank`` are the pin; ``affinity_target`` and ``session_id`` the binding it disagrees
    with, if that was the reason. It is also an ``InvalidArgument`` (Dynamo's affinity table reports the
    disagreement as one), so either ``except`` catches it."""

    attributes = ("worker_id", "dp_rank", "affinity_target", "session_id", "field")


class PinnedWorkerOverloaded(SchedulerError):
    """The request pins a worker that is over a busy threshold (``worker_id``/``dp_rank``: the pin)."""


class DuplicateWorker(KvemuError, ValueError):
    """A worker id was registered twice (``worker_id``)."""

    attributes = ("worker_id",)


class UnknownWorker(KvemuError, KeyError):
    """An operation named a worker that is not registered (``worker_id``)."""

    attributes = ("worker_id",)

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown worker"


class BookingFailed(KvemuError):
    """Load booking was refused (e.g. the request id already holds a booking on ``worker_id``/``dp_rank``)."""

    attributes = ("request_id", "worker_id", "dp_rank")
