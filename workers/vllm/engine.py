"""One DP rank's mock engine core, vLLM and TRT-LLM flavours: scheduler + KV block pool + timing, told the time (sans-IO).

Time model: a forward pass that starts at ``s`` ends at ``s + duration``; everything it produces
(tokens, first tokens, completions, KV events, freed slots) is stamped with its end. The next pass
starts when the previous one ends, or when work arrives at an idle engine. A pass that starts at ``s``
includes every request whose arrival time is ``<= s``.

What a pass computes (vLLM flavour): each scheduled request computes ``n`` tokens of KV; when its KV
catches up with all its tokens, the pass samples one new token for it (the first one ends its
prefill). Blocks are taken, and evicted (``BlockRemoved``), when the pass is scheduled, and the blocks
it fills are cached then too (``BlockStored``; a request admitted later in the same pass finds them,
as vLLM's ``allocate_slots`` and the reference mocker do); all of a pass's events share one batch
stamped with its end. Duration = prefill time + decode time if it decodes anything, with the reference
mocker's accounting (``VllmEngineCore._duration``): the prefill part from the prompt tokens computed (a batch
of ``b`` prompts counted as ``b * (floor(sum of prompt ends / b) - floor(sum of prefixes / b))``, up to
``b - 1`` fewer than the sum; a re-admitted request's generated tokens are recomputed for free), the
decode part a function of the context lengths of the requests sampling a token after an earlier one (a
re-admitted request included in the pass that catches it up), out of the pool's capacity (see
``workers/timing.py``).

Two drivers, identical results:

* ``step(now_ns)`` starts one pass at ``now_ns`` and returns it, finished (the readable reference);
* ``advance_to(t_ns)`` runs every pass that starts before ``t_ns`` and ends by ``t_ns`` (a pass that
  straddles ``t_ns`` stays in flight; a pass starting exactly at ``t_ns`` is not started, so requests
  arriving at ``t_ns`` may still be added and join it). Runs of pure decode passes are computed in
  one go: the batch does not change and each pass's decode KV tokens grow by the batch size, so a
  stretch of passes needs no scheduling, and block events inside a run are applied without re-scheduling.

``next_event_ns()`` tells a host how far it can jump: the next first token, completion, KV event,
preemption or freed slot. It is exact while only decodes run and for a pass in flight; before a pass
that would admit, prefill or preempt (or that starts at or after the next arrival) it is that pass's
start + 1, since advancing past its start starts it. So a zero-duration pass at ``t`` is reported as
``t + 1``, its effects stamped ``t``.

Host offload (``native_host_offload``; ``workers/vllm/host_tier.py``): stores that ended are applied when a pass
is planned and when one ends, the pass's filled prompt blocks are submitted at its end, and a pass that
evicts a GPU block still being stored starts when that store ends. While stores are in flight the engine
runs pass by pass (no decode runs) and reports every pass end as visible (host events may land in it).
A request loading host blocks (or waiting with them loaded) holds GPU blocks, so an idle engine may then
not admit its queue head: it waits for a change, as with held KV.
"""

from __future__ import annotations


import heapq
from typing import Any

from kvemu.records import EngineRecord
from workers.blocks import REMOVED, BlockPool
from workers.config import EngineConfig
from workers.pass_events import PassEvents
from workers.vllm.host_tier import HostTier
from workers.vllm.hybrid import HybridKV
from workers.request import Request
from workers.engine_base import RankCore
from workers.results import AdvanceResult, StepResult
from workers.vllm.scheduler import Schedule, Scheduler
from workers.sequence import FINISHED, HELD, RUNNING, WAITING, SeqState
from workers.timing import AnyTimingModel
from workers.vllm.fast_forward import FastForward

__all__ = ["VllmEngineCore", "EngineCore", "StepResult", "AdvanceResult"]


class _Pass:
    """A scheduled pass whose end effects are not applied yet."""

    __slots__ = ("start", "end", "sched", "version")

    def __bool__(self) -> bool:
        return bool(self.sched)

    def __init__(self, start: int, end: int, sched: Schedule, version: int) -> None:
        self.start = start
        self.end = end
        self.sched = sched
        self.version = version


class VllmEngineCore(RankCore):
    """The mock engine of one DP rank. Never sleeps, never reads a clock; the host says what time it is."""

    can_defer_kv_events = False
    """Every pass whose KV events are visible is an event: nothing to defer (``workers.rank_engine.RankEngine``)."""
    defer_kv_events = False
    """Not acted on (``can_defer_kv_events`` is False); the actor shell's ``RankEngine`` has it on every flavour."""

    def __init__(
        self, config: EngineConfig | None = None, *, dp_rank: int = 0, timing: AnyTimingModel | None = None,
        worker_id: int = 0,
    ) -> None:
        super().__init__(config if config is not None else EngineConfig(), dp_rank, timing, worker_id)
        cfg = self.config
        bs = cfg.resolved_block_size
        groups = cfg.kv_cache_groups
        # hybrid KV groups read the pool's dict themselves (workers.vllm.hybrid) and key past 64 bits: the pure tables
        self.pool = BlockPool(cfg.pool_blocks, bs, cfg.eviction_policy, groups=len(groups) or 1,
                              native=False if groups else None)
        self.scheduler = Scheduler(cfg, self.pool)
        self.scheduler.spec = self.spec
        self.hybrid: HybridKV | None = None
        """Hybrid KV cache groups (``kv_groups``; ``workers.vllm.hybrid``); None: the plain one-group engine."""
        self._groups_meta: list[tuple[str, int | None]] | None = None
        if groups:
            self.hybrid = self.scheduler.hybrid = HybridKV(groups, bs, cfg.enable_prefix_caching,
                                                           cfg.max_num_batched_tokens, cfg.kv_groups or ())
            self._groups_meta = self.hybrid.meta
            self._group_blocks = self.hybrid.whole
        offload = cfg.native_host_offload
        self.host: HostTier | None = None
        """The host KV tier (None: ``native_host_offload`` is off)."""
        if offload is not None:
            assert cfg.kv_cache_bytes_per_token is not None  # the config checks it
            self.host = self.scheduler.host = HostTier(offload, bs, cfg.kv_cache_bytes_per_token,
                                                       self.pool)
        self._block_size = bs
        self._caching = cfg.enable_prefix_caching
        self._held: dict[str, SeqState] = {}  # prefill legs done, holding their KV for a decode rank
        self._releasing: list[SeqState] = []  # held KV released while a pass is in flight: freed at its end
        self._steady = False
        self._dropped = 0  # requests aborted out of a queue
        self.run_passes = 0
        """Passes committed by decode runs as a whole rather than scheduled one by one (the fast path's share)."""
        self.fast = FastForward(self.scheduler, self.pool, self.timer, self.spec, self.hybrid, rank=self.dp_rank,
                                record_times=self._record_times, groups_meta=self._groups_meta)
        """Decode runs and look-ahead (``workers.vllm.fast_forward``)."""
        if self.scheduler.lag:  # (its decode runs free a finished request at once)
            self.fast.enabled = False

    # ----------------------------------------------------------------- queries

    @property
    def num_running(self) -> int:
        """Requests holding blocks (decoding or in prefill)."""
        return len(self.scheduler.running)

    @property
    def kv_usage(self) -> float:
        """Share of the pool's blocks in use by requests (neither free nor merely cached: a cached block a request
        holds is in use)."""
        pool = self.pool
        return pool.num_active_blocks / pool.num_blocks if pool.num_blocks else 0.0

    def group_usage(self) -> list[tuple[str, int | None, int]] | None:
        """Hybrid KV groups: (kind, window, blocks requests hold) per group, in ``group_idx`` order; None: off.

        Blocks of one shared pool (vLLM has no per-group metric; kvemu counts each group's block tables)."""
        hybrid = self.hybrid
        if hybrid is None:
            return None
        sch = self.scheduler
        counts = [0] * len(hybrid.kinds)
        for seq in [*sch.running, *self._held.values()]:
            for g, n in enumerate(hybrid.held(seq)):
                counts[g] += n
        return [(g.kind, g.window, n) for g, n in zip(hybrid.groups, counts)]

    @property
    def num_waiting(self) -> int:
        """Accepted requests not running (arrived or not yet arrived)."""
        return len(self.scheduler.waiting) + len(self.scheduler.future)

    def _next_start(self) -> int | None:
        sch = self.scheduler
        free_at = self._free_at
        if sch.running:
            return free_at
        if sch.waiting and not sch.held and not sch.transfers and not sch.loading:  # an idle engine admits its first: it fits the pool
            return free_at if free_at > self._now else self._now  # (now: an abort just freed the pool)
        if (sch.waiting or sch.incoming) and self._blocked != self._cache_version():
            # held or reserved blocks may keep them out: try (now: what freed blocks happened now), remember a failure
            return free_at if free_at > self._now else self._now
        a = sch.next_arrival_ns()
        if a is not None:
            return a if a > free_at else free_at
        return None

    # ------------------------------------------------------------- admission

    def _new_seq(self, req: Request, record: EngineRecord) -> SeqState:
        return SeqState(req, record, self._block_size, self._order)

    def _enqueue(self, seq: SeqState) -> None:
        self.scheduler.add(seq)

    def abort(self, request_id: str, reason: str = "cancelled") -> EngineRecord | None:
        """Drop an unfinished request (a client went away): its blocks are freed (full ones stay cached), it
        produces nothing more; returns its record with ``failure`` set, or None if no such request is here.

        A request in the pass in flight (``advance_to``) is released when that pass ends, as an engine frees
        an aborted request at its next step; the host gets nothing more about it either way.
        """
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            self.scheduler.drop_finishing(request_id)
            return None
        seq.record.failure = reason
        fl = self._inflight
        if fl is not None and seq in fl.sched.entries:
            self._aborting.append(seq)
            return seq.record
        self._release(seq)
        return seq.record

    def release_kv(self, request_id: str) -> bool:
        """A decode rank has the KV of this finished prefill leg: free its blocks (full ones stay cached).

        Applied at the next pass boundary (the end of a pass in flight); returns whether it was held here."""
        seq = self._held.pop(request_id, None)
        if seq is None:
            return False
        if self._inflight is not None:
            self._releasing.append(seq)
        else:
            self.scheduler.release_held(seq)
            self._steady = False
        return True

    @property
    def num_held(self) -> int:
        """Finished prefill legs whose KV is held for a decode rank."""
        return len(self._held)

    def cached_prefix_blocks(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` cached on this rank's GPU now (hybrid groups: the length every group accepts);
        read-only. Blocks only its host tier holds do not count."""
        if not self._caching:
            return 0
        if self.hybrid is not None:
            return self.hybrid.hit(self.pool, hashes, len(hashes))
        return self.pool.match_prefix(hashes, len(hashes))[0]

    def unsettled(self, now_ns: int) -> int:
        """Requests this rank still works for at ``now_ns``: unfinished ones, aborted or released ones the pass in
        flight still holds, finished prefill legs holding their KV for a decode rank, and requests whose prompt
        blocks are still being copied to the host tier (a store that ended by ``now_ns`` is done, even before an
        idle engine's next pass applies it). 0: the rank has settled."""
        ids = {*self._seqs, *self._held, *(s.rid for s in self._aborting), *(s.rid for s in self._releasing)}
        host = self.host
        if host is not None and host.busy:
            ids.update(store[3].rid for store in host.stores if store[0] > now_ns)
            ids.update(source.rid for source in host.staged)
        return len(ids)

    def _release(self, seq: SeqState) -> None:
        sch = self.scheduler
        if seq.status == RUNNING:
            sch.complete(seq)
        elif seq in sch.incoming:
            sch.incoming.remove(seq)
            seq.status = FINISHED
        elif any(entry[3] is seq for entry in sch.transfers):  # its KV in transit: give the reservation back
            sch.transfers = [e for e in sch.transfers if e[3] is not seq]
            heapq.heapify(sch.transfers)
            sch.running.append(seq)  # complete() releases what it holds, as for a running request
            seq.status = RUNNING
            sch.complete(seq)
        else:
            heaps: tuple[list[Any], ...] = (sch.future, sch.waiting, sch.loads)  # entries of 3 shapes, seq last
            for heap in heaps:
                for i, entry in enumerate(heap):
                    if entry[-1] is seq:
                        if heap is sch.loads and entry[2]:
                            # (loads exist only with a host tier) its load is dropped
                            self.host.loaded(entry[2])  # type: ignore[union-attr]
                        if seq.host_load is not None:  # it held the blocks of a host load: they go back
                            sch.free(seq)
                            seq.host_load = None
                            sch.loading -= 1
                        heap[i] = heap[-1]
                        heap.pop()
                        heapq.heapify(heap)
                        break
            seq.status = FINISHED
        self._dropped += 1  # (a request gone from the queue's head may let the next one in)
        self._steady = False

    # ------------------------------------------------------------ stepwise

    def _step_result(self, p: _Pass) -> StepResult:
        res = StepResult(p.start, p.end)  # (later than the step's time when it waits for host stores)
        sched = p.sched
        res.prefill_tokens = sched.prefill_tokens
        res.decodes = sched.decodes
        res._entries = sched.entries
        res._admitted = sched.admitted
        return res

    def _cache_version(self) -> int:
        return self.pool.version + self._dropped  # both only grow

    def _plan(self, start: int) -> _Pass:
        version = self._cache_version()
        host = self.host
        if host is None:
            sched = self.scheduler.schedule(start)
            return _Pass(start, start + self._duration(sched), sched, version)
        host.poll(start)
        log = self.pool.log
        mark = len(log)
        sched = self.scheduler.schedule(start)
        if host.pending and sched:  # evicted GPU blocks still being stored: the pass waits for their stores
            victims = [h for e in log[mark:] if e[0] == REMOVED for h in e[1]]
            start = max(start, host.fence_ns(victims), sched.fence_ns)  # (and for those of preempted requests)
        return _Pass(start, start + self._duration(sched), sched, version)

    def _duration(self, sched: Schedule) -> int:
        """How long the reference mocker takes for a pass (its accounting, quirks included).

        Prefill part: the requests computing prompt tokens (a re-admitted request's generated tokens are not
        prompt tokens: recomputing them is free), timed as b requests of (mean prompt position after the
        pass - mean before it) new tokens, each mean floored (up to b - 1 tokens fewer than the sum).
        Decode part: the requests that sample a token and either sampled one before (decoding, or a preempted
        request whose recomputation catches up in this pass), or compute nothing (a TRT-LLM prompt wholly
        cached), or are a decode leg's first pass, their context lengths summed (hybrid KV groups: layer-weighted,
        ``HybridKV.decode_kv``).
        """
        entries = sched.entries
        if not sched.decodes and len(entries) == 1:  # the common lone prefill chunk of a fresh request
            for seq, n in entries.items():
                if not seq.n_out and n:
                    return self.timer.pass_ns(n, 0, 0)
        b = ends = starts = decodes = decode_kv = 0
        k = self._spec_k
        contexts: list[int] | None = [] if self.hybrid is not None else None
        for seq, n in entries.items():
            c = seq.computed
            p = seq.prompt_len
            if c < p and seq.prefilling:  # (a decode leg's first pass computes its last prompt position: a decode)
                b += 1
                starts += c
                ends += c + n if c + n < p else p
            if c + n >= p + seq.n_out and (seq.n_out or not n or not seq.prefilling):
                decodes += 1
                # (a speculative decode verifies k drafts after its last token, whatever it accepts)
                ctx = c + 1 + k if k and seq.n_out and not seq.prefilling else c + n
                decode_kv += ctx
                if contexts is not None:
                    contexts.append(ctx)
        if contexts is not None and self.hybrid is not None:
            decode_kv = self.hybrid.decode_kv(contexts)
        prefill = b * (ends // b - starts // b) if b else 0
        return self.timer.pass_ns(prefill, decodes, decode_kv)

    def _finish(self, p: _Pass, out: AdvanceResult | None, res: StepResult | None) -> None:
        """Apply the end of a pass: computed tokens, filled blocks, sampled tokens, completions."""
        end = p.end
        sched = p.sched
        pool = self.pool
        bs = self._block_size
        if not sched.entries and not sched.preempted:  # async: nothing ran, the last pass's tokens were read
            self._free_at = end
            events = PassEvents(end, self.dp_rank, pool.log, bs, self._groups_meta) if pool.log else None
            pool.log = []
            if out is not None and events is not None:
                out.events.append(events)
            if res is not None:
                res.events = events
            return
        sampled: list[SeqState] = []
        for seq, n in sched.entries.items():
            seq.computed += n  # the blocks it filled were cached when the pass was scheduled
            if seq.computed >= seq.prompt_len + seq.n_out:  # the pass produced a token for this request
                sampled.append(seq)
        if self._spec_k:
            for seq in sampled:  # a decode computed the KV of all it emitted: all but the newest token
                extra = seq.computed - seq.prompt_len - seq.n_out
                if extra > 0:
                    self._book_burst(seq, extra, end)
        first = self._sample(sampled, end)
        completed = [seq for seq in sampled if seq.n_out == seq.max_tokens]
        gone = self._aborting
        finished = completed
        if gone:
            first[:] = [s for s in first if s not in gone]
            sampled[:] = [s for s in sampled if s not in gone]
            completed = [s for s in completed if s not in gone]
        for seq in finished:
            if gone and seq in gone:  # aborted while its last pass ran: freed in its place, reported nowhere
                gone.remove(seq)
                self.scheduler.complete(seq)
                continue
            if seq.req.kv_hold:  # a prefill leg: its KV waits for a decode rank
                self.scheduler.hold(seq)
                self._held[seq.rid] = seq
            elif self.scheduler.lag:  # async: freed once the next pass is decided
                seq.status = FINISHED
                self.scheduler.finishing.append(seq)
            else:
                self.scheduler.complete(seq)
            seq.record.completion_ns = end
            del self._seqs[seq.rid]
        if gone:  # released after the pass's completions, as if aborted right after it
            self._aborting = []
            for seq in gone:
                self._release(seq)
        if self._releasing:  # held KV pulled while the pass ran: freed at its end
            for seq in self._releasing:
                self.scheduler.release_held(seq)
            self._releasing = []
        if self.host is not None:
            self.host.submit(end)
        if self.scheduler.lag:
            self.scheduler.tokens_sampled(sampled)
        events = None
        if pool.log:
            events = PassEvents(end, self.dp_rank, pool.log, bs, self._groups_meta)
            pool.log = []
        self._free_at = end
        self.passes += 1
        running = self.scheduler.running
        self._steady = bool(
            sched.entries
            and not completed
            and not first
            and not sched.admitted
            and not sched.preempted
            and not sched.activated
            and not sched.reserved
            and sched.prefill_tokens == 0
            and len(sched.entries) == len(running)
            and (not (self.scheduler.waiting or self.scheduler.incoming) or self._cache_version() == p.version)
            and (self.host is None or not self.host.busy)
            and self.fast.enabled
        )
        self._report(p.start, end, out, res, admitted=sched.admitted, preempted=sched.preempted, first=first,
                     completed=completed, sampled=sampled, events=events, pulled=sched.activated)

    # --------------------------------------------------------- fast-forward

    def _decode_run(self, s: int, t_ns: int, out: AdvanceResult) -> int:
        """Commit a run of pure decode passes from ``s`` (``FastForward.run``); returns how many it committed."""
        j, T = self.fast.run(s, t_ns, out)
        if j:
            self._free_at = T
            self.passes += j
            self.run_passes += j
            out.passes += j
        return j

    # ------------------------------------------------------------- horizon

    def next_event_ns(self) -> int | None:
        """When to advance to for the next externally visible change (None: nothing pending); see the module doc.

        Nothing visible happens before it and ``advance_to`` it always makes progress, but for one thing: an idle
        engine whose waiting requests held or in-transit KV may keep out reports the next boundary once to find
        out; ask again after ``add_request``.
        """
        fl = self._inflight
        if fl is not None:
            if (self._aborting or not self.fast.enabled or not self._pass_quiet(fl)
                    or (self.host is not None and self.host.busy)):
                return fl.end if fl.end > fl.start else fl.start + 1
            return self.fast.horizon(fl.end, fl.start, fl.sched.entries)
        s = self._next_start()
        if s is None:
            return None
        sch = self.scheduler
        if s == self._free_at and self.fast.enabled and (self.host is None or not self.host.busy) and (
            self._steady or (sch.running and not sch.waiting and not sch.incoming
                             and not any(q.prefilling or not q.n_out for q in sch.running))
        ):  # (a decode leg's first pass gives its first token: visible)
            return self.fast.horizon(s, s, None)  # the next passes decode the same batch
        return s + 1

    def _pass_quiet(self, p: _Pass) -> bool:
        """Whether an in-flight pass will finish with no visible effect and leave a decode run behind."""
        sched = p.sched
        if sched.admitted or sched.preempted or sched.prefill_tokens or sched.activated or self.pool.log:
            return False
        if len(sched.entries) != len(self.scheduler.running):
            return False
        if (self.scheduler.waiting or self.scheduler.incoming) and self._cache_version() != p.version:
            return False
        bs = self._block_size
        for seq, n in sched.entries.items():
            if seq.n_out + n >= seq.max_tokens or not seq.n_out:  # a completion, or a decode leg's first token
                return False
            if self._caching and (seq.computed + n) // bs > seq.computed // bs:
                return False
        return True


    def reset_prefix_cache(self, now_ns: int) -> PassEvents | None:
        """Drop every cached block (vLLM's ``reset_prefix_cache``); refused (None) while requests hold blocks."""
        if self._inflight is not None or self.scheduler.running:
            return None
        if not self.pool.reset():
            return None
        self._steady = False
        entries = self.pool.log
        self.pool.log = []
        return PassEvents(max(now_ns, self._free_at), self.dp_rank, entries, self._block_size, self._groups_meta)

    def check_invariants(self) -> None:
        """Assert pool/scheduler consistency (tests): block accounting, holdings, statuses."""
        pool = self.pool
        pool.check()
        if self.host is not None:
            self.host.check()
        partial = 0
        refs: dict[int, int] = {}
        sch = self.scheduler
        holders = [*sch.running, *self._held.values(), *(e[3] for e in sch.transfers),
                   *(e[3] for e in sch.loads if e[3].host_load is not None),
                   *(e[3] for e in sch.waiting if e[3].host_load is not None)]
        assert sum(1 for q in holders if q.host_load is not None) == sch.loading
        for seq in holders:
            assert seq.status in (RUNNING, HELD, WAITING), seq
            assert 0 <= seq.n_full <= seq.n_alloc, seq
            assert seq.computed <= seq.n_alloc * self._block_size, seq
            if self.hybrid is not None:
                held = self.hybrid.held(seq)
                keys = self.hybrid.held_keys(seq)
                partial += sum(held) - len(keys)
            else:
                partial += seq.n_alloc - seq.n_full
                keys = seq.hashes[: seq.n_full]
            for h in keys:
                refs[h] = refs.get(h, 0) + 1
        assert refs == pool.active, "active block refcounts must equal the running sequences' holdings"
        assert pool.free + partial + len(pool.cached_hashes()) == pool.num_blocks, pool

    def __repr__(self) -> str:
        return (
            f"VllmEngineCore(rank={self.dp_rank}, now={self._now}, running={self.num_running}, "
            f"waiting={self.num_waiting}, {self.pool!r})"
        )


EngineCore = VllmEngineCore
"""The old name of ``VllmEngineCore`` (before the flavour folders), kept for one release."""
