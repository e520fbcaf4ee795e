"""A vLLM-flavour rank's fast-forward: decode runs committed as a whole, and how far a host can jump (sans-IO).

While the batch only decodes, nothing needs scheduling: ``FastForward.run`` commits a stretch of passes in one go
(plain engines by a period of block events, speculative decoding and hybrid KV groups pass by pass), and
``FastForward.horizon`` finds the first pass with a visible effect without changing anything. Both must see exactly
what stepping would (``tests/workers/test_engines_fastforward.py``); see ``workers.vllm.engine`` for the time model.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from kvemu.clock import MAX_TIME_NS
from workers.blocks import BlockPool
from workers.vllm.hybrid import HybridKV
from workers.pass_events import PassEvents
from workers.results import AdvanceResult
from workers.vllm.scheduler import Scheduler
from workers.sequence import SeqState
from workers.speculative import DraftSampler
from workers.timing import PassTimer

__all__ = ["FastForward"]


class FastForward:
    """The decode runs and look-ahead of one rank, over its engine's scheduler, pool and timer."""

    def __init__(
        self, scheduler: Scheduler, pool: BlockPool, timer: PassTimer, spec: DraftSampler | None,
        hybrid: HybridKV | None, *, rank: int, record_times: bool, groups_meta: list[tuple[str, int | None]] | None,
    ) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.timer = timer
        self.spec = spec
        self.spec_k = spec.k if spec is not None else 0
        self.hybrid = hybrid
        self.block_size = pool.block_size
        self.caching = scheduler.prefix_caching
        self.rank = rank
        self.record_times = record_times
        self.groups_meta = groups_meta
        self.enabled = not (hybrid is not None and self.spec_k)
        """Whether the rank may run or look ahead at all (hybrid groups with drafts go pass by pass)."""

    def _arrival(self) -> int:
        """When the next request arrives (past every instant when none is known): a run stops before it."""
        arrival = self.scheduler.next_arrival_ns()
        return MAX_TIME_NS + 1 if arrival is None else arrival

    def horizon(self, s: int, started: int, ahead: dict[SeqState, int] | None) -> int:
        """First visible pass end of a decode run from ``s``; ``ahead``: the tokens each request is already on when a
        pass started at ``started`` is in flight (None: none is)."""
        if self.hybrid is not None:
            return self._hybrid_horizon(s, 0 if ahead is None else 1, started)
        if self.spec_k:
            return self._burst_horizon(s, started, ahead)
        return self._quiet_horizon(s, 0 if ahead is None else 1, started)

    def run(self, s: int, t_ns: int, out: AdvanceResult) -> tuple[int, int]:
        """Commit a run of pure decode passes from ``s`` as a whole.

        Stops before a pass that would complete a request, preempt, start at/after the next arrival or ``t_ns``.
        Returns how many passes it committed and when the last one ended (the caller books them).
        """
        sch = self.scheduler
        quiet_only = bool(sch.waiting or sch.incoming)  # then stop before any block event
        arrival = self._arrival()
        if self.hybrid is not None:
            return self._hybrid_run(s, t_ns, out, quiet_only, arrival)
        if self.spec_k:
            return self._burst_run(s, t_ns, out, quiet_only, arrival)
        # With arrived requests waiting it also stops before any block event (a cache change could make
        # one admissible). Between passes a decoding request holds ceil(computed / block_size) blocks, so
        # its first block need and first block fill fall within the next block_size passes and recur
        # every block_size passes: one sorted period of events describes the whole run.
        running = sch.running
        bs = self.block_size
        caching = self.caching
        j_stop = min(seq.max_tokens - seq.n_out for seq in running)  # the first completing pass
        if j_stop <= 1:
            return 0, s
        # (first pass index in 1..bs, position, 0 need / 1 fill): within a pass, request by request in running
        # order, its block need before its fill, as the scheduler allocates and caches them
        period: list[tuple[int, int, int]] = []
        for pos, seq in enumerate(running):
            c = seq.computed
            period.append((seq.n_alloc * bs - c + 1, pos, 0))
            if caching:
                first_fill = bs - c % bs
                period.append((first_fill, pos, 1))
                if first_fill < j_stop and not quiet_only:  # hash every block the run may fill, at once
                    seq.ensure_hashes(seq.n_full + (j_stop - 1 - first_fill) // bs + 1)
        period.sort()
        n_ev = len(period)
        pool = self.pool
        decode_ns = self.timer.decode_ns
        decode_prefix = self.timer.decode_prefix_ns
        rank = self.rank
        n_run = len(running)
        kv = sum(seq.computed for seq in running) + n_run  # decode KV tokens of pass 1; pass j + 1: + j * n_run
        stamps: list[int] = []
        j = 0  # passes committed
        T = s  # start of pass j + 1
        idx = 0  # next entry of the period ...
        base = 0  # ... which happens at pass period[idx][0] + base
        while True:
            jn = period[idx][0] + base
            if jn > j_stop:
                jn = j_stop
            if jn - 1 > j:  # plain passes j+1 .. jn-1: the same batch, no block event
                if T >= t_ns or T >= arrival:
                    break
                cnt = jn - 1 - j
                sums, i = decode_prefix(kv + j * n_run, n_run, cnt)
                at = T - sums[i]
                # pass k in 1..cnt runs from at + sums[i + k - 1] to at + sums[i + k]: it must end by t_ns and
                # start before arrival
                fit = min(bisect_right(sums, t_ns - at, i + 1, i + cnt + 1) - 1,
                          bisect_left(sums, arrival - at, i, i + cnt)) - i
                if fit > 0:
                    stamps += [at + v for v in sums[i + 1 : i + fit + 1]]
                    T = at + sums[i + fit]
                    j += fit
                if fit < cnt:
                    break
            if jn >= j_stop or quiet_only or T >= t_ns or T >= arrival:
                break
            evs: list[tuple[int, int]] = []  # (position, 0 need / 1 fill) in order
            m = 0
            nxt, nbase = idx, base
            while period[nxt][0] + nbase == jn:
                _, pos, kind = period[nxt]
                evs.append((pos, kind))
                m += not kind
                nxt += 1
                if nxt == n_ev:
                    nxt = 0
                    nbase += bs
            if m > pool.free + pool.num_inactive:
                break  # a preemption: the scheduler's business
            d = decode_ns(kv + j * n_run, n_run)
            if T + d > t_ns:
                break
            idx, base = nxt, nbase
            for pos, kind in evs:
                seq = running[pos]
                if kind:
                    nf = seq.n_full
                    pool.promote_one(seq.ensure_hashes(nf + 1), nf, seq)
                    seq.n_full = nf + 1
                else:
                    pool.allocate(1)
                    seq.n_alloc += 1
            T += d
            j = jn
            stamps.append(T)
            if pool.log:
                out.events.append(PassEvents(T, rank, pool.log, bs))
                pool.log = []
        if j:
            record_times = self.record_times
            for seq in running:
                seq.computed += j
                seq.n_out += j
                rec = seq.record
                rec.output_tokens += j
                if record_times:
                    rec.token_times_ns.extend(stamps)
        return j, T

    def _burst_run(self, s: int, t_ns: int, out: AdvanceResult, quiet_only: bool,
                   arrival: int) -> tuple[int, int]:
        """``run`` with speculative decoding: pass by pass, each request's burst read from the rank's
        draws (as the scheduler would draw them), committed as stepping would; the same stops."""
        running = self.scheduler.running
        spec = self.spec
        assert spec is not None
        bs = self.block_size
        caching = self.caching
        pool = self.pool
        record_times = self.record_times
        n_run = len(running)
        width = n_run * (1 + self.spec_k)
        kv = sum(seq.computed for seq in running)
        bursts = [0] * n_run
        j = 0
        T = s
        while T < t_ns and T < arrival:
            d = self.timer.decode_ns(kv + width, n_run)
            if T + d > t_ns:
                break
            m = 0
            events = False
            for i, seq in enumerate(running):
                b = spec.peek(i)
                left = seq.max_tokens - seq.n_out
                if b >= left:
                    return j, T  # a completion: the scheduler's business
                bursts[i] = b
                c = seq.computed + b
                need = -(-c // bs) - seq.n_alloc
                if need > 0:
                    m += need
                if caching and c // bs > seq.n_full:
                    events = True
            if m > pool.free + pool.num_inactive or (quiet_only and (m or events)):
                break
            spec.take(n_run)
            T += d
            for i, seq in enumerate(running):
                b = bursts[i]
                c = seq.computed + b
                need = -(-c // bs) - seq.n_alloc
                if need > 0:
                    pool.allocate(need)
                    seq.n_alloc += need
                if caching and c // bs > seq.n_full:
                    nf = c // bs
                    pool.promote(seq.ensure_hashes(nf), seq.n_full, nf, seq)
                    seq.n_full = nf
                seq.computed = c
                seq.n_out += b
                kv += b
                rec = seq.record
                rec.output_tokens += b
                if record_times:
                    rec.token_times_ns.extend([T] * b)
            j += 1
            if pool.log:
                out.events.append(PassEvents(T, self.rank, pool.log, bs))
                pool.log = []
        return j, T

    def _hybrid_run(self, s: int, t_ns: int, out: AdvanceResult, quiet_only: bool,
                    arrival: int) -> tuple[int, int]:
        """``run`` with hybrid KV cache groups: pass by pass, each request's window blocks freed, its blocks
        allocated and filled ones cached as the scheduler would (request by request, in running order); the same
        stops (with arrived requests waiting, before any pass that frees, takes or fills a block)."""
        running = self.scheduler.running
        hybrid = self.hybrid
        assert hybrid is not None
        bs = self.block_size
        caching = self.caching
        pool = self.pool
        record_times = self.record_times
        n_run = len(running)
        n_grow = hybrid.n_grow
        j = 0
        T = s
        while T < t_ns and T < arrival:
            d = self.timer.decode_ns(hybrid.decode_kv([seq.computed + 1 for seq in running]), n_run)
            if T + d > t_ns:
                break
            avail = pool.free + pool.num_inactive
            for seq in running:
                if seq.max_tokens - seq.n_out <= 1:
                    return j, T  # a completion: the scheduler's business
                c = seq.computed
                freed = hybrid.skippable(seq)
                need = n_grow * (-(-(c + 1) // bs) - seq.n_alloc)
                if quiet_only and (freed or need or (caching and (c + 1) // bs > seq.n_full)):
                    return j, T
                avail += freed
                if need > avail:
                    return j, T  # a preemption
                avail -= need
            T += d
            for seq in running:
                c = seq.computed
                hybrid.skip(pool, seq)
                grow = -(-(c + 1) // bs) - seq.n_alloc
                if grow > 0:
                    pool.allocate(n_grow * grow)
                    seq.n_alloc += grow
                if caching and (c + 1) // bs > seq.n_full:
                    nf = (c + 1) // bs
                    seq.ensure_hashes(nf)
                    hybrid.promote(pool, seq, seq.n_full, nf, seq)
                    seq.n_full = nf
                seq.computed = c + 1
                seq.n_out += 1
                rec = seq.record
                rec.output_tokens += 1
                if record_times:
                    rec.token_times_ns.append(T)
            j += 1
            if pool.log:
                out.events.append(PassEvents(T, self.rank, pool.log, bs, self.groups_meta))
                pool.log = []
        return j, T

    def _hybrid_horizon(self, s: int, offset: int, started: int) -> int:
        """``_quiet_horizon`` with hybrid KV cache groups: the passes from ``s`` simulated on copies (each request
        ``offset`` passes on when a pass is in flight) until the first visible one: a store, a completion, an eviction
        or a preemption, or one starting at/after the next arrival; with requests waiting, one that frees, takes or
        fills a block (a cache change may admit one)."""
        sch = self.scheduler
        running = sch.running
        hybrid = self.hybrid
        assert hybrid is not None
        bs = self.block_size
        caching = self.caching
        quiet_only = bool(sch.waiting or sch.incoming)
        flags = [seq.src_cached for seq in running]
        comp = [seq.computed + offset for seq in running]
        outs = [seq.n_out + offset for seq in running]
        alloc = [seq.n_alloc for seq in running]
        fulls = [seq.n_full for seq in running]
        glos = [list(seq.glo or ()) for seq in running]
        arrival = sch.next_arrival_ns()
        free = self.pool.free
        evictable = self.pool.num_inactive
        n_run = len(running)
        n_grow = hybrid.n_grow
        floor = started + 1
        T = s
        while True:
            if arrival is not None and T >= arrival:
                return max(T + 1, floor)
            d = self.timer.decode_ns(hybrid.decode_kv([c + 1 for c in comp]), n_run)
            evicts = False
            for i, seq in enumerate(running):
                if outs[i] + 1 >= seq.max_tokens:
                    evicts = True  # a completion: at the pass's end, unless a request after it is preempted
                c = comp[i]
                # the blocks this pass's schedule frees first (the state read next: a checkpoint iff c is on a boundary)
                cached, uncached = hybrid.skip_ahead(glos[i], c, alloc[i], fulls[i], flags[i])
                flags[i] = c > 0 and not c % bs
                evictable += cached
                free += uncached
                grow = -(-(c + 1) // bs) - alloc[i]
                if quiet_only and (cached or uncached or grow > 0 or (caching and (c + 1) // bs > fulls[i])):
                    return max(T + 1, floor)
                need = n_grow * grow
                if need > free + evictable:  # a preemption: its duration is not known before it starts
                    return max(T + 1, floor)
                if need > free:
                    evictable -= need - free
                    free = 0
                    evicts = True
                else:
                    free -= need
                if grow > 0:
                    alloc[i] += grow
                if caching and (c + 1) // bs > fulls[i]:
                    evicts = True  # a store
                comp[i] = c + 1
                outs[i] += 1
            if evicts:
                return max(T + d, floor)
            T += d

    def _burst_horizon(self, s: int, started: int, ahead: dict[SeqState, int] | None) -> int:
        """``_quiet_horizon`` with speculative decoding: the passes from ``s`` read ahead in the rank's draws
        (each request already ``ahead[seq]`` tokens on when a pass is in flight)."""
        sch = self.scheduler
        running = sch.running
        spec = self.spec
        assert spec is not None
        bs = self.block_size
        caching = self.caching
        comp = [seq.computed for seq in running]
        outs = [seq.n_out for seq in running]
        alloc = [seq.n_alloc for seq in running]
        if ahead is not None:
            for i, seq in enumerate(running):
                b = ahead[seq]
                comp[i] += b
                outs[i] += b
        fulls = [seq.n_full for seq in running]
        arrival = sch.next_arrival_ns()
        free = self.pool.free
        evictable = self.pool.num_inactive
        n_run = len(running)
        width = n_run * (1 + self.spec_k)
        kv = sum(comp)
        floor = started + 1
        T = s
        drawn = 0
        while True:
            if arrival is not None and T >= arrival:
                return max(T + 1, floor)
            d = self.timer.decode_ns(kv + width, n_run)
            m = 0
            visible = False
            for i, seq in enumerate(running):
                b = spec.peek(drawn + i)
                if b >= seq.max_tokens - outs[i]:
                    b = seq.max_tokens - outs[i]
                    visible = True
                c = comp[i] + b
                need = -(-c // bs) - alloc[i]
                if need > 0:
                    m += need
                    alloc[i] += need
                if caching and c // bs > fulls[i]:
                    visible = True
                comp[i] = c
                outs[i] += b
                kv += b
            if m > free + evictable:  # this pass preempts: its duration is not known before it starts
                return max(T + 1, floor)
            if visible or m > free:
                return max(T + d, floor)
            free -= m
            T += d
            drawn += n_run

    def _quiet_horizon(self, s: int, offset: int, started: int) -> int:
        """First visible pass end of a decode run from ``s``, each request already ``offset`` passes ahead."""
        # Visible: fills (stores; a dedupe counts too, conservatively), completions, block needs beyond the
        # free blocks (eviction or preemption). A pass starting at/after the next arrival may admit it.
        bs = self.block_size
        running = self.scheduler.running
        n_run = len(running)
        computed = [seq.computed for seq in running]
        j_vis = min([seq.max_tokens - seq.n_out for seq in running]) - offset
        if self.caching:  # the first fill: bs - (c + offset) % bs passes away for the request furthest into its block
            j_vis = min(j_vis, bs - max([(c + offset) % bs for c in computed]))
        # each request needs a block at pass n_alloc * bs - c + 1 from s, and every bs passes after it
        firsts = [seq.n_alloc * bs - c - offset + 1 for seq, c in zip(running, computed)]
        counts: dict[int, int] = {}  # pass -> block needs in it
        for k in firsts:
            for jn in range(k, j_vis + 1, bs):
                counts[jn] = counts.get(jn, 0) + 1
        arrival = self.scheduler.next_arrival_ns()
        timer = self.timer
        free = self.pool.free
        evictable = self.pool.num_inactive
        kv = sum(computed) + (offset + 1) * n_run  # decode KV tokens of pass 1 from s
        floor = started + 1
        j = 0
        for jn in sorted(counts.keys() | {j_vis}):
            sums, i = timer.decode_prefix_ns(kv, n_run, jn)  # pass k from s ends at at + sums[i + k]
            at = s - sums[i]
            if arrival is not None and at + sums[i + jn - 1] >= arrival:  # one of passes j+1 .. jn starts at/after it
                return max(at + sums[bisect_left(sums, arrival - at, i + j, i + jn - 1)] + 1, floor)
            m = counts.get(jn, 0)
            if m > free + evictable:  # this pass preempts: its duration is not known before it starts
                return max(at + sums[i + jn - 1] + 1, floor)
            if jn == j_vis or m > free:  # the first visible pass, or one that evicts
                return max(at + sums[i + jn], floor)
            free -= m
            j = jn
        raise AssertionError("unreachable")  # pragma: no cover

    # --------------------------------------------------------------- misc
