"""Hybrid KV cache groups of the vLLM-flavour engine (``EngineConfig.kv_groups``): vLLM's hybrid KV cache manager.

A hybrid model's layers form KV cache groups (``EngineConfig.kv_cache_groups``), each with its own block table
but all drawing on **one** block pool (vLLM: one ``BlockPool`` for every group, blocks compete dynamically).
Every group has the engine's block size (vLLM unifies page sizes; kvemu takes the unified size as given).

How a group keeps a request's blocks (as vLLM's per-group managers do):

* ``full_attention``: every block, as the plain engine.
* ``sliding_window`` W: before each pass (``allocate_slots`` order) the blocks whose tokens are all before
  ``n - W + 1`` (``n`` = computed tokens before the pass) are freed, keeping their hash: they stay cached
  (evictable) until their block is reused.
* ``state`` with prefix caching, ``all`` cache mode: the state after every full block is a cached checkpoint, and
  only the running state's block is kept: vLLM's rule ``skipped tokens = n - 1``, i.e. a sliding window of 2
  tokens, which is how kvemu runs it.
* ``state``, ``align`` cache mode (vLLM's only one from ~0.31): a fresh request's prefill chunks are cut to whole
  blocks and at the prompt's last block boundary (``chunk``); a request holds at most two state blocks, the one
  the pass reads (``glo``: its position; ``SeqState.src_cached``: whether it is a checkpoint) and the one it writes
  (position ``n_alloc - 1``, a checkpoint iff ``n_full == n_alloc``), the older freed before the next pass; a
  block is cached (a checkpoint, stored) only where a pass ends exactly on its boundary. The blocks between are
  vLLM's null blocks: never allocated.
* ``state`` without prefix caching: a request holds exactly one state block (vLLM sizes it to the whole model
  length).

Keys: the pool is keyed by block hash, so group ``g``'s block ``i`` is keyed ``hash_i + (g << 64)`` (group 0
keeps the plain 64-bit sequence hash); ``key & U64`` is the wire hash and ``key >> 64`` the ``group_idx``.

Prefix hits (vLLM's hybrid coordinator, a fixed point): the largest block count every group accepts. A full
attention group accepts its leading run of cached blocks; a sliding-window (or state) group needs the
``ceil((W - 1) / block_size)`` blocks right before the hit point cached (searched right to left; a shorter run
from block 0 also counts); the lookup repeats with the shrunk length until no group shrinks it.

Pass timing (``decode_kv``): a decode's context counts whole in full-attention layers, up to W in a window's, not
in state layers. A disaggregated decode leg lands per group what the request still holds (``land``).

Per request, ``SeqState.n_alloc`` / ``n_full`` count block positions (the same in every group that grows) and
``SeqState.glo[g]`` is the first position group ``g`` still holds (0 for full attention).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import overload

from workers.blocks import BlockPool, TokenSource
from workers.config import SPEC_KIND, EngineConfig, KvCacheGroup, KvGroupSpec
from workers.sequence import SeqState

__all__ = ["HybridKV", "GroupKeys", "max_blocks", "FULL", "WINDOW", "ONE", "ALIGN", "U64", "SPEC_KIND"]

FULL = 0
WINDOW = 1
ONE = 2  # a state group without prefix caching: one block per request
ALIGN = 3  # a state group in vLLM's ``align`` cache mode: checkpoints where a pass ends on a block boundary
U64 = (1 << 64) - 1


class GroupKeys(Sequence[int]):
    """A request's pool keys in one group: its sequence hashes offset by ``g << 64`` (indexable, sliceable)."""

    __slots__ = ("hashes", "off")

    def __init__(self, hashes: list[int], off: int) -> None:
        self.hashes = hashes
        self.off = off

    def __len__(self) -> int:
        return len(self.hashes)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        off = self.off
        if isinstance(i, slice):
            return [h + off for h in self.hashes[i]]
        return self.hashes[i] + off


class HybridKV:
    """The groups of one engine and every per-request block operation that depends on them."""

    __slots__ = ("groups", "block_size", "caching", "kinds", "windows", "targets", "n_grow", "n_one", "n_align", "order",
                 "caps", "meta", "cost")

    def __init__(self, groups: list[KvCacheGroup], block_size: int, caching: bool, max_batched: int,
                 specs: Sequence[KvGroupSpec] = ()) -> None:
        self.groups = groups
        self.block_size = bs = block_size
        self.caching = caching
        self.kinds: list[int] = []
        self.windows: list[int] = []
        for g in groups:
            if g.kind == "full_attention":
                self.kinds.append(FULL)
                self.windows.append(0)
            elif g.kind == "sliding_window":
                assert g.window is not None
                self.kinds.append(WINDOW)
                self.windows.append(g.window)
            else:
                self.kinds.append(ONE if not caching else WINDOW if g.cache_mode == "all" else ALIGN)
                self.windows.append(2 if caching else 0)
        self.targets = [-(-(w - 1) // bs) if k in (WINDOW, ALIGN) else 0 for k, w in zip(self.kinds, self.windows)]
        """Blocks before a hit point a group needs cached (full attention: all of them, marked 0)."""
        self.n_grow = sum(1 for k in self.kinds if k != ONE)
        """Groups that take a block when a request reaches a new block position (an ``align`` group one block
        however many positions a pass reaches: ``grow_need``)."""
        self.n_one = len(self.kinds) - self.n_grow
        self.n_align = sum(1 for k in self.kinds if k == ALIGN)
        self.order = [g for g in range(len(groups)) if self.kinds[g] == FULL]
        self.order += [g for g in range(len(groups)) if self.kinds[g] != FULL]
        """Lookup order: full attention first (vLLM sorts it first)."""
        self.caps = [-(-(w - 1 + max_batched) // bs) + 1 if k == WINDOW else 2 if k == ALIGN else 0
                     for k, w in zip(self.kinds, self.windows)]
        """Most blocks a sliding-window group holds per request (vLLM's ``max_admission_blocks_per_request``); an
        ``align`` state group 2 (vLLM's ``MambaSpec.max_memory_usage_bytes``)."""
        self.meta: list[tuple[str, int | None]] = [(SPEC_KIND[g.kind], g.window) for g in groups]
        """(``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``) per group, for KV events."""
        full = sum(g.layers for g in specs if g.kind == "full_attention")
        total = sum(g.layers for g in specs)
        self.cost: tuple[int, list[tuple[int, int]], int] = (
            (full, [(g.layers, g.window) for g in specs if g.window is not None], total) if total else (1, [], 1))
        """The model's layers for pass timing (``decode_kv``): (full attention, [(sliding window, W)], all);
        without ``specs``, every layer counts as full attention."""

    def decode_kv(self, contexts: Iterable[int]) -> int:
        """The decode KV tokens a pass's attention reads, in tokens of all the model's layers: each request's context
        counted whole by full-attention layers, up to W by a sliding window's, not at all by state layers (a
        recurrent layer's cost does not grow with the context); the layer-weighted sum, floored."""
        full, windows, total = self.cost
        if full == total:
            return sum(contexts)
        n = 0
        for c in contexts:
            n += full * c
            for layers, w in windows:
                n += layers * (c if c < w else w)
        return n // total

    def keys(self, seq: SeqState, g: int) -> Sequence[int]:
        return seq.hashes if g == 0 else GroupKeys(seq.hashes, g << 64)

    def start(self, seq: SeqState) -> None:
        """A request that holds nothing (new, preempted or freed); an ``align`` group's ``glo`` is -1 (no state read)."""
        seq.glo = [-1 if k == ALIGN else 0 for k in self.kinds]
        seq.src_cached = False

    def chunk(self, seq: SeqState, computed: int, n: int) -> int:
        """The prompt tokens a pass computes for ``seq`` from ``computed`` when ``n`` would fit: with an ``align`` state
        group and nothing sampled yet (vLLM's ``_mamba_block_aligned_split``), whole blocks until the prompt's last
        block boundary, a cut there (so the state there is cached), then the rest. 0: not scheduled this pass."""
        if not self.n_align or seq.n_out:
            return n
        bs = self.block_size
        total = seq.prompt_len
        last = total - total % bs
        end = computed + n
        if end < last:
            return n - n % bs
        if computed < last < end:
            return last - computed
        return n

    # ----------------------------------------------------------------- lookup

    def hit(self, pool: BlockPool, hashes: list[int], limit: int) -> int:
        """The longest prefix of ``hashes[:limit]`` every group accepts (vLLM's fixed point); read-only."""
        cached = pool.cached
        kinds = self.kinds
        targets = self.targets
        curr = limit
        leading: dict[int, int] = {}
        while True:
            before = curr
            for g in self.order:
                if not curr:
                    break
                kind = kinds[g]
                if kind == FULL:
                    run = leading.get(g)
                    if run is None:
                        off = g << 64
                        run = 0
                        for h in hashes[:curr]:
                            if h + off not in cached:
                                break
                            run += 1
                        leading[g] = run
                    if run < curr:
                        curr = run
                elif kind != ONE:
                    curr = _window_hit(cached, hashes, g << 64, curr, targets[g])
            if curr == before or not curr:
                break
        return curr

    def lookup(self, pool: BlockPool, seq: SeqState, limit: int) -> tuple[int, int, int]:
        """Prefix hit of ``seq`` capped at ``limit`` blocks: (hit blocks, blocks it would take from the cache over
        all groups, how many of those are inactive)."""
        if limit <= 0:
            return 0, 0, 0
        hashes = seq.ensure_hashes(limit)
        curr = self.hit(pool, hashes, limit)
        if not curr:
            return 0, 0, 0
        cached = pool.cached
        kinds = self.kinds
        targets = self.targets
        taken = inactive = 0
        for g, kind in enumerate(kinds):
            if kind == ONE:
                continue
            lo = 0 if kind == FULL else max(0, curr - targets[g])
            off = g << 64
            for h in hashes[lo:curr]:
                taken += 1
                if cached[h + off] < 0:
                    inactive += 1
        return curr, taken, inactive

    def take(self, pool: BlockPool, seq: SeqState, hit: int) -> None:
        """``seq`` (holding nothing) references its ``hit`` cached blocks in every group (as ``lookup`` found)."""
        glo = seq.glo
        assert glo is not None
        for g, kind in enumerate(self.kinds):
            if kind == ONE:
                continue
            lo = 0 if kind == FULL else max(0, hit - self.targets[g])
            glo[g] = lo
            if hit > lo:
                pool.take_hits(self.keys(seq, g)[lo:hit], hit - lo)
        seq.src_cached = True  # (an align group's state read: the checkpoint at the hit point)

    # ----------------------------------------------------------- decode legs

    def land(self, pool: BlockPool, seq: SeqState, prompt: int, take: bool, missing_only: bool = False
             ) -> tuple[int, int, int, int]:
        """A decode leg's prompt KV lands here: per group what it still holds, full attention every block, a sliding
        window the blocks its first pass (computing position ``prompt - 1``) reads, a state group the running state's.
        Cached blocks count where every full-attention group has the leading run, up to the first block a window
        holds (so a window's blocks are all carried) and before an ``align`` group's block. Returns (cached blocks, blocks to allocate, inactive cached
        blocks taken, tokens the transfer moves: per layer, full attention the prompt (``missing_only``: the blocks
        not cached here), a window what it holds, a state layer one page; their mean over the model's layers); with
        ``take`` it also takes the cached blocks and sets ``seq.glo`` (``seq`` holding nothing)."""
        bs = self.block_size
        whole = -(-prompt // bs)
        seq.ensure_hashes(prompt // bs)
        los = [0 if k != WINDOW else min(whole, (prompt - w) // bs if prompt > w else 0)
               for k, w in zip(self.kinds, self.windows)]
        # (an align state group's running block is a checkpoint iff n_full reaches it: it lands uncached, so the hit
        # stops before it)
        hit = min([lo for k, lo in zip(self.kinds, los) if k == WINDOW] + [whole - 1 if self.n_align else prompt // bs])
        cached = pool.cached if self.caching else None
        for g, kind in enumerate(self.kinds):
            if kind == FULL and hit:
                run = 0
                if cached is not None:
                    keys = self.keys(seq, g)
                    while run < hit and keys[run] in cached:
                        run += 1
                hit = run
        if not any(k == FULL for k in self.kinds) or cached is None:
            hit = 0
        need = inactive = 0
        full, windows, total = self.cost
        for g, kind in enumerate(self.kinds):
            if kind == FULL:
                need += whole - hit
                if hit and cached is not None:
                    inactive += sum(1 for k in self.keys(seq, g)[:hit] if cached[k] < 0)
            elif kind == WINDOW:
                need += whole - los[g]
            else:
                need += 1
        if take:
            self.start(seq)
            glo = seq.glo
            assert glo is not None
            for g, kind in enumerate(self.kinds):
                if kind == FULL and hit:
                    pool.take_hits(self.keys(seq, g), hit)
                elif kind == WINDOW:
                    glo[g] = los[g]
                elif kind == ALIGN:
                    glo[g] = whole - 1
        state = total - full - sum(n for n, _ in windows)
        weighted = full * ((whole - hit) * bs if missing_only else prompt) + state * bs
        for layers, w in windows:
            lo = min(whole, (prompt - w) // bs if prompt > w else 0)
            weighted += layers * ((whole - lo) * bs if missing_only else prompt - lo * bs)
        return hit, need, inactive, weighted // total

    # ----------------------------------------------------------------- blocks

    def skip(self, pool: BlockPool, seq: SeqState) -> None:
        """Free the blocks a sliding-window group no longer needs before ``seq``'s next pass (vLLM's
        ``remove_skipped_blocks`` with the tokens computed so far): they stay cached when full."""
        glo = seq.glo
        assert glo is not None
        c = seq.computed
        bs = self.block_size
        nf = seq.n_full
        if self.n_align:
            self._skip_align(pool, seq)
        for g, w in enumerate(self.windows):
            if self.kinds[g] != WINDOW or c - w + 1 <= 0:
                continue
            new_lo = min((c - w + 1) // bs, seq.n_alloc)
            lo = glo[g]
            if new_lo <= lo:
                continue
            full_hi = min(new_lo, nf)
            n_cached = full_hi - lo if full_hi > lo else 0
            n_partial = new_lo - max(lo, nf) if new_lo > max(lo, nf) else 0
            pool.release(self.keys(seq, g)[lo:full_hi] if n_cached else [], n_cached, n_partial)
            glo[g] = new_lo

    def _skip_align(self, pool: BlockPool, seq: SeqState) -> None:
        """``align`` groups before a pass: the state block read last pass goes if older than the running one
        (vLLM: once ``< cdiv(n, block_size) - 1``); the running one (position ``n_alloc - 1``) is read next."""
        glo = seq.glo
        assert glo is not None
        new_lo = -(-seq.computed // self.block_size) - 1
        for g, kind in enumerate(self.kinds):
            if kind != ALIGN or new_lo <= glo[g]:
                continue
            lo = glo[g]
            if lo >= 0:
                if seq.src_cached:
                    pool.release([self.keys(seq, g)[lo]], 1, 0)
                else:
                    pool.release([], 0, 1)
            glo[g] = new_lo
        seq.src_cached = seq.n_alloc > 0 and seq.n_full >= seq.n_alloc

    def skippable(self, seq: SeqState) -> int:
        """How many blocks ``skip`` would free for ``seq`` now."""
        glo = seq.glo
        assert glo is not None
        c = seq.computed
        bs = self.block_size
        n = 0
        if self.n_align:
            new_lo = -(-c // bs) - 1
            n += sum(1 for g, k in enumerate(self.kinds) if k == ALIGN and 0 <= glo[g] < new_lo)
        for g, w in enumerate(self.windows):
            if self.kinds[g] == WINDOW and c - w + 1 > 0:
                new_lo = min((c - w + 1) // bs, seq.n_alloc)
                if new_lo > glo[g]:
                    n += new_lo - glo[g]
        return n

    def skip_ahead(self, glo: list[int], c: int, n_alloc: int, n_full: int, src_cached: bool) -> tuple[int, int]:
        """What ``skip`` frees before a pass of a request simulated on copies (look-ahead): its ``glo`` (updated in
        place), ``c`` tokens computed, ``n_alloc`` / ``n_full`` block positions, whether its ``align`` state read is
        a checkpoint. Returns (blocks that stay cached, blocks freed outright)."""
        bs = self.block_size
        cached = uncached = 0
        for g, kind in enumerate(self.kinds):
            if kind == ALIGN:
                new_lo = -(-c // bs) - 1
                if new_lo > glo[g]:
                    if glo[g] >= 0:
                        if src_cached:
                            cached += 1
                        else:
                            uncached += 1
                    glo[g] = new_lo
            elif kind == WINDOW:
                w = self.windows[g]
                if c - w + 1 > 0:
                    new_lo = min((c - w + 1) // bs, n_alloc)
                    lo = glo[g]
                    if new_lo > lo:
                        k = min(new_lo, n_full) - lo
                        k = k if k > 0 else 0
                        cached += k
                        uncached += new_lo - lo - k
                        glo[g] = new_lo
        return cached, uncached

    def promote(self, pool: BlockPool, seq: SeqState, lo: int, hi: int, source: TokenSource,
                end: int | None = None) -> None:
        """Block positions ``lo .. hi-1`` of ``seq`` became full, its pass ending at ``end`` tokens (None: ``hi``
        blocks): cached in every group that holds them, in group order (vLLM: one ``BlockStored`` per request and
        group); an ``align`` group caches only block ``hi - 1``, and only if the pass ends on its boundary."""
        glo = seq.glo
        assert glo is not None
        for g, kind in enumerate(self.kinds):
            if kind == ONE:
                continue
            if kind == ALIGN:
                if end is None or end == hi * self.block_size:
                    pool.promote(self.keys(seq, g), hi - 1, hi, source)
                continue
            a = lo if lo > glo[g] else glo[g]
            if a < hi:
                pool.promote(self.keys(seq, g), a, hi, source)

    def free(self, pool: BlockPool, seq: SeqState) -> None:
        """``seq`` drops every block it holds, group by group, each tail first (vLLM's ``free`` order)."""
        glo = seq.glo
        if glo is None:
            return
        nf = seq.n_full
        na = seq.n_alloc
        for g, kind in enumerate(self.kinds):
            if kind == ONE:
                if na:
                    pool.release([], 0, 1)
                continue
            if kind == ALIGN:
                keys = self._align_keys(seq, g)
                pool.release(keys, len(keys), self._align_held(seq, g) - len(keys))
                continue
            lo = glo[g]
            n_cached = nf - lo if nf > lo else 0
            held = na - lo if na > lo else 0
            pool.release(self.keys(seq, g)[lo:nf] if n_cached else [], n_cached, held - n_cached)
        self.start(seq)

    def grow_need(self, blocks: int) -> int:
        """Pool blocks for ``blocks`` more block positions of a request already holding its state blocks (an
        ``align`` group: one, the new running state, however many positions)."""
        if blocks <= 0:
            return 0
        return (self.n_grow - self.n_align) * blocks + self.n_align

    def admit_need(self, positions: int, hit: int) -> int:
        """Pool blocks a new admission allocates: ``positions`` block positions, ``hit`` of them cached."""
        return self.grow_need(positions - hit) + self.n_one

    def whole(self, total: int) -> int:
        """Blocks a request of ``total`` known tokens needs at most at once, over all groups (the admission gate)."""
        positions = -(-total // self.block_size)
        n = 0
        for g, kind in enumerate(self.kinds):
            if kind == FULL:
                n += positions
            elif kind == WINDOW or kind == ALIGN:
                cap = self.caps[g]
                n += positions if positions < cap else cap
            else:
                n += 1
        return n

    def held(self, seq: SeqState) -> list[int]:
        """Blocks ``seq`` holds in each group."""
        glo = seq.glo
        na = seq.n_alloc
        if glo is None or not na:
            return [0] * len(self.kinds)
        return [1 if kind == ONE else self._align_held(seq, g) if kind == ALIGN else max(0, na - glo[g])
                for g, kind in enumerate(self.kinds)]

    def held_keys(self, seq: SeqState) -> list[int]:
        """Pool keys of the cached (full) blocks ``seq`` holds, every group (checks)."""
        glo = seq.glo
        if glo is None:
            return []
        out: list[int] = []
        for g, kind in enumerate(self.kinds):
            if kind == ALIGN:
                out += self._align_keys(seq, g)
            elif kind != ONE and seq.n_full > glo[g]:
                out += self.keys(seq, g)[glo[g]:seq.n_full]
        return out

    def _align_held(self, seq: SeqState, g: int) -> int:
        """Blocks an ``align`` group holds: the state read (``glo``, if any) and the running one (``n_alloc - 1``)."""
        glo = seq.glo
        assert glo is not None
        na = seq.n_alloc
        lo = glo[g]
        return (1 if 0 <= lo < na - 1 else 0) + (1 if na or lo >= 0 else 0)

    def _align_keys(self, seq: SeqState, g: int) -> list[int]:
        """Pool keys of the checkpoints an ``align`` group holds, in position order."""
        glo = seq.glo
        assert glo is not None
        na = seq.n_alloc
        lo = glo[g]
        out: list[int] = []
        keys = self.keys(seq, g)
        if 0 <= lo < na - 1 and seq.src_cached:
            out.append(keys[lo])
        if na and seq.n_full >= na:
            out.append(keys[na - 1])
        elif not na and lo >= 0:
            out.append(keys[lo])  # (a hit taken, nothing allocated yet)
        return out


def max_blocks(config: EngineConfig, tokens: int) -> int:
    """Most pool blocks one request of ``tokens`` KV tokens holds at once, over every group of ``config``."""
    hyb = HybridKV(config.kv_cache_groups, config.resolved_block_size, config.enable_prefix_caching,
                   config.max_num_batched_tokens)
    return hyb.whole(tokens)


def _window_hit(cached: dict[int, int], hashes: list[int], off: int, curr: int, target: int) -> int:
    """A sliding-window group's hit within ``curr`` blocks: right to left, the first run of ``target`` cached
    blocks ends the hit; without one, the run from block 0 (vLLM's ``SlidingWindowManager``)."""
    run = 0
    for i in range(curr - 1, -1, -1):
        if hashes[i] + off in cached:
            run += 1
            if run >= target:
                return i + run
        else:
            run = 0
    return run
