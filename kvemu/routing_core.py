"""``RoutingCore``: the sans-IO routing policy a router actor or an external simulation host drives.

It owns the registry, the prefix index (KV-event fed, or approximate), the load tracker, the
selector and a seeded random generator, and is told the time through its clock. The lifecycle is
``prepare`` → ``eligibility().….build()`` → ``select`` → (dispatch accepted) ``book`` →
``prefill_complete`` → ``free``. Selection never changes state; booking is the host's decision.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from kvemu.affinity import AffinityMode, Hold, SessionAffinity, Wait
from kvemu.approx import ApproxIndex
from kvemu.clock import Clock, ManualClock
from kvemu.config import BusyThresholds, RouterConfig, RouterOverrides
from kvemu.eligibility import Candidates, EligibilityBuilder
from kvemu.errors import InvalidArgument
from kvemu.group_index import GroupBlocks, group_of, group_tag, is_tagged, target_of
from kvemu.router_events import AllCleared, BlocksRemoved, BlocksStored, RouterEvent, StorageTier, apply_event
from kvemu.hashing import BASE_SEED, U64_MASK, block_seed, extend_sequence_hashes, local_block_hashes, sequence_hashes
from kvemu.index import PrefixIndex, WorkerKey
from kvemu.load import LoadProjection, LoadTracker
from kvemu.policy import CustomPolicy, PolicyContext
from kvemu.queue import PolicyQueue, QueueClass, QueueLimits
from kvemu.registry import DEFAULT_MAX_NUM_BATCHED_TOKENS, WorkerRegistry, WorkerSpec
from kvemu.selector import DefaultWorkerSelector, Selection, TierHits, evaluate, taint_factors
from kvemu.tier_index import TierIndex

__all__ = ["PreparedRequest", "RoutingCore", "LoadListener"]


class LoadListener(Protocol):
    """What ``RoutingCore`` tells about its load view's changes (``kvemu.replica_sync.SyncOutbox``)."""

    def booked(self, request_id: str, key: WorkerKey, blocks: list[int], prefill_tokens: int,
               local_hashes: list[int], seq_hashes: list[int]) -> None: ...

    def prefill_done(self, request_id: str) -> None: ...

    def freed(self, request_id: str) -> None: ...


class PreparedRequest:
    """A request reduced to what routing needs: its block hashes, length and effective config.

    Sequence hashes are computed on first use; ``RoutingCore.select`` takes the matched prefix's from
    the index (the index stores exactly these values) and hashes only the rest.
    """

    __slots__ = ("isl", "local_hashes", "_seqs", "config", "request_id", "session_id", "preferred_taints", "tiers",
                 "seq_source")

    def __init__(
        self,
        isl: int,
        local_hashes: list[int],
        config: RouterConfig,
        request_id: str | None = None,
        session_id: str | None = None,
        preferred_taints: Mapping[str, float] | None = None,
        tiers: TierHits | None = None,
    ) -> None:
        self.isl = isl
        self.local_hashes = local_hashes
        self._seqs: list[int] | None = None
        self.config = config
        self.request_id = request_id
        self.session_id = session_id
        self.preferred_taints = preferred_taints
        self.tiers = tiers
        self.seq_source: Callable[[], list[int]] | None = None
        """Where the prompt's sequence hashes come from when it hashes itself (shared with the engine)."""

    @property
    def seq_hashes(self) -> list[int]:
        """Rolling sequence hashes of the prompt blocks (the router's active-block ids)."""
        if self._seqs is None:
            source = self.seq_source
            self._seqs = source() if source is not None else sequence_hashes(self.local_hashes)
        return self._seqs

    def _seed_prefix(self, prefix: list[int]) -> None:
        if self._seqs is None and prefix and self.seq_source is None:
            self._seqs = prefix + extend_sequence_hashes(prefix[-1], self.local_hashes[len(prefix) :])

    def __repr__(self) -> str:
        return f"PreparedRequest(isl={self.isl}, blocks={len(self.local_hashes)}, request_id={self.request_id!r})"


class RoutingCore:
    """Registry + index + load + selector for one worker pool (aggregated, prefill or decode)."""

    def __init__(
        self,
        *,
        block_size: int,
        config: RouterConfig | None = None,
        clock: Clock | None = None,
        seed: int = 0,
        busy: BusyThresholds | None = None,
        policy: CustomPolicy | None = None,
        pool: str = "aggregated",
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidArgument(f"block_size must be a positive integer, got {block_size!r}", field="block_size")
        self.block_size = block_size
        self.config = config or RouterConfig()
        self.clock = clock or ManualClock()
        self.rng = random.Random(seed)
        self.busy = busy or BusyThresholds()
        self.policy = policy
        self.pool = pool
        self.registry = WorkerRegistry()
        self.load = LoadTracker()
        self.selector = DefaultWorkerSelector()
        self.approx: ApproxIndex | None = None
        self.groups: GroupBlocks | None = None
        """Hybrid engines' non-main KV cache groups (``kvemu.group_index``), from their first tagged event."""
        self.load_listener: LoadListener | None = None
        """Told every booking, prefill completion and free (router replicas announce them: ``kvemu.replica_sync``)."""
        self.tier_indexes: dict[StorageTier, TierIndex] = {}
        """Lower-tier (host, disk, external) prefix indexes, created by the first event for a tier."""
        if self.config.use_kv_events:
            self.index = PrefixIndex()
        else:
            self.approx = ApproxIndex(
                self.clock,
                ttl_secs=self.config.router_ttl_secs,
                max_tree_size=self.config.router_max_tree_size,
                prune_target_ratio=self.config.router_prune_target_ratio,
            )
            self.index = self.approx.index

    # ------------------------------------------------------------------ workers

    def rank_keys(self) -> tuple[WorkerKey, ...]:
        """Every registered ``(worker_id, dp_rank)``, sorted."""
        return self.registry.rank_keys()

    def add_worker(self, spec: WorkerSpec) -> None:
        """Register a worker; its block size, if announced, must equal the router's."""
        if spec.block_size is not None and spec.block_size != self.block_size:
            raise InvalidArgument(
                f"worker {spec.worker_id} announces block_size {spec.block_size} but the router uses "
                f"{self.block_size}; prefix matching would silently find nothing",
                field="block_size", worker_id=spec.worker_id,
            )
        self.registry.add(spec)

    def remove_worker(self, worker_id: int) -> list[str]:
        """Forget a worker everywhere; returns the request ids whose bookings were dropped."""
        self.registry.remove(worker_id)
        for tier_index in self.tier_indexes.values():
            tier_index.remove_worker(worker_id)
        if self.groups is not None:
            self.groups.remove_worker(worker_id)
        if self.approx is not None:
            self.approx.remove_worker(worker_id)
        else:
            self.index.remove_worker(worker_id)
        return self.load.drop_worker(worker_id)

    def apply_event(self, event: RouterEvent) -> None:
        """Apply a KV event to the index of its tier; raises ``KvCacheEventError`` on a bad event."""
        if event.tier is StorageTier.DEVICE:
            if self.approx is not None:
                raise InvalidArgument(
                    f"KV event from worker {event.worker_id}: this router runs without KV events "
                    "(use_kv_events=False) and learns from its own routing decisions",
                    worker_id=event.worker_id, dp_rank=event.dp_rank,
                )
            if self._apply_group_event(event):
                return
            apply_event(self.index, event)
            return
        tier_index = self.tier_indexes.get(event.tier)
        if tier_index is None:
            tier_index = self.tier_indexes[event.tier] = TierIndex()
        apply_event(tier_index, event)

    def _apply_group_event(self, event: RouterEvent) -> bool:
        """A hybrid engine's event (``kvemu.group_index``): True when it was applied here (to the groups kept aside,
        or, a main group's tagged one, stripped to the prefix index); False: the prefix index takes it as it is."""
        data = event.data
        groups = self.groups
        if isinstance(data, AllCleared):
            if groups is not None:
                groups.clear((event.worker_id, event.dp_rank))
            return False
        hashes = data.block_hashes
        if not hashes:
            return False
        tagged = is_tagged(hashes[0])
        if groups is None:
            if not tagged:
                return False
            groups = self.groups = GroupBlocks()
        key = (event.worker_id, event.dp_rank)
        main = groups.main.get(key)
        if not tagged:  # group 0
            if main is None or main == 0:
                if isinstance(data, BlocksStored):
                    groups.main[key] = 0
                return False
            groups.remove(key, [h | group_tag(0, 0) for h in hashes])  # (a sliding-window or state group 0)
            return True
        g = group_of(hashes[0])
        if isinstance(data, BlocksStored):
            if target_of(hashes[0]) == 0 and main is None:  # the first full-attention group seen is the main one
                main = groups.main[key] = 0 if self.index.tree_size(event.worker_id, event.dp_rank) else g
            if g == main:
                apply_event(self.index, RouterEvent(
                    worker_id=event.worker_id, dp_rank=event.dp_rank, tier=event.tier, event_id=event.event_id,
                    data=BlocksStored([h & U64_MASK for h in hashes], data.local_hashes, data.parent_hash,
                                      data.sequence_hashed)))
            else:
                groups.store(key, hashes)
            return True
        if g == main:
            apply_event(self.index, RouterEvent(worker_id=event.worker_id, dp_rank=event.dp_rank, tier=event.tier,
                                                event_id=event.event_id,
                                                data=BlocksRemoved([h & U64_MASK for h in hashes])))
        elif groups.knows(key, g):
            groups.remove(key, hashes)
        return True  # (a group the router cannot judge: dropped)

    def tier_hits(self, request: PreparedRequest, device: dict[WorkerKey, int]) -> TierHits | None:
        """Lower-tier extension hits per rank: blocks each tier holds contiguously past what the faster tiers
        hold (the host past the device prefix, disk and external past both), wherever that tier's copy of
        the prompt starts."""
        if not self.tier_indexes:
            return None
        paths = sequence_hashes(request.local_hashes)
        host = self.tier_indexes.get(StorageTier.HOST_PINNED)
        host_ext = host.runs_from(paths, device) if host is not None else {}
        disk_ext: dict[WorkerKey, int] = {}
        ahead = None
        for tier in (StorageTier.DISK, StorageTier.EXTERNAL):
            tier_index = self.tier_indexes.get(tier)
            if tier_index is not None:
                if ahead is None:
                    ahead = dict(device)
                    for key, h in host_ext.items():
                        ahead[key] = ahead.get(key, 0) + h
                for key, k in tier_index.runs_from(paths, ahead).items():
                    if k > disk_ext.get(key, 0):
                        disk_ext[key] = k
        return TierHits(host=host_ext, disk=disk_ext)

    # ------------------------------------------------------------------ requests

    def prepare(
        self,
        tokens: Sequence[int] | None = None,
        *,
        local_hashes: Sequence[int] | None = None,
        isl: int | None = None,
        lora_name: str | None = None,
        cache_namespace: str | None = None,
        overrides: RouterOverrides | None = None,
        request_id: str | None = None,
        session_id: str | None = None,
        preferred_taints: Mapping[str, float] | None = None,
        tiers: TierHits | None = None,
    ) -> PreparedRequest:
        """Hash a request once: local hashes for the index, sequence hashes for load tracking."""
        seq_source = None
        if local_hashes is None:
            if tokens is None:
                raise InvalidArgument("prepare needs tokens or local_hashes", field="tokens")
            if not tokens:
                raise InvalidArgument("tokens: the prompt is empty", field="tokens")
            seed = block_seed(lora_name, cache_namespace)
            own = getattr(tokens, "local_block_hashes", None)  # SelfHashingTokens
            if own is not None and seed == BASE_SEED:
                locs = own(self.block_size)
                # a SelfHashingTokens (it has local_block_hashes); mypy sees only the Sequence[int] parameter
                seq_source = functools.partial(tokens.sequence_hashes, self.block_size)  # type: ignore[attr-defined]
            else:
                locs = local_block_hashes(tokens, self.block_size, seed=seed)
            if isl is None:
                isl = len(tokens)
        else:
            locs = list(local_hashes)
            if isl is None:
                isl = len(locs) * self.block_size
        if isl < 0:
            raise InvalidArgument(f"isl must be >= 0, got {isl}", field="isl")
        prepared = PreparedRequest(
            isl,
            locs,
            self.config.with_overrides(overrides),
            request_id,
            session_id,
            preferred_taints,
            tiers,
        )
        prepared.seq_source = seq_source
        return prepared

    def eligibility(self) -> EligibilityBuilder:
        """A fresh builder bound to this core's registry and busy thresholds."""
        return EligibilityBuilder(self.registry, self._is_overloaded if self.busy.enabled else None)

    def overlaps(self, request: PreparedRequest) -> dict[WorkerKey, int]:
        """Cached prefix depth per rank for the request."""
        if self.approx is not None:
            return self.approx.find_matches(request.local_hashes)
        matches = self.index.find_matches(request.local_hashes)
        if self.groups is not None and matches:  # hybrid engines: a hit only where every group has it
            return self.groups.limit(matches, request.seq_hashes)
        return matches

    def select(self, request: PreparedRequest, candidates: Candidates | None = None) -> Selection:
        """Score the candidates and pick one; changes no state (the generator aside)."""
        if candidates is None:
            candidates = self.eligibility().build()
        config = request.config
        custom = self.policy is not None and candidates.pinned is None
        ranks = self.selectable(candidates)
        taint = None
        if request.preferred_taints:
            taint = taint_factors(
                ranks, request.preferred_taints, {s.worker_id: s.taints for s in self.registry.specs()}
            )
        overlaps = self.overlaps(request)
        if overlaps and request._seqs is None:
            request._seed_prefix(self.index.path_sequence_hashes(request.local_hashes, max(overlaps.values())))
        tiers = request.tiers if request.tiers is not None else self.tier_hits(request, overlaps)
        evaluation = evaluate(
            ranks,
            isl=request.isl,
            block_size=self.block_size,
            overlaps=overlaps,
            seq_hashes=request.seq_hashes,
            load=self.load,
            config=config,
            tiers=tiers,
            taint_factor=taint,
            decode_pool=self.pool == "decode",
            detail=False,
        )
        if custom:
            target = candidates.affinity_target if candidates.affinity_ranks else None
            ctx = PolicyContext(
                request.isl, self.block_size, request.request_id, request.session_id, target, candidates.pinned
            )
            return self.policy.select(ctx, candidates, evaluation, self.rng)  # type: ignore[union-attr]
        return self.selector.select(candidates, evaluation, config, self.rng)

    def selectable(self, candidates: Candidates) -> tuple[WorkerKey, ...]:
        """The ranks ``select`` compares: a custom policy sees every candidate, the default selector only an
        eligible affinity target's ranks (a pin's ranks, if pinned)."""
        if self.policy is not None and candidates.pinned is None:
            return candidates.ranks
        return candidates.for_default_selector()

    def acquire_affinity(
        self, builder: EligibilityBuilder, affinity: SessionAffinity, session: str
    ) -> tuple[Hold, Candidates] | Wait:
        """Acquire the session's affinity and resolve the candidates it allows, without selecting.

        Returns ``Wait`` while another request initializes the session. A bound hold narrows the
        candidates to the binding's target; when a hard binding's target is no longer eligible, the
        binding is invalidated here and this request re-initializes it. The hold is the caller's to commit
        or drop (a host with a queue keeps it while the request waits, as Dynamo's does); a raise drops it.
        """
        pin = builder.pinned
        result = affinity.try_acquire(session, pin)
        if isinstance(result, Wait):
            return result
        hold = result
        try:
            if hold.kind == "bound":
                candidates = builder.affinity(hold.target).build()
                if not candidates.affinity_ranks and affinity.mode is AffinityMode.HARD:
                    affinity.drop(hold)
                    affinity.invalidate(session, hold.revision, hold.version)
                    retry = affinity.try_acquire(session, pin)
                    if isinstance(retry, Wait):  # pragma: no cover - the slot was just freed
                        return retry
                    hold = retry
                    candidates = builder.affinity(None).build()
            else:
                candidates = builder.build()
            return hold, candidates
        except BaseException:
            affinity.drop(hold)
            raise

    def select_with_affinity(
        self,
        request: PreparedRequest,
        builder: EligibilityBuilder,
        affinity: SessionAffinity,
        session: str,
    ) -> tuple[Selection, Hold] | Wait:
        """Acquire the session's affinity, narrow eligibility to its target, select.

        Returns ``Wait`` while another request initializes the session. Otherwise the host dispatches
        ``selection`` and then calls ``affinity.commit(hold, selection.key)`` if the worker accepted it,
        or ``affinity.drop(hold)`` if not. When a hard binding's target is no longer eligible, the
        binding is invalidated here and this request re-initializes it on its new rank; in soft mode
        the commit simply moves the binding.
        """
        got = self.acquire_affinity(builder, affinity, session)
        if isinstance(got, Wait):
            return got
        hold, candidates = got
        try:
            return self.select(request, candidates), hold
        except BaseException:
            affinity.drop(hold)
            raise

    def book(self, request_id: str, selection: Selection, request: PreparedRequest) -> None:
        """Book the request's load on the selected rank (call once the worker accepted the dispatch)."""
        config = request.config
        blocks: Sequence[int] = ()
        if config.router_track_active_blocks:
            blocks = request.seq_hashes
            if not config.router_assume_kv_reuse:
                blocks = [self.rng.getrandbits(64) for _ in blocks]
        prefill = selection.prefill_tokens if config.router_track_prefill_tokens else 0
        self.load.add(request_id, selection.key, blocks, prefill, now_ns=self.clock.now_ns())
        listener = self.load_listener
        if listener is not None:
            listener.booked(request_id, selection.key, list(blocks), prefill, request.local_hashes, request.seq_hashes)
        if self.approx is not None:
            self.approx.record(selection.worker_id, selection.dp_rank, request.local_hashes, request.seq_hashes)

    def prefill_complete(self, request_id: str) -> bool:
        """The request's first token arrived: its prefill no longer loads the rank."""
        done = self.load.mark_prefill_completed(request_id)
        if done and self.load_listener is not None:
            self.load_listener.prefill_done(request_id)
        return done

    def free(self, request_id: str) -> WorkerKey | None:
        """The request finished (or failed): release its load; returns the rank it was on."""
        key = self.load.free(request_id)
        if key is not None and self.load_listener is not None:
            self.load_listener.freed(request_id)
        return key

    def note_output(self, request_id: str, isl: int, before: int, after: int, osl: int | None = None) -> None:
        """The response grew from ``before`` to ``after`` tokens: with ``router_track_output_blocks`` each
        block boundary the sequence (prompt + output) crossed adds one active block on the booked rank, weighted
        by the fraction of the expected output length ``osl`` still to come when it is known (``agent_hints.osl``)."""
        if self.config.router_track_output_blocks:
            weight = 1.0 if not osl else max(0.0, (osl - after) / osl)
            for _ in range((isl + after) // self.block_size - (isl + before) // self.block_size):
                self.load.add_output_block(request_id, weight)

    def policy_queue(self) -> PolicyQueue | None:
        """The queue ``router_queue_threshold`` asks for, or None when it is unset (requests never wait).

        One class: a rank is busy while its active prefill tokens exceed that fraction of its
        ``max_num_batched_tokens``; waiting requests are ordered by ``router_queue_policy``.
        """
        cfg = self.config
        if cfg.router_queue_threshold is None:
            return None

        def prefill(key: WorkerKey) -> int:
            rl = self.load.rank(key)
            return rl.active_prefill_tokens if rl is not None else 0

        def capacity(key: WorkerKey) -> int:
            w = self.registry.get(key[0])
            return (w.max_num_batched_tokens if w else None) or DEFAULT_MAX_NUM_BATCHED_TOKENS

        cls = QueueClass(busy_threshold_frac=cfg.router_queue_threshold, policy=cfg.router_queue_policy)
        limits = QueueLimits(requests_per_worker=cfg.router_queue_limit_per_worker)
        registry = self.registry
        return PolicyQueue(classes=[cls], prefill_tokens=prefill, batched_capacity=capacity, limits=limits,
                           rank_known=lambda key: key[0] in registry)

    def potential_loads(self, request: PreparedRequest, ranks: Sequence[WorkerKey] | None = None) -> list[LoadProjection]:
        """Each rank's load if the request were added (Dynamo's ``get_potential_loads``)."""
        keys = self.registry.rank_keys() if ranks is None else ranks
        return self.load.potential_loads(keys, request.seq_hashes)

    def _is_overloaded(self, key: WorkerKey) -> bool:
        rl = self.load.rank(key)
        if rl is None:
            return False
        busy = self.busy
        p = rl.active_prefill_tokens
        if busy.active_prefill_tokens is not None and p > busy.active_prefill_tokens:
            return True
        spec = self.registry.get(key[0])
        if busy.active_prefill_tokens_frac is not None:
            cap = (spec.max_num_batched_tokens if spec else None) or DEFAULT_MAX_NUM_BATCHED_TOKENS
            if p > busy.active_prefill_tokens_frac * cap:
                return True
        if busy.active_decode_blocks_frac is not None and spec is not None and spec.total_kv_blocks:
            if rl.active_decode_blocks > busy.active_decode_blocks_frac * spec.total_kv_blocks:
                return True
        return False
