"""vLLM-flavour scheduler of one engine core: who runs in the next forward pass and with how many tokens.

Per pass, with one token budget (``max_num_batched_tokens``): running requests that decode get one
token each (with speculative decoding a decode computes the KV of the tokens it emits, drawn as it is
scheduled, but still takes one token of the budget), then running requests still in (chunked) prefill
get the next chunk, then waiting requests are admitted in queue order while the budget,
``max_num_seqs`` and free blocks allow. Admission costs
the uncached prompt tokens only (prefix hits are free), but the head of the queue waits unless blocks
for its whole known sequence (less its cached prefix blocks in use) are free or evictable, although only
the pass's chunk is allocated (the reference mocker's vLLM gate). Blocks a pass fills are cached as it is
scheduled, so a request admitted later in the same pass reuses them. When a running request needs a block and none
can be freed by eviction, running requests are preempted (LIFO: the latest admitted; FIFO: the earliest)
and recomputed later; a pass that preempted admits nothing, as in vLLM.

TRT-LLM flavour (``guaranteed_no_evict``): the same passes, but a waiting request is admitted only when
its whole KV (``ceil((prompt + max_tokens) / block_size)`` blocks, less the prefix blocks running requests
already hold) fits beside what every running request may still need; the queue head waits (no request
overtakes it) and nothing is ever preempted. Its prefix cache reuses every cached full block: a
block-aligned prompt that is fully cached computes no prompt token and samples its first token in a
pass whose decode part counts its prompt.

Hybrid KV cache groups (``kv_groups``; ``workers.vllm.hybrid``): a request's block need is summed over the groups,
each sliding-window group first freeing the blocks that left its window (vLLM's ``allocate_slots`` order), a
prefix hit is the length every group accepts, and the admission gate counts each group's most blocks at once.
With a Mamba ``align`` state group a fresh request's prefill chunks are whole blocks, cut at the prompt's last
block boundary (``HybridKV.chunk``); a request whose chunk rounds to nothing is not scheduled in that pass.

Disaggregated decode legs (requests whose prompt KV comes from a prefill rank) do not queue with the
others: at each pass boundary the first of them that arrived reserves blocks for its prompt (less what is
cached here) and a sequence slot, in arrival order, the head waiting until it fits; its transfer then
runs, and at the first boundary after it ends the request joins the running batch with its prompt
computed, to decode.

With a host tier (``workers.vllm.host_tier``), the prompt blocks a pass fills are staged for storing, and a
waiting request whose GPU prefix is followed by resident host blocks leaves the queue to load them, others
going ahead; when the load ends it takes its place again and is admitted with them cached. As vLLM does
before an asynchronous load, it takes its GPU prefix and allocates the loaded blocks when the load starts
and holds them until it is admitted (so nobody evicts that prefix meanwhile); a load starts only if blocks
for the request's whole known sequence (less its GPU prefix in use) fit beside what the prefills already in
flight (running, loading, or loaded and waiting) still need for theirs, else the head waits (the reference's
load headroom: loads cannot be preempted, so they must never lock the pool). Should a preempted head outgrow
that headroom while nothing runs, the first request holding loaded blocks goes first (kvemu's own way out of
that lock; the reference was not seen in it).
"""

from __future__ import annotations

import heapq
from collections import deque

from kvemu.transfer import transfer_delay_ns, transfer_tokens
from workers.blocks import BlockPool
from workers.config import EngineConfig
from workers.vllm.host_tier import HostTier
from workers.vllm.hybrid import HybridKV
from workers.speculative import DraftSampler
from workers.sequence import FINISHED, HELD, RUNNING, WAITING, SeqState

__all__ = ["Scheduler", "Schedule"]


class Schedule:
    """The decisions of one pass: tokens per request (in scheduling order), admissions, preemptions."""

    __slots__ = ("entries", "admitted", "preempted", "prefill_tokens", "decodes", "activated", "reserved", "fence_ns",
                 "read")

    def __init__(self) -> None:
        self.entries: dict[SeqState, int] = {}
        self.admitted: list[SeqState] = []
        self.preempted: list[SeqState] = []
        self.prefill_tokens = 0
        self.decodes = 0
        self.activated: list[SeqState] = []
        """Decode legs whose KV arrived: they joined the running batch at this pass's start."""
        self.reserved = 0
        """Decode legs that reserved their prompt's blocks at this pass's start."""
        self.fence_ns = 0
        """Host offload: when the last host store of a preempted request's blocks ends (the pass waits for it)."""
        self.read = False
        """Async: the last pass's tokens were read as this one was decided (blocks cached, finished ones freed)."""

    def __bool__(self) -> bool:
        return bool(self.entries or self.preempted or self.read)


def _victim_key(seq: SeqState) -> tuple[int, int, int]:
    return seq.req.priority, seq.record.arrival_ns, seq.order


class Scheduler:
    """Waiting queue (priority, then arrival, then submission order), running list (admission order)."""

    __slots__ = (
        "pool",
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "prefix_caching",
        "chunked_prefill",
        "lifo",
        "reserve",
        "future",
        "waiting",
        "running",
        "incoming",
        "transfers",
        "held",
        "host",
        "loads",
        "loading",
        "spec",
        "hybrid",
        "exact",
        "by_priority",
        "lag",
        "finishing",
        "in_flight",
        "_in_flight",
    )

    def __init__(self, config: EngineConfig, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = config.resolved_block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.prefix_caching = config.enable_prefix_caching
        self.chunked_prefill = config.enable_chunked_prefill
        self.lifo = config.preemption_mode == "lifo"
        self.exact = config.backend == "vllm" and config.vllm.semantics != "dynamo"
        """vLLM's own scheduler (``vllm.semantics``): one pass over the running requests in their order, its victims."""
        self.by_priority = config.vllm.scheduling_policy == "priority"
        """Whether the waiting queue orders by request priority (else by arrival only: vLLM's fcfs)."""
        self.lag = self.exact and config.vllm.async_scheduling
        """vLLM's asynchronous scheduling: each pass is decided before the last one's tokens are known."""
        self.finishing: list[SeqState] = []
        """Async: requests whose last token the last pass made; they keep their slot and blocks (and are not
        scheduled) until the next pass is decided, as vLLM frees them when it reads that token."""
        self.in_flight: list[SeqState] = []
        """Async: the requests that received a token in the last pass, in its order (the token is not known yet
        when this pass is decided; when it is read, their blocks up to it are cached)."""
        self._in_flight: set[SeqState] = set()
        self.reserve = config.backend == "trtllm"
        """TRT-LLM: admission reserves each request's whole KV; no preemption; full-prompt prefix reuse."""
        self.future: list[tuple[int, int, SeqState]] = []
        """Accepted requests whose arrival time is still ahead: heap of (arrival_ns, order, seq)."""
        self.waiting: list[tuple[int, int, int, SeqState]] = []
        """Arrived requests not running: heap of (priority, arrival_ns, order, seq)."""
        self.running: list[SeqState] = []
        self.incoming: deque[SeqState] = deque()
        """Decode legs that arrived and wait to reserve their prompt's blocks (arrival order)."""
        self.transfers: list[tuple[int, int, int, SeqState]] = []
        """Decode legs with blocks reserved, their KV in transit: heap of (transfer end, arrival, order, seq)."""
        self.held = 0
        """Prefill legs done and holding their KV for a decode rank (their blocks stay in use)."""
        self.host: HostTier | None = None
        """The host tier (``native_host_offload``), set by the engine."""
        self.loading = 0
        """Requests holding blocks for a host load (running it, or waiting with it done)."""
        self.spec: DraftSampler | None = None
        """Speculative decoding: the rank's draws, one per decode scheduled (set by the engine)."""
        self.hybrid: HybridKV | None = None
        """Hybrid KV cache groups (``workers.vllm.hybrid``; vLLM flavour), set by the engine; None: one group."""
        self.loads: list[tuple[int, int, list[int], SeqState]] = []
        """Requests out of the queue until their host blocks are loaded (or a store they wait for ends): heap of
        (ready, order, blocks loaded, seq)."""

    def priority(self, seq: SeqState) -> int:
        """``seq``'s place in the waiting queue's first key: its request's priority, or 0 under vLLM's fcfs."""
        return seq.req.priority if self.by_priority else 0

    def add(self, seq: SeqState) -> None:
        """Queue an accepted request; it becomes schedulable at its arrival time."""
        heapq.heappush(self.future, (seq.record.arrival_ns, seq.order, seq))

    def next_arrival_ns(self) -> int | None:
        """When the next request arrives, or a decode leg's KV transfer ends (both change the next pass)."""
        t = self.future[0][0] if self.future else None
        if self.loads and (t is None or self.loads[0][0] < t):
            t = self.loads[0][0]
        if self.transfers:
            ready = self.transfers[0][0]
            if t is None or ready < t:
                return ready
        return t

    def release_arrivals(self, now_ns: int) -> None:
        """Move requests that have arrived by ``now_ns`` into the waiting queue (decode legs: ``incoming``)."""
        future = self.future
        while future and future[0][0] <= now_ns:
            arrival, order, seq = heapq.heappop(future)
            seq.status = WAITING
            if seq.req.kv_transfer is not None:
                self.incoming.append(seq)
            else:
                heapq.heappush(self.waiting, (self.priority(seq), arrival, order, seq))
        loads = self.loads
        if not loads or loads[0][0] > now_ns:
            return
        done = []
        while loads and loads[0][0] <= now_ns:
            _, order, blocks, seq = heapq.heappop(loads)
            done.append((self.priority(seq), seq.record.arrival_ns, order, blocks, seq))
        done.sort(key=lambda d: d[:3])  # in queue order (a request's order is its host's submission order)
        for _, _, order, blocks, seq in done:
            if blocks:
                self.host.loaded(blocks)  # type: ignore[union-attr]  # loads happen only with a host tier
                # its loaded blocks hold the prompt's KV now: they are cached (vLLM caches them at this pass)
                first, _, full = seq.host_load  # type: ignore[misc]  # set by _load with the blocks
                self.pool.promote(seq.hashes, first, full, seq)
                seq.n_full = full
            heapq.heappush(self.waiting, (self.priority(seq), seq.record.arrival_ns, order, seq))

    def schedule(self, now_ns: int) -> Schedule:
        """Decide the pass starting at ``now_ns``; blocks are allocated (and evicted) as decided."""
        self.release_arrivals(now_ns)
        sched = Schedule()
        if self.incoming or self.transfers:
            self._transfer(now_ns, sched)
        entries = sched.entries
        budget = self.max_num_batched_tokens
        bs = self.block_size
        pool = self.pool
        running = self.running
        caching = self.prefix_caching
        spec = self.spec
        hybrid = self.hybrid
        exact = self.exact
        for decoding in (False,) if exact else (True, False):  # vLLM: one pass, in running order
            for seq in list(running):
                if seq.status != RUNNING or (seq.prefilling == decoding and not exact):
                    continue
                if budget <= 0:
                    break
                decodes = not seq.prefilling if exact else decoding
                n = seq.prompt_len + seq.n_out - seq.computed
                if n > budget:
                    n = budget
                if hybrid is not None and not seq.n_out:
                    n = hybrid.chunk(seq, seq.computed, n)  # (an align state group: block-aligned chunks)
                    if not n:
                        continue
                spent = n
                if spec is not None and decodes and seq.n_out:  # it verifies drafts: 1 + accepted tokens
                    n = spec.next()
                    if n > seq.max_tokens - seq.n_out:
                        n = seq.max_tokens - seq.n_out
                need = grow = -(-(seq.computed + n) // bs) - seq.n_alloc
                if hybrid is not None:
                    hybrid.skip(pool, seq)  # out-of-window blocks go first (vLLM's allocate_slots order)
                    need = hybrid.grow_need(grow)
                if need > pool.available:
                    if self.reserve:  # cannot happen under the reservation; never preempt: stop here
                        break
                    budget += self._preempt_until(seq, need, sched)
                    if seq.status != RUNNING:
                        if exact and not self.by_priority:
                            break  # vLLM (fcfs): a request that had to preempt itself ends the pass over running
                        continue
                if need > 0:
                    pool.allocate(need)
                if grow > 0:  # (block positions: the same as need but with hybrid groups)
                    seq.n_alloc += grow
                if caching:
                    upto = seq.computed + n
                    if self.lag and seq in self._in_flight and upto > seq.prompt_len + seq.n_out - 1:
                        upto = seq.prompt_len + seq.n_out - 1  # (vLLM caches known tokens only)
                    self._cache_filled(seq, upto)
                entries[seq] = n
                budget -= spent  # (a decode takes one token of the budget, drafts or not, as in Dynamo's mocker)
                if decodes:
                    sched.decodes += 1
                else:
                    sched.prefill_tokens += n
        if not sched.preempted:
            self._admit(now_ns, budget, sched)
        if self.lag and (self.in_flight or self.finishing):
            self._read_tokens()
            sched.read = True
        return sched

    def tokens_sampled(self, sampled: list[SeqState]) -> None:
        """Async: the pass that just ended gave these requests a token (read when the next pass is decided)."""
        self.in_flight = sampled
        self._in_flight = set(sampled)

    def drop_finishing(self, rid: str) -> bool:
        """Async: a request whose last token is not read yet is dropped (aborted) now, as vLLM frees it then:
        its slot and blocks go at once, nothing more of it is cached. Returns whether there was one."""
        for seq in self.finishing:
            if seq.rid == rid:
                self.finishing.remove(seq)
                self.running.remove(seq)
                self.free(seq)
                return True
        return False

    def _read_tokens(self) -> None:
        """Async: once the next pass is decided, the last pass's tokens are read: the blocks they complete are
        cached (requests still running, or finishing), and the finished requests freed, as vLLM's update does."""
        if self.prefix_caching:
            finishing = self.finishing
            for seq in self.in_flight:
                if seq.status == RUNNING or (seq.status == FINISHED and seq in finishing):  # (not aborted ones)
                    self._cache_filled(seq, seq.computed)
        self.in_flight = []
        self._in_flight = set()
        for seq in self.finishing:
            self.running.remove(seq)
            self.free(seq)
        self.finishing = []

    def _reserved_blocks(self) -> int:
        """TRT-LLM: blocks the running requests and the decode legs in transit may still need to complete."""
        bs = self.block_size
        holders = self.running if not self.transfers else [*self.running, *(e[3] for e in self.transfers)]
        return sum(-(-(r.prompt_len + r.max_tokens) // bs) - r.n_alloc for r in holders)

    def _transfer(self, now_ns: int, sched: Schedule) -> None:
        """Decode legs at a pass boundary: reserve for the arrived ones in order, activate those whose KV came."""
        incoming = self.incoming
        pool = self.pool
        bs = self.block_size
        transfers = self.transfers
        hybrid = self.hybrid
        while incoming and len(self.running) + len(transfers) < self.max_num_seqs:
            seq = incoming[0]
            xfer = seq.req.kv_transfer
            assert xfer is not None
            whole = -(-seq.prompt_len // bs)
            full = seq.prompt_len // bs
            carried = 0
            if hybrid is not None:  # per group what it still holds (workers.vllm.hybrid)
                hits, need, inactive_hits, carried = hybrid.land(pool, seq, seq.prompt_len, False,
                                                                 xfer.mode != "full_prompt")
            else:
                hits, inactive_hits = pool.match_prefix(seq.ensure_hashes(full), full) if self.prefix_caching else (0, 0)
                need = whole - hits
            if need > pool.available - inactive_hits:
                break  # the head waits for room; nothing overtakes it
            if self.reserve and (-(-(seq.prompt_len + seq.max_tokens) // bs) - (hits - inactive_hits)
                                 > pool.available - self._reserved_blocks()):
                break  # TRT-LLM: its whole KV must be reservable too
            incoming.popleft()
            if hybrid is not None:
                hybrid.land(pool, seq, seq.prompt_len, True)
            elif hits:
                pool.take_hits(seq.hashes, hits)
            pool.allocate(need)
            seq.n_full = hits
            seq.n_alloc = whole
            tokens = carried if hybrid is not None else transfer_tokens(xfer.mode, seq.prompt_len, need, bs)
            ready = now_ns + transfer_delay_ns(xfer, tokens)
            seq.record.kv_reserved_ns = now_ns
            heapq.heappush(transfers, (ready, seq.record.arrival_ns, seq.order, seq))
            sched.reserved += 1
        while transfers and transfers[0][0] <= now_ns:
            seq = heapq.heappop(transfers)[3]
            full = seq.prompt_len // bs
            if self.prefix_caching and full > seq.n_full:  # the prompt's KV is here now: its full blocks are cached
                if self.hybrid is not None:
                    seq.ensure_hashes(full)
                    self.hybrid.promote(pool, seq, seq.n_full, full, seq, seq.prompt_len)
                else:
                    pool.promote(seq.ensure_hashes(full), seq.n_full, full, seq)
                seq.n_full = full
            seq.computed = seq.prompt_len - 1  # the next pass computes the last prompt position: token 1
            seq.prefilling = False
            seq.status = RUNNING
            self.running.append(seq)
            rec = seq.record
            rec.kv_activated_ns = now_ns
            facts = rec.engine
            facts.admitted_ns = now_ns
            facts.cached_tokens = facts.reused_tokens = 0  # the prompt was computed by the prefill rank
            sched.activated.append(seq)

    def hold(self, seq: SeqState) -> None:
        """A prefill leg is done: it leaves the batch but keeps its blocks until ``release_held``."""
        self.running.remove(seq)
        seq.status = HELD
        self.held += 1

    def release_held(self, seq: SeqState) -> None:
        """A held prefill leg's KV was pulled: free its blocks (full ones stay cached)."""
        self.free(seq)
        seq.status = FINISHED
        self.held -= 1

    def free(self, seq: SeqState) -> None:
        """Give back every block ``seq`` holds: its full ones stay cached (evictable once nobody holds them)."""
        if self.hybrid is not None:
            self.hybrid.free(self.pool, seq)
        else:
            self.pool.release(seq.hashes, seq.n_full, seq.n_alloc - seq.n_full)
        seq.n_alloc = 0
        seq.n_full = 0

    def _cache_filled(self, seq: SeqState, upto: int) -> None:
        """Blocks that the pass fills for ``seq`` (its KV through ``upto`` tokens) become cached now.

        As in the reference (vLLM's ``allocate_slots``), they are visible to the prefix lookups of requests
        scheduled later in the same pass, although their KV is computed by the pass (and their events are
        published at its end).
        """
        nf = upto // self.block_size
        if nf > seq.n_full:
            if self.hybrid is not None:
                seq.ensure_hashes(nf)
                self.hybrid.promote(self.pool, seq, seq.n_full, nf, seq, upto)
            else:
                self.pool.promote(seq.ensure_hashes(nf), seq.n_full, nf, seq)
            seq.n_full = nf
        if self.host is not None and seq.prefilling:
            # vLLM's store cursor: the prompt blocks the request holds past it, found on the GPU or loaded from
            # the host as well as computed, are one cohort (the host stores those it lacks)
            hi = min(nf, seq.prompt_len // self.block_size)
            if hi > seq.host_stored:
                self.host.stage(seq, seq.ensure_hashes(hi), seq.host_stored, hi)
                seq.host_stored = hi

    def _preempt_until(self, seq: SeqState, need: int, sched: Schedule) -> int:
        """Preempt victims until ``need`` blocks are available or ``seq`` itself was preempted; returns budget freed."""
        pool = self.pool
        running = self.running
        freed = 0
        while need > pool.available:
            if self.exact and self.by_priority:  # vLLM: the lowest priority, the latest arrival among equals
                victim = max(running, key=_victim_key)
            else:
                victim = running[-1] if self.lifo else running[0]
            was_prefilling = victim.prefilling
            host = self.host
            if host is not None and host.pending:  # its blocks are still being stored: the pass waits for that
                sched.fence_ns = max(sched.fence_ns, host.fence_ns(victim.hashes[:victim.n_full]))
            if victim.status == FINISHED:  # async: its last token is in flight; it is not queued again
                self.finishing.remove(victim)
                self.running.remove(victim)
                self.free(victim)
            else:
                self.preempt(victim)
            sched.preempted.append(victim)
            n = sched.entries.pop(victim, None)
            if n is not None:
                freed += n if was_prefilling else 1  # (a decode spent one token, whatever it emits)
                if was_prefilling:
                    sched.prefill_tokens -= n
                else:
                    sched.decodes -= 1
            if victim is seq:
                break
        return freed

    def preempt(self, seq: SeqState) -> None:
        """Drop a running request's blocks and queue it again to be recomputed (its tokens are kept)."""
        self.running.remove(seq)
        self.free(seq)
        seq.computed = 0
        seq.prefilling = True
        seq.status = WAITING
        seq.record.engine.preemptions += 1
        heapq.heappush(self.waiting, (self.priority(seq), seq.record.arrival_ns, seq.order, seq))

    def _admit(self, now_ns: int, budget: int, sched: Schedule) -> None:
        waiting = self.waiting
        running = self.running
        pool = self.pool
        bs = self.block_size
        reserve = self.reserve
        reserved = self._reserved_blocks() if reserve and waiting else 0
        host = self.host
        hybrid = self.hybrid
        blocked = False
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            seq = waiting[0][3]
            total = seq.prompt_len + seq.n_out
            loaded = seq.host_load
            extra = 0  # blocks loaded from the host tier, right after the GPU prefix
            taken = 0  # hybrid: blocks its hit takes from the cache over every group
            if loaded is not None:
                # its host load ended: it holds its GPU prefix and the loaded blocks, all full (no new lookup)
                hits, inactive_hits, extra = seq.n_full, 0, loaded[2] - loaded[0]
            elif self.prefix_caching:
                # vLLM always computes the last prompt token (it yields logits); TRT-LLM reuses whole blocks
                limit = total // bs if reserve else (total - 1) // bs
                if hybrid is not None:
                    hits, taken, inactive_hits = hybrid.lookup(pool, seq, limit)
                else:
                    hits, inactive_hits = pool.match_prefix(seq.ensure_hashes(limit), limit)
            else:
                hits = inactive_hits = limit = 0
            if host is not None and loaded is None:
                went = self._load(seq, hits, inactive_hits, limit, now_ns)
                if went > 0:
                    continue  # it waits for its host blocks; the next one may go ahead
                if went < 0:
                    blocked = True
                    break  # no room for the blocks it would load: the head waits
            cached = hits * bs
            n = total - cached
            if n > budget:
                if not self.chunked_prefill:
                    break
                n = budget
            if hybrid is not None and not seq.n_out:
                n = hybrid.chunk(seq, cached, n)  # (an align state group: block-aligned chunks)
                if not n:
                    blocked = True
                    break
            owned = hits if loaded is None else seq.n_alloc  # blocks it will hold before this chunk's
            need = -(-(cached + n) // bs) - owned
            whole = -(-total // bs)
            held = owned
            if hybrid is not None:  # over every group; a sliding window holds at most its cap
                need = hybrid.admit_need(need + owned, owned)
                whole = hybrid.whole(total)
                held = taken if hits else 0
            if need > pool.available - inactive_hits:
                blocked = True
                break
            # vLLM (the reference mocker's gate): blocks for the whole known sequence, less its cached prefix
            # blocks in use (inactive hits still count), must be free or evictable now, although only this
            # pass's chunk is allocated; the head waits, nothing overtakes it
            if not reserve and whole - (held - inactive_hits) > pool.available:
                blocked = True
                break
            if reserve:
                whole = -(-(seq.prompt_len + seq.max_tokens) // bs)
                if whole - (hits - inactive_hits) > pool.available - reserved:
                    break  # the head waits until its whole KV fits; nothing overtakes it
                reserved += whole - (hits + need)
            heapq.heappop(waiting)
            if loaded is not None:
                seq.host_load = None
                self.loading -= 1
            if hybrid is not None:
                hybrid.start(seq)
                if hits:
                    hybrid.take(pool, seq, hits)
                pool.allocate(need)
                need = -(-(cached + n) // bs) - owned  # block positions
            else:
                if hits and loaded is None:
                    pool.take_hits(seq.hashes, hits)
                pool.allocate(need)
            seq.computed = cached
            seq.n_full = hits
            seq.n_alloc = owned + need
            seq.status = RUNNING
            running.append(seq)
            facts = seq.record.engine
            if facts.admitted_ns is None:
                facts.admitted_ns = now_ns
                facts.cached_tokens = cached
                if host is not None:
                    facts.host_cached_tokens = extra * bs
            facts.reused_tokens = cached
            if self.prefix_caching:
                self._cache_filled(seq, cached + n)
            sched.entries[seq] = n
            sched.admitted.append(seq)
            if n:
                sched.prefill_tokens += n
            else:  # TRT-LLM, prompt fully cached: it samples its first token in this pass's decode part
                sched.decodes += 1
            budget -= n
        if blocked and self.loading and not running and waiting[0][3].host_load is None:
            # nothing runs to free blocks and requests holding loaded blocks wait behind a head that cannot fit
            # beside them (a preempted request that grew after their loads started): the first of them goes first
            i = min((e for e in waiting if e[3].host_load is not None), default=None)
            if i is not None:
                waiting.remove(i)
                heapq.heapify(waiting)
                heapq.heappush(waiting, (waiting[0][0] if waiting else i[0], -1, i[2], i[3]))  # the head now
                self._admit(now_ns, budget, sched)

    def _load(self, seq: SeqState, hits: int, inactive_hits: int, limit: int, now_ns: int) -> int:
        """Host lookup for the queue head past its whole GPU prefix (``hits`` blocks, ``inactive_hits`` of them
        inactive, capped at ``limit``: a last prompt block on the GPU that vLLM recomputes is not looked up).
        Every lookup touches the resident prompt blocks, last first (vLLM's LRU policy).

        Resident blocks right after the prefix are loaded: as vLLM does before an asynchronous load, the request
        takes its GPU prefix and allocates the loaded blocks' destinations now, so it holds them (nobody evicts
        them) while the load runs, and is admitted after it with all of them cached. Returns 1 if it left the
        queue to load them (or to wait for a store one of them awaits), -1 if the pool has no room for them
        (the head waits, nothing overtakes it), 0 if the host has nothing for it."""
        host = self.host
        pool = self.pool
        assert host is not None
        hi = seq.prompt_len // self.block_size
        hashes = seq.ensure_hashes(hi)
        lo = hits + 1 if hits == limit < hi and pool.is_cached(hashes[hits]) else hits
        n, wait = host.lookup(hashes, lo, hi) if lo < hi else (0, 0)
        host.touch_prompt(hashes, hi)
        if not n and not wait:
            return 0
        blocks: list[int] = []
        if wait:  # a block right after its hits is still being stored: ask again when it is
            ready = wait
        else:
            assert lo == hits
            # the reference's gate before an asynchronous load: blocks for its whole known sequence, less its GPU
            # prefix in use, must be free or evictable beside what the prefills already in flight (running, loading,
            # or loaded and waiting) still need to hold their whole sequence; else the head waits
            bs = self.block_size
            inflight = [q for q in self.running if q.prefilling]
            inflight += [e[3] for e in self.loads if e[3].host_load is not None]
            inflight += [e[3] for e in self.waiting if e[3].host_load is not None]
            headroom = sum(max(0, -(-(q.prompt_len + q.n_out) // bs) - q.n_alloc) for q in inflight)
            if -(-(seq.prompt_len + seq.n_out) // bs) - (hits - inactive_hits) > pool.available - headroom:
                return -1
            if hits:
                pool.take_hits(hashes, hits)
            pool.allocate(n)
            seq.n_full = hits
            seq.n_alloc = hits + n
            blocks = hashes[lo:lo + n]
            ready = host.load(blocks, now_ns)
            # vLLM recomputes the last prompt token: a loaded block holding it is not counted as cached
            seq.host_load = (lo, n, min(lo + n, limit))
            self.loading += 1
        heapq.heappop(self.waiting)
        heapq.heappush(self.loads, (ready, seq.order, blocks, seq))
        return 1

    def complete(self, seq: SeqState) -> None:
        """A running request produced its last token: release its blocks (cached ones stay reusable)."""
        self.running.remove(seq)
        self.free(seq)
        seq.status = FINISHED
