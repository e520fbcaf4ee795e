"""One DP rank's mock engine in the SGLang flavour (the reference mocker's), told the time (sans-IO).

What differs from the vLLM flavour (``workers.vllm.engine``):

* **Passes are prefill-only ("extend") or decode-only.** While any prompt chunk can be admitted the
  running requests get no token; an extend pass lasts prefill(new tokens) and gives each request whose
  prompt it finishes its first token; a decode pass gives every running request one token.
* **Admission** walks the waiting queue (arrival order, or longest cached prefix first with ``lpm``)
  with per-pass budgets (``chunked_prefill_size``, ``max_prefill_tokens``) and a KV check that reserves
  each running request's remaining output (capped at ``clip_max_new_tokens``) times a ratio that starts
  at 0.7 and decays with every decode pass. A cached prefix nobody holds is part of the free + evictable
  pages the check starts from and is not charged again when the request locks it (as in the reference's
  replay; its prompt's own pages must still fit what is left once it does, and its first token's slot, when
  no page is left for it, waits for its next decode pass, as there). A request stopped there, its own pages
  not fitting, has still looked its cached prefix up, which makes that prefix the most recently used (the
  reference matches before it allocates): a blocked head of the queue keeps its prefix from being evicted.
  A prompt longer than what is left of the chunk budget is chunked; a half-prefilled request goes back to the
  head of the queue.
* **The cache is a radix tree of pages** (``workers.sglang.radix``; page = ``block_size``, 1 token by default):
  a prompt's pages are cached when its prefill ends, a finished or retracted request's whole sequence
  when it lets go, and the least recently used leaves lose pages from their tails when room is needed.
* **Retraction, not preemption:** when a decode pass cannot get its pages the running request with the
  fewest generated tokens (the earliest admitted on a tie) goes back to the end of the queue, its
  tokens left in the cache, and the ratio resets.

Where the reference mocker fails (an error on a prompt whose prompt + reserved output does not fit an
empty pool, an endless loop when a half-prefilled prompt holds pages a lone running request needs), this
core does what SGLang itself does: it refuses prompts longer than the pool less one page at arrival,
clips each request's output to what fits, and lets a lone request that needs pages take them from
half-prefilled ones (which start over). So every request ends.

With ``sglang.semantics: sglang-0.5.23`` it decides as SGLang 0.5.23's own scheduler does instead (the
``_exact`` methods; docs/vllm-semantics.md lists every difference, and tests/oracle checks each step against
SGLang itself): whole-prompt admission budgets that stop admitting until a running request leaves, the first
token's slot taken when it is fed back, chunks cached when the next pass is planned, aborted running requests
that run one more decode pass, its retraction victims, evictions and new-token estimate, and its radix cache's
recency (``RadixCache.sglang_lru``).

``step``/``advance_to``/``next_event_ns`` follow ``VllmEngineCore``'s contract (a pass is planned at its
start and everything it produces is stamped with its end). Disaggregated legs are not emulated here.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import cast

from kvemu.errors import InvalidArgument
from kvemu.records import EngineRecord
from workers.admission import RejectReason, RequestRejected, sglang_max_len
from workers.blocks import CLEARED
from workers.config import EngineConfig
from workers.engine_base import RankCore
from workers.results import AdvanceResult, StepResult
from workers.pass_events import PassEvents
from workers.sglang.radix import RadixCache, RadixNode
from workers.request import Request
from workers.sequence import FINISHED, FUTURE, RUNNING, WAITING, SeqState
from workers.timing import AnyTimingModel

__all__ = ["SglangEngineCore", "SglangCore"]

_INIT_RATIO = 0.7
_MIN_RATIO_FACTOR = 0.14
_DECAY_PASSES = 600
_LPM_MAX_WAITING = 128  # beyond this many waiting requests LPM falls back to arrival order, as SGLang does
_LOOKAHEAD_PASSES = 4096  # how far next_event_ns looks through a decode run (further: it answers again then)
_IN_BATCH_CHECK = 32  # sglang-0.5.23: IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD and ..._DEPRIORITIZE_THRESHOLD
_RETRACT_DECODE_STEPS = 20  # sglang-0.5.23: SGLANG_RETRACT_DECODE_STEPS
_TOUCH_INTERVAL = 32  # sglang-0.5.23: WAITING_PREFIX_REFRESH_INTERVAL


def _pages(computed: int, tokens: int, page: int) -> int:
    """New pages a request with ``computed`` tokens of KV takes to compute ``tokens`` more."""
    return -(-(computed + tokens) // page) + (computed // -page)


class _Seq(SeqState):
    """A request in an SGLang rank: ``computed`` is its materialized KV; pages on its cached path are locked."""

    __slots__ = ("node", "cached_pages", "owned", "out_limit", "owed")

    def __init__(self, req: Request, record: EngineRecord, page: int, order: int, out_limit: int) -> None:
        super().__init__(req, record, page, order)
        self.node: RadixNode | None = None
        self.cached_pages = 0
        """Pages of its sequence in the tree, all locked by it (the path to ``node``)."""
        self.owned = 0
        """Pages it holds outside the tree."""
        self.out_limit = out_limit
        """Output tokens it will produce: ``max_tokens`` clipped to what fits the pool."""
        self.owed = 0
        """1 while its first token has no KV slot yet (no page was left when its prompt was admitted, as the
        reference allows): its next decode pass takes that slot's page too."""


class _Chunk:
    __slots__ = ("seq", "prefix", "end", "final")

    def __init__(self, seq: _Seq, prefix: int, end: int, final: bool) -> None:
        self.seq = seq
        self.prefix = prefix
        self.end = end
        self.final = final


class _Pass:
    """A planned pass: its chunks (an extend pass) or its batch (a decode pass)."""

    __slots__ = ("start", "end", "chunks", "decode", "retracted", "bursts")

    def __init__(self, start: int) -> None:
        self.start = start
        self.end = start
        self.chunks: list[_Chunk] = []
        self.decode: list[_Seq] = []
        self.retracted: list[_Seq] = []
        self.bursts: list[int] = []
        """Speculative decoding: the tokens each of ``decode`` emits (empty: one each)."""

    def __bool__(self) -> bool:
        return bool(self.chunks or self.decode or self.retracted)


class SglangEngineCore(RankCore):
    """The SGLang-flavour mock engine of one DP rank; same host contract as ``VllmEngineCore``."""

    can_defer_kv_events = True
    """``next_event_ns`` can pass over decode passes whose only visible effect is evictions (``defer_kv_events``)."""

    def __init__(
        self, config: EngineConfig | None = None, *, dp_rank: int = 0, timing: AnyTimingModel | None = None,
        worker_id: int = 0,
    ) -> None:
        cfg = config if config is not None else EngineConfig(backend="sglang")
        if cfg.backend != "sglang":
            raise InvalidArgument(f"backend: SglangEngineCore runs backend sglang, got {cfg.backend!r}", field="backend")
        super().__init__(cfg, dp_rank, timing, worker_id)
        sg = cfg.sglang
        self._sg = sg
        self._page = cfg.resolved_block_size
        self.cache = RadixCache(cfg.num_gpu_blocks)
        self.cache.sglang_lru = sg.semantics != "dynamo"
        self._caching = cfg.enable_prefix_caching
        self._exact = sg.semantics != "dynamo"
        """SGLang 0.5.23's own decisions (``sglang.semantics``) instead of Dynamo's mocker's."""
        self._init_ratio = _INIT_RATIO * sg.schedule_conservativeness
        if self._exact:
            self._init_ratio = min(self._init_ratio, 1.0)
        self._min_ratio = self._init_ratio * _MIN_RATIO_FACTOR
        self._decay = (self._init_ratio - self._min_ratio) / _DECAY_PASSES
        self.ratio = self._init_ratio
        """The share of each running request's remaining output that admission reserves."""
        self._max_len = sglang_max_len(cfg)
        self.future: list[tuple[int, int, _Seq]] = []  # (arrival, order, seq)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self._decodes_owed = 0  # decode passes still due before the next extend pass (prefill_decode_interval)
        self._full = False  # sglang-0.5.23: SGLang's batch_is_full, no admission until a running request leaves
        self._doomed: list[_Seq] = []  # sglang-0.5.23: aborted while running, they leave after their next decode pass
        self._stash: list[tuple[_Seq, int]] = []  # sglang-0.5.23: chunks computed, cached when the next pass is planned
        self._fresh_batch = False  # sglang-0.5.23: the pass planned found no running request
        self._touches = 0  # sglang-0.5.23: times it ordered a waiting queue without LPM (every 32nd refreshes it)
        self._version = 0
        self.defer_kv_events = False
        """Whether ``next_event_ns`` may pass over decode passes whose only visible effect is KV events (the
        evictions 1-token pages cause at every pass of a full pool). Only for a host that advances the core
        to the present before anyone reads what those events say (``WorkerActor.sync``)."""

    # ----------------------------------------------------------------- queries

    @property
    def num_running(self) -> int:
        """Requests admitted and not finished (prefilling or decoding)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Accepted requests not running (arrived or not, half-prefilled or retracted)."""
        return len(self.waiting) + len(self.future)

    @property
    def num_held(self) -> int:
        """Always 0: the SGLang flavour runs no disaggregated prefill legs."""
        return 0

    def cached_prefix_blocks(self, hashes: list[int]) -> int:
        """Leading pages of ``hashes`` in this rank's radix cache now; read-only (the LRU order stays)."""
        if not self._caching:
            return 0
        return self.cache.peek(hashes, len(hashes))[0]

    @property
    def kv_usage(self) -> float:
        """Share of the pool's pages that hold KV nobody may evict (requests' own and locked cached pages)."""
        c = self.cache
        return (c.owned + c.locked) / c.capacity if c.capacity else 0.0

    def _next_start(self) -> int | None:
        free_at = self._free_at
        if self.running:
            return free_at
        if self.waiting and self._blocked != self._version:
            return free_at if free_at > self._now else self._now
        if self.future:
            a = self.future[0][0]
            return a if a > free_at else free_at
        return None

    # ------------------------------------------------------------- admission

    def add_request(self, req: Request) -> EngineRecord:
        """Accept a request (see ``RankCore.add_request``); disaggregated legs are refused: this flavour runs none."""
        if req.kv_hold or req.kv_transfer is not None:
            raise RequestRejected(RejectReason.MALFORMED, "kv_hold/kv_transfer: backend sglang runs no disaggregated "
                                  "legs; use backend vllm for prefill and decode pools", field="backend")
        return super().add_request(req)

    def _new_seq(self, req: Request, record: EngineRecord) -> _Seq:
        return _Seq(req, record, self._page, self._order, min(req.max_tokens, self._max_len - len(req.token_ids)))

    def _enqueue(self, seq: _Seq) -> None:
        seq.status = FUTURE
        heapq.heappush(self.future, (seq.record.arrival_ns, seq.order, seq))

    def abort(self, request_id: str, reason: str = "cancelled") -> EngineRecord | None:
        """Drop an unfinished request: its cached pages stay cached, the rest is freed; returns its record
        with ``failure`` set (None if no such request). One in the pass in flight is dropped at its end."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        seq.record.failure = reason
        fl = self._inflight
        if fl is not None and (seq in fl.decode or any(c.seq is seq for c in fl.chunks)):
            self._aborting.append(seq)
            return seq.record
        if self._exact and seq.status == RUNNING and seq in self.running:
            self._doomed.append(seq)  # SGLang marks it: it runs its next decode pass, then leaves, cached
            return seq.record
        self._drop(seq)
        return seq.record

    def release_kv(self, request_id: str) -> bool:
        """Nothing is ever held for a decode rank here (no disaggregated legs): always False."""
        return False

    def _drop(self, seq: _Seq) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status == FUTURE:
            self.future = [e for e in self.future if e[2] is not seq]
            heapq.heapify(self.future)
        self._let_go(seq, cache=False)
        seq.status = FINISHED

    # ------------------------------------------------------------- KV pages

    def _take(self, pages: int) -> None:
        """Give a request ``pages`` more pages of its own, evicting cached ones as needed."""
        cache = self.cache
        short = pages - cache.free
        if short > 0:
            cache.evict(short)
        cache.owned += pages

    def _cache_prefix(self, seq: _Seq, upto: int) -> None:
        """Put the request's first ``upto`` pages into the tree, keeping them locked for it."""
        cache = self.cache
        depth = seq.cached_pages
        if upto <= depth or not self._caching:
            return
        old = seq.node if seq.node is not None else cache.root
        node = cache.insert(old, depth, seq.ensure_hashes(upto), upto, seq)
        moved = upto - depth  # its own pages for these positions: in the tree now, or duplicates given back
        cache.owned -= moved
        seq.owned -= moved
        cache.lock(node)
        if seq.node is not None:
            cache.unlock(seq.node)
        seq.node = node
        seq.cached_pages = upto

    def _let_go(self, seq: _Seq, cache: bool) -> None:
        """Release everything the request holds, caching its whole pages first if ``cache``."""
        if cache and seq.computed:
            self._cache_prefix(seq, seq.computed // self._page)
        c = self.cache
        c.owned -= seq.owned
        seq.owned = 0
        if seq.node is not None:
            c.unlock(seq.node)
            seq.node = None
        seq.cached_pages = 0
        seq.computed = 0
        seq.owed = 0
        self._version += 1

    # ------------------------------------------------------------- stepping

    def _step_result(self, p: _Pass) -> StepResult:
        res = StepResult(p.start, p.end)
        res.prefill_tokens = sum(c.end - c.prefix for c in p.chunks)
        res.decodes = len(p.decode)
        return res

    def _cache_version(self) -> int:
        return self._version

    def next_event_ns(self) -> int | None:
        """When to advance to for the next externally visible change (None: nothing pending).

        A pass in flight: its end. A run of decode passes due next (nothing waiting or arriving, pages enough
        without retracting): the end of its first pass that completes a request or evicts (that pass's KV
        events are visible; with ``defer_kv_events`` they are not, see there), since nothing visible happens
        at a decode pass's start. Otherwise the next pass's start + 1 (advancing past it starts it)."""
        fl = self._inflight
        if fl is not None:
            return fl.end if fl.end > fl.start else fl.start + 1
        s = self._next_start()
        if s is None:
            return None
        running = self.running
        if not running or self.waiting or (self.future and self.future[0][0] <= s) or self._exact:
            return s + 1
        if any(q.owed for q in running):  # its first decode pass takes a page more for one of them: plan it
            return s + 1
        if self._spec_k:
            return self._burst_horizon(s)
        page = self._page
        cache = self.cache
        free = cache.free
        room = free + cache.evictable
        n = len(running)
        kv = sum(q.num_tokens for q in running)
        gaps = [-q.computed % page for q in running]  # pass j takes a new page for q when (j - 1) % page == gap
        last = min(q.out_limit - q.n_out for q in running)  # the pass that completes the first request
        arrival = self.future[0][0] if self.future else None
        defer = self.defer_kv_events
        pass_ns = self.timer.pass_ns
        t = s
        for j in range(1, min(last, _LOOKAHEAD_PASSES) + 1):
            need = n if page == 1 else gaps.count((j - 1) % page)
            if need > room:  # it retracts at its start
                return t + 1
            end = t + pass_ns(0, n, kv)
            if end == t:
                return t + 1
            if j == last or (need > free and not defer):
                return end
            free = free - need if need <= free else 0
            room -= need
            kv += n
            t = end
            if arrival is not None and t >= arrival:  # the next pass may admit it
                return t + 1
        return t

    def _burst_horizon(self, s: int) -> int:
        """``next_event_ns``'s look-ahead through speculative decode passes, reading the rank's draws ahead."""
        spec = self.spec
        assert spec is not None
        k = self._spec_k
        page = self._page
        running = self.running
        cache = self.cache
        free = cache.free
        room = free + cache.evictable
        n = len(running)
        comp = [q.computed for q in running]
        left = [q.out_limit - q.n_out for q in running]
        kv = sum(q.num_tokens for q in running)
        arrival = self.future[0][0] if self.future else None
        defer = self.defer_kv_events
        pass_ns = self.timer.pass_ns
        t = s
        drawn = 0
        for _ in range(_LOOKAHEAD_PASSES):
            if sum(_pages(c, min(k + 1, r), page) for c, r in zip(comp, left)) > room:
                return t + 1  # it retracts at its start
            need = grown = 0
            completes = False
            for i in range(n):
                b = spec.peek(drawn + i)
                if b >= left[i]:
                    b = left[i]
                    completes = True
                need += _pages(comp[i], b, page)
                comp[i] += b
                left[i] -= b
                grown += b
            end = t + pass_ns(0, n, kv + n * k)
            if end == t:
                return t + 1
            if completes or (need > free and not defer):
                return end
            free = free - need if need <= free else 0
            room -= need
            kv += grown
            t = end
            drawn += n
            if arrival is not None and t >= arrival:  # the next pass may admit it
                return t + 1
        return t

    # ------------------------------------------------------------- planning

    def _arrivals(self, start: int) -> None:
        future = self.future
        while future and future[0][0] <= start:
            seq = heapq.heappop(future)[2]
            seq.status = WAITING
            self.waiting.append(seq)

    def _plan(self, start: int) -> _Pass:
        if self._exact:
            if start > self._free_at and not self.running and not self.waiting:
                self.ratio = self._init_ratio  # SGLang resets its estimate whenever it idles
            for seq, upto in self._stash:
                if seq.status != FINISHED:  # (an aborted one has let its chunk go)
                    self._cache_prefix(seq, upto)
            self._stash = []
        self._arrivals(start)
        p = _Pass(start)
        if self._exact:
            if self.waiting:
                self._admit_exact(p)
        elif self.waiting and not (self._decodes_owed and self.running):
            self._admit(p)
        if p.chunks:
            b = len(p.chunks)
            isl = sum(c.end for c in p.chunks)
            prefix = sum(c.prefix for c in p.chunks)
            p.end = start + self.timer.pass_ns(b * (isl // b - prefix // b), 0, 0)
        elif self.running:
            if self._exact:
                self._plan_decode_exact(p)
            else:
                self._plan_decode(p)
        return p

    def _order_waiting(self) -> None:
        """LPM: longest cached prefix first, a half-prefilled prompt before all (SGLang continues its chunked
        request first; holding pages while others go first could leave an idle engine that admits nobody)."""
        waiting = self.waiting
        if self._sg.schedule_policy != "lpm" or len(waiting) > _LPM_MAX_WAITING or not self._caching:
            return
        page = self._page
        cache = self.cache
        last = 0 if self._exact else 1  # (SGLang orders by the whole prompt's match; Dynamo's mocker, all but its last token)
        keyed: list[tuple[bool, float, int, _Seq]] = [
            (not s.computed, -cache.peek(s.ensure_hashes((s.num_tokens - last) // page), (s.num_tokens - last) // page)[0],
             i, s) for i, s in enumerate(waiting)]
        if self._exact:
            keyed = self._in_batch_prefix_last(keyed)
        keyed.sort()
        self.waiting = deque(s for *_, s in keyed)

    @staticmethod
    def _in_batch_prefix_last(keyed: list[tuple[bool, float, int, _Seq]]) -> list[tuple[bool, float, int, _Seq]]:
        """sglang-0.5.23's in-batch prefix caching: a waiting prompt that finds at most 32 tokens cached but shares
        at least 32 with a prompt ahead of it in the queue goes last, so that one of them caches the prefix first."""
        seen: set[int] = set()
        out = []
        for first, neg_hit, i, s in keyed:
            if not s.computed and -neg_hit <= _IN_BATCH_CHECK:
                hashes = s.ensure_hashes(s.num_tokens)
                shared = 0
                while shared < len(hashes) and hashes[shared] in seen:
                    shared += 1
                if shared >= _IN_BATCH_CHECK:
                    out.append((first, float("inf"), i, s))
                    continue
                seen.update(hashes)
            out.append((first, neg_hit, i, s))
        return out

    def _admit(self, p: _Pass) -> None:
        """Take prompt chunks from the head of the queue into an extend pass while budgets and KV allow."""
        self._order_waiting()
        sg = self._sg
        page = self._page
        cache = self.cache
        ratio = self.ratio
        clip = sg.clip_max_new_tokens
        reserved = sum(min(s.out_limit - s.n_out, clip) for s in self.running) * ratio
        rem_total = (cache.free + cache.evictable) * page - reserved
        rem_input = sg.max_prefill_tokens
        rem_chunk = sg.chunked_prefill_size
        slots = self.config.max_num_seqs - len(self.running)
        waiting = self.waiting
        while waiting and len(p.chunks) < slots:
            seq = waiting[0]
            length = seq.num_tokens
            done = seq.computed  # a half-prefilled request continues after what it has
            fresh = not done
            unheld = 0
            if fresh and self._caching:  # what it finds cached counts as done for the budgets and the KV check,
                limit = (length - 1) // page  # and holding it makes it unevictable
                if limit > 0:
                    hit, unheld = cache.peek(seq.ensure_hashes(limit), limit)
                    done = hit * page
            extend = length - done
            if extend <= rem_chunk:
                chunk = extend
            else:
                chunk = rem_chunk // page * page
                if not chunk:
                    break
            charged = -(-chunk // page) * page
            final = chunk == extend
            end = done + chunk
            # a prompt finished in this pass also gets the slot of its first token, unless that token is its last
            slot = end + 1 if final and seq.out_limit - seq.n_out > 1 else end
            # what it holds back for its output: the reserve, which covers that slot (with clip_max_new_tokens 0,
            # the slot alone: the reference would over-commit the pool there and spin)
            reserve = max(min(seq.out_limit - seq.n_out, clip) if final else 0, (-(-slot // page) - -(-end // page)) * page)
            if (charged + reserve >= rem_total or charged > rem_chunk
                    or (charged > rem_input and p.chunks)):  # (a lone chunk always fits max_prefill_tokens, as in SGLang)
                break
            had = -(-done // page)
            need = -(-end // page) - had
            if need > cache.free + cache.evictable - unheld:  # its prompt's pages must fit once its prefix is locked
                if fresh and done:  # the reference looks its prefix up (and so refreshes it) before finding no room
                    cache.match(seq.ensure_hashes(limit), limit)
                break
            waiting.popleft()
            if fresh and done:
                self._match(seq, done // page)
            if -(-slot // page) > -(-end // page) and not cache.free + cache.evictable - need:
                # no page left for its first token's slot: as in the reference, it gets it at its next decode pass
                seq.owed = slot - end
                slot = end
            need = -(-slot // page) - had
            self._take(need)
            seq.owned += need
            seq.computed = slot
            prefix = done
            rem_total -= (-(-end // page) - had) * page + reserve
            rem_input -= charged
            rem_chunk -= charged
            p.chunks.append(_Chunk(seq, prefix, end, final))
            seq.status = RUNNING
            if fresh:
                facts = seq.record.engine
                if facts.admitted_ns is None:
                    facts.admitted_ns = p.start
                    facts.cached_tokens = prefix
                # the most any of its admissions found cached: what the reference's replay reports for a request
                # retracted and re-admitted (a later admission may find less, what the others evicted meanwhile)
                if facts.reused_tokens is None or prefix > facts.reused_tokens:
                    facts.reused_tokens = prefix
            if final:
                self.running.append(seq)
            if rem_chunk <= 0 or not final:
                break
        if p.chunks:
            self._version += 1

    def _match(self, seq: _Seq, limit: int) -> int:
        """Lock the request's longest cached prefix (at most ``limit`` pages); returns it in tokens."""
        if not self._caching or limit <= 0:
            return 0
        cache = self.cache
        node, pages = cache.match(seq.ensure_hashes(limit), limit)
        if pages:
            cache.lock(node)
            seq.node = node
            seq.cached_pages = pages
        return pages * self._page

    def _plan_decode(self, p: _Pass) -> None:
        """A decode pass: every running request feeds its last token; retract while pages are short."""
        cache = self.cache
        page = self._page
        running = self.running
        k = self._spec_k
        while True:
            if k:  # room for the longest burst each may emit, as SGLang checks before verifying drafts
                need = sum(_pages(s.computed, s.owed + min(k + 1, s.out_limit - s.n_out), page) for s in running)
            else:  # (a request owed its first token's slot takes it now too)
                need = sum(_pages(s.computed, 1 + s.owed, page) for s in running)
            if cache.free + cache.evictable >= need:
                break
            if len(running) > 1:
                victim = min(running, key=lambda s: s.n_out)  # fewest generated, the earliest admitted on a tie
                self._retract(victim)
                p.retracted.append(victim)
                continue
            parked = next((s for s in reversed(self.waiting) if s.computed), None)
            if parked is None:  # pragma: no cover - outputs are clipped to the pool, so a lone request fits
                raise AssertionError(f"SGLang rank {self.dp_rank}: a lone request cannot grow ({cache!r})")
            self._let_go(parked, cache=True)  # a half-prefilled prompt gives its pages to the lone runner
        if p.retracted:
            self.ratio = self._init_ratio
        if not running:
            return
        p.decode = list(running)
        if k:
            self._plan_bursts(p)
            return
        self._take(need)
        ctx = 0
        for s in running:
            s.owned += _pages(s.computed, 1 + s.owed, page)  # (and the slot of its first token, if owed)
            ctx += s.num_tokens
            s.computed += 1 + s.owed
            s.owed = 0
        p.end = p.start + self.timer.pass_ns(0, len(running), ctx)

    def _plan_bursts(self, p: _Pass) -> None:
        """A speculative decode pass: each request verifies k drafts after its last token (their KV attended)
        and computes the KV of what it emits, drawn from the rank's stream in batch order."""
        spec = self.spec
        assert spec is not None
        page = self._page
        k = self._spec_k
        bursts = p.bursts
        taken = ctx = 0
        for s in p.decode:
            b = spec.next()
            left = s.out_limit - s.n_out
            if b > left:
                b = left
            grow = _pages(s.computed, s.owed + b, page)  # (and the slot of its first token, if owed)
            s.owned += grow
            taken += grow
            ctx += s.num_tokens + k
            s.computed += s.owed + b
            s.owed = 0
            bursts.append(b)
        self._take(taken)
        p.end = p.start + self.timer.pass_ns(0, len(p.decode), ctx)

    # ------------------------------------------------------------- sglang-0.5.23 semantics

    def _admit_exact(self, p: _Pass) -> None:
        """SGLang 0.5.23's ``PrefillAdder`` (1-token pages): the chunked request continues first, then the queue in
        policy order while each candidate's whole remaining prompt, its clipped output and a page fit what the pool
        has free and evictable less the running requests' estimated outputs and what this pass already took.

        A candidate that does not fit sets ``batch_is_full``: nobody is admitted until a running request leaves.
        Without chunked prefill a further prompt must be shorter than what is left of ``max_prefill_tokens``."""
        sg = self._sg
        cache = self.cache
        running = self.running
        if not running:
            self._full = False
        self._fresh_batch = not running
        waiting = self.waiting
        chunked = waiting[0] if waiting and waiting[0].computed else None
        if chunked is None and self._full:
            return
        slots = self.config.max_num_seqs - len(running)
        if slots <= 0 and chunked is None:
            self._full = True
            return
        if self._caching:
            self._touch_waiting(waiting)
        self._order_waiting()  # (it builds a new queue)
        waiting = self.waiting
        clip = sg.clip_max_new_tokens
        chunking = self.config.enable_chunked_prefill
        offset = sum(min(s.out_limit - s.n_out, clip) for s in running) * self.ratio
        current = 0
        room = cache.free + cache.evictable  # (allocations come after the decisions: the offsets stand for them)
        rem_input = sg.max_prefill_tokens
        rem_chunk = sg.chunked_prefill_size
        chosen: list[_Chunk] = []
        if chunked is not None:
            left = chunked.num_tokens - chunked.computed
            fit = min(rem_chunk, int(room - offset))
            n = min(left, fit if fit > 0 else rem_chunk)
            final = n == left
            reserve = min(chunked.out_limit, clip) if final else 0
            offset += n + 1 + reserve
            current += n + 1
            rem_input -= n
            rem_chunk -= n
            waiting.popleft()
            chosen.append(_Chunk(chunked, chunked.computed, chunked.computed + n, final))
        while waiting:
            if rem_input <= 0 or (chunking and rem_chunk <= 0):
                break
            if len(chosen) >= slots:
                self._full = True
            if self._full:
                break
            seq = waiting[0]
            length = seq.num_tokens
            hit = unheld = 0
            if self._caching and length > 1:
                hit, unheld = cache.peek(seq.ensure_hashes(length - 1), length - 1)
            extend = length - hit
            out = min(max(seq.out_limit - seq.n_out, 0), clip)
            fits = extend + out + 1 < room - unheld - offset
            if not fits or (not chunking and chosen and extend >= rem_input):
                if hit:
                    cache.match(seq.ensure_hashes(hit), hit)  # (SGLang looked its prefix up again before refusing)
                if not fits:  # (a prompt past the prefill budget only waits for the next pass)
                    self._full = bool(chosen) or bool(running)
                break
            n, final = extend, True
            reserve = min(seq.out_limit, clip)  # (its whole output: SGLang charges a returning request's again)
            if chunking and extend > rem_chunk:
                n, final, reserve = rem_chunk, False, 0
            waiting.popleft()
            if hit:
                self._match(seq, hit)
            room -= unheld
            offset += n + 1 + reserve
            current += n + 1
            rem_input -= n
            rem_chunk -= n
            chosen.append(_Chunk(seq, hit, hit + n, final))
            if not (room - offset > 0 and room - current > 0):  # no capacity left: SGLang's NO_TOKEN
                self._full = True
                break
        for c in chosen:
            seq = c.seq
            fresh = not seq.computed
            need = c.end - max(seq.computed, seq.cached_pages)  # (a fresh request's hit is locked, not taken)
            self._take(need)
            seq.owned += need
            seq.computed = c.end
            seq.status = RUNNING
            if fresh:
                facts = seq.record.engine
                if facts.admitted_ns is None:
                    facts.admitted_ns = p.start
                    facts.cached_tokens = c.prefix
                if facts.reused_tokens is None or c.prefix > facts.reused_tokens:
                    facts.reused_tokens = c.prefix
            if c.final:
                running.append(seq)
        p.chunks = chosen
        if chosen:
            self._version += 1

    def _touch_waiting(self, waiting: deque[_Seq]) -> None:
        """sglang-0.5.23 looks waiting prompts up before ordering them, which refreshes their cached paths: with
        LPM every one, in queue order; otherwise every 32nd time, the first 128 from the back (the head last)."""
        cache = self.cache
        queue = [s for s in waiting if not s.computed]
        if not queue:
            return
        if self._sg.schedule_policy == "lpm" and len(waiting) <= _LPM_MAX_WAITING:
            touched = queue
        else:
            touched = list(reversed(queue[:_LPM_MAX_WAITING])) if self._touches % _TOUCH_INTERVAL == 0 else []
            self._touches += 1
        for seq in touched:
            cache.match(seq.ensure_hashes(seq.num_tokens), seq.num_tokens)

    def _plan_decode_exact(self, p: _Pass) -> None:
        """SGLang 0.5.23's decode step (1-token pages): each running request feeds its last token, which takes a
        slot; short of slots it retracts the request with the fewest generated tokens (then the longest prompt,
        then the last in batch order) until the rest fit, keeping one; the rest run in that order of preference.

        A retracted request drops its output's KV (its prompt stays cached, unlocked) and rejoins the queue's end;
        the new-token estimate becomes what the rest have generated plus 20 tokens each, over their output limits."""
        cache = self.cache
        running = self.running
        if not self._room_for(len(running)):
            order = sorted(range(len(running)), key=lambda i: (running[i].n_out, -running[i].prompt_len), reverse=True)
            victims: list[_Seq] = []
            first = True
            while first or not self._room_for(len(order)):
                if len(order) == 1:
                    break
                first = False
                victim = running[order.pop()]
                self._let_go(victim, cache=False)
                victims.append(victim)
                self._room_for(len(order) * _RETRACT_DECODE_STEPS)  # room for the rest's next steps, evicting
            kept = [running[i] for i in order]
            if cache.free + cache.evictable < len(kept):  # pragma: no cover - outputs are clipped to the pool
                raise AssertionError(f"SGLang rank {self.dp_rank}: a lone request cannot grow ({cache!r})")
            running[:] = kept
            for victim in victims:
                victim.status = WAITING
                victim.prefilling = True
                victim.record.engine.preemptions += 1
                if victim in self._doomed:  # (aborted already: it leaves instead of waiting)
                    self._doomed.remove(victim)
                    victim.status = FINISHED
                    continue
                self.waiting.append(victim)
            p.retracted = victims
            done = sum(s.n_out for s in kept)
            limit = sum(s.out_limit for s in kept)
            self.ratio = min(1.0, (done + 20 * len(kept)) / (limit + 1))
            self._full = False
        else:
            self.ratio = max(self._min_ratio, self.ratio - self._decay)
        if not running:
            return
        p.decode = list(running)
        for seq in self._doomed:
            if seq in p.decode:
                self._aborting.append(seq)
        self._doomed = [s for s in self._doomed if s not in p.decode]
        self._take(len(running))
        ctx = 0
        for s in running:
            s.owned += 1
            ctx += s.num_tokens
            s.computed += 1
        p.end = p.start + self.timer.pass_ns(0, len(running), ctx)

    def _room_for(self, tokens: int) -> bool:
        """sglang-0.5.23: evict least recently used leaves until ``tokens`` slots are free (or nothing is left to
        evict); whether they are."""
        cache = self.cache
        if cache.free < tokens:
            cache.evict(tokens - cache.free)
        return cache.free >= tokens

    def _retract(self, seq: _Seq) -> None:
        self.running.remove(seq)
        self._let_go(seq, cache=True)
        seq.status = WAITING
        seq.prefilling = True
        seq.record.engine.preemptions += 1
        # to the end of the queue, as the reference's replay does: requests already waiting go first (and a
        # half-prefilled prompt is never stuck behind one that cannot fit until that prompt's pages are freed)
        self.waiting.append(seq)

    # ------------------------------------------------------------- pass end

    def _finish(self, p: _Pass, out: AdvanceResult | None, res: StepResult | None) -> None:
        end = p.end
        page = self._page
        sampled: list[SeqState] = []
        aborted = self._aborting  # aborted while the pass ran: it still does their work, nobody hears of it
        requeue: list[_Seq] = []
        for c in p.chunks:
            seq = c.seq
            if self._exact and not c.final:
                self._stash.append((seq, c.end // page))  # SGLang caches a chunk when it plans the next pass
            else:
                self._cache_prefix(seq, c.end // page)
            if not c.final:
                if seq not in aborted:
                    seq.status = WAITING
                    requeue.append(seq)
                continue
            sampled.append(seq)
        sampled += p.decode
        for seq, b in zip(p.decode, p.bursts):
            if b > 1:
                self._book_burst(seq, b - 1, end)
        first = self._sample(sampled, end)
        completed = [seq for seq in cast("list[_Seq]", sampled) if seq.n_out >= seq.out_limit]
        for seq in reversed(requeue):
            self.waiting.appendleft(seq)
        if p.decode:
            self._decodes_owed = max(0, self._decodes_owed - 1)
            if not self._exact:  # (sglang-0.5.23 decays it when it plans a decode pass without retracting)
                self.ratio = max(self._min_ratio, self.ratio - self._decay)
        elif p.chunks:
            self._decodes_owed = self._sg.prefill_decode_interval
        leaving = completed
        if self._exact and aborted:  # SGLang finishes the aborted running ones with the rest, in batch order
            gone = set(completed) | {s for s in aborted if s in self.running}
            leaving = [s for s in p.decode or cast("list[_Seq]", sampled) if s in gone]
        for seq in leaving:  # in batch order, the aborted among them too: the order their pages age in
            self.running.remove(seq)
            self._let_go(seq, cache=True)
            seq.status = FINISHED
            if seq in aborted:
                continue
            seq.record.completion_ns = end
            del self._seqs[seq.rid]
        if aborted:
            self._aborting = []
            for seq in aborted:
                if seq.status == FINISHED:
                    continue
                if self._exact and seq in self.running:  # SGLang finishes it with the pass: its tokens cached
                    self.running.remove(seq)
                    self._let_go(seq, cache=True)
                    seq.status = FINISHED
                else:  # the rest let go after the pass, as if aborted right after it
                    self._drop(seq)
            first = [s for s in first if s not in aborted]
            sampled = [s for s in sampled if s not in aborted]
            completed = [s for s in completed if s not in aborted]
        if self._exact and (completed or aborted or any(not c.final for c in p.chunks)
                            or (self._fresh_batch and any(c.final for c in p.chunks))):
            # a request left the batch (SGLang filters it out, or holds a chunk apart), or this pass's batch becomes
            # the running batch (SGLang's flag stays with the empty one it replaces)
            self._full = False
        log = self.cache.log  # its evictions at its start, the pages it cached at its end
        self.cache.log = []
        events = PassEvents(end, self.dp_rank, log, page) if log else None
        self._free_at = end
        self.passes += 1
        self._report(p.start, end, out, res, admitted=[c.seq for c in p.chunks], preempted=p.retracted, first=first,
                     completed=completed, sampled=sampled, events=events)

    # --------------------------------------------------------------- misc

    def reset_prefix_cache(self, now_ns: int) -> PassEvents | None:
        """Drop every cached page; refused (None) while requests hold pages."""
        if self._inflight is not None or self.running or not self.cache.reset():
            return None
        self._version += 1
        return PassEvents(max(now_ns, self._free_at), self.dp_rank, [(CLEARED,)], self._page)

    def check_invariants(self) -> None:
        """Assert cache and request accounting agree (tests)."""
        cache = self.cache
        cache.check()
        page = self._page
        holders = [*self.running, *(s for s in self.waiting if s.computed)]
        if self._inflight is not None:  # a half-prefilled request rejoins the queue (or, aborted, lets go) at its end
            holders += [c.seq for c in self._inflight.chunks if not c.final]
        assert sum(s.owned for s in holders) == cache.owned, (holders, cache)
        for s in holders:
            assert s.cached_pages + s.owned == -(-s.computed // page), s
            assert (s.node is None) == (s.cached_pages == 0), s

    def __repr__(self) -> str:
        return (f"SglangEngineCore(rank={self.dp_rank}, now={self._now}, running={len(self.running)}, "
                f"waiting={self.num_waiting}, ratio={self.ratio:.4f}, {self.cache!r})")


SglangCore = SglangEngineCore
"""The old name of ``SglangEngineCore`` (before the flavour folders), kept for one release."""
