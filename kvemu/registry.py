"""The router's view of the cluster: which workers exist, their DP ranks, taints and capacity."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec

from kvemu.errors import DuplicateWorker, InvalidArgument, UnknownWorker
from kvemu.index import WorkerKey

__all__ = ["WorkerSpec", "WorkerRegistry", "WorkerType", "DEFAULT_MAX_NUM_BATCHED_TOKENS"]

WorkerType = Literal["aggregated", "prefill", "decode"]
"""The pool a worker serves: both phases, or one of disaggregated serving's prefill and decode pools."""
DEFAULT_MAX_NUM_BATCHED_TOKENS = 10_000_000
"""Used for fractional busy thresholds when a worker published none: effectively never busy."""


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a worker announces at registration; its valid ranks are ``[dp_start, dp_start + dp_size)``."""

    worker_id: int
    dp_start: int = 0
    dp_size: int = 1
    taints: frozenset[str] = frozenset()
    worker_type: WorkerType = "aggregated"
    block_size: int | None = None
    total_kv_blocks: int | None = None
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.worker_id < 2**64:
            raise InvalidArgument(f"worker_id must be a u64, got {self.worker_id!r}", field="worker_id")
        if self.dp_start < 0 or self.dp_size < 1 or self.dp_start + self.dp_size > 2**32:
            raise InvalidArgument(
                f"worker {self.worker_id}: dp_start must be >= 0 and dp_size >= 1 within u32, "
                f"got dp_start={self.dp_start} dp_size={self.dp_size}",
                field="dp_size" if self.dp_size < 1 else "dp_start", worker_id=self.worker_id,
            )
        for name in ("block_size", "total_kv_blocks", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidArgument(f"worker {self.worker_id}: {name} must be >= 1, got {value!r}", field=name,
                                      worker_id=self.worker_id)

    @property
    def ranks(self) -> range:
        """The worker's DP ranks."""
        return range(self.dp_start, self.dp_start + self.dp_size)

    def keys(self) -> list[WorkerKey]:
        """``(worker_id, dp_rank)`` for every rank."""
        return [(self.worker_id, r) for r in self.ranks]


class WorkerRegistry:
    """Registered workers and fenced ids; iteration order is always by worker id (deterministic)."""

    def __init__(self, workers: Iterable[WorkerSpec] = ()) -> None:
        self._specs: dict[int, WorkerSpec] = {}
        self._fenced: set[int] = set()
        self._keys: tuple[WorkerKey, ...] | None = ()
        self.num_ranks = 0
        """DP ranks over all registered workers."""
        self.version = 0
        """Bumped on every change, so callers can cache derived views."""
        for spec in workers:
            self.add(spec)

    def add(self, spec: WorkerSpec) -> None:
        """Register a worker; a known id raises ``DuplicateWorker`` and changes nothing."""
        if spec.worker_id in self._specs:
            raise DuplicateWorker(f"worker {spec.worker_id} is already registered", worker_id=spec.worker_id)
        self._specs[spec.worker_id] = spec
        self.num_ranks += spec.dp_size
        self._fenced.discard(spec.worker_id)
        self._changed()

    def remove(self, worker_id: int) -> WorkerSpec:
        """Deregister a worker and return its spec."""
        try:
            spec = self._specs.pop(worker_id)
        except KeyError:
            raise UnknownWorker(f"worker {worker_id} is not registered", worker_id=worker_id) from None
        self.num_ranks -= spec.dp_size
        self._fenced.discard(worker_id)
        self._changed()
        return spec

    def fence(self, worker_id: int) -> None:
        """Mark a worker dead: never eligible (not even for pins) until it is removed or unfenced."""
        if worker_id not in self._specs:
            raise UnknownWorker(f"worker {worker_id} is not registered", worker_id=worker_id)
        self._fenced.add(worker_id)
        self._changed()

    def unfence(self, worker_id: int) -> None:
        """Make a fenced worker eligible again."""
        self._fenced.discard(worker_id)
        self._changed()

    def is_fenced(self, worker_id: int) -> bool:
        """Whether the worker is fenced."""
        return worker_id in self._fenced

    @property
    def has_fenced(self) -> bool:
        """Whether any worker is fenced (lets eligibility skip per-rank checks when none is)."""
        return bool(self._fenced)

    def get(self, worker_id: int) -> WorkerSpec | None:
        """The worker's spec, or ``None`` if unknown."""
        return self._specs.get(worker_id)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._specs

    def __len__(self) -> int:
        return len(self._specs)

    def specs(self) -> list[WorkerSpec]:
        """All specs sorted by worker id."""
        return [self._specs[w] for w in sorted(self._specs)]

    def rank_keys(self) -> tuple[WorkerKey, ...]:
        """Every ``(worker_id, dp_rank)`` of every registered worker, sorted (cached until a change)."""
        if self._keys is None:
            self._keys = tuple(k for spec in self.specs() for k in spec.keys())
        return self._keys

    def _changed(self) -> None:
        self._keys = None
        self.version += 1
