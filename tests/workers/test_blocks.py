"""KV block manager: prefix reuse, dedupe, LRU and lineage eviction, reset, and a state machine vs a model."""

from __future__ import annotations

import pytest
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from kvemu.errors import InvalidArgument
from workers.blocks import CLEARED, REMOVED, STORED, BlockPool


class Src:
    """Token source stub: block k of a chain holds tokens [k] * block_size."""

    def __init__(self, block_size: int = 4) -> None:
        self.bs = block_size

    def token_slice(self, lo: int, hi: int) -> list[int]:
        return [i // self.bs for i in range(lo, hi)]


SRC = Src()


def chain(path: tuple[int, ...]) -> list[int]:
    """Distinct, position-dependent block ids for a token path (stand-in for sequence hashes)."""
    return [xxhash.xxh3_64_intdigest(repr(path[: i + 1]).encode()) for i in range(len(path))]


def stored(pool: BlockPool) -> list[int]:
    return [h for e in pool.log if e[0] == STORED for h in e[1]]


def removed(pool: BlockPool) -> list[int]:
    return [h for e in pool.log if e[0] == REMOVED for h in e[1]]


def admit(pool: BlockPool, hashes: list[int]) -> int:
    """Admission as the scheduler does it: reuse the cached prefix, allocate and fill the rest."""
    hits, inactive_hits = pool.match_prefix(hashes, len(hashes))
    need = len(hashes) - hits
    assert need <= pool.available - inactive_hits
    pool.take_hits(hashes, hits)
    pool.allocate(need)
    pool.promote(hashes, hits, len(hashes), SRC)
    return hits


def test_new_blocks_are_stored_once_with_parent_chain():
    pool = BlockPool(16, 4)
    a = chain((1, 2, 3))
    assert admit(pool, a) == 0
    assert pool.log == [(STORED, a, None, SRC, 0)]
    pool.log.clear()
    b = chain((1, 2, 3, 4, 5))
    assert admit(pool, b) == 3  # active hits: shared with the running sequence
    (entry,) = pool.log
    assert entry[:3] == (STORED, b[3:], b[2]) and entry[4] == 3
    assert pool.active == {**dict.fromkeys(b[:3], 2), **dict.fromkeys(b[3:], 1)}
    pool.check()


def test_inactive_hit_reactivates_without_event():
    pool = BlockPool(8, 4)
    a = chain((7, 7))
    admit(pool, a)
    pool.release(a, 2, 0)
    assert pool.inactive.keys() == set(a) and not pool.active
    pool.log.clear()
    assert pool.match_prefix(a, 2) == (2, 2)
    assert admit(pool, a) == 2
    assert pool.log == [] and pool.active == dict.fromkeys(a, 1) and not pool.inactive


def test_filled_block_with_cached_content_is_deduplicated():
    pool = BlockPool(8, 4)
    a = chain((1, 2))
    admit(pool, a)
    pool.allocate(2)  # a second sequence computes the same two blocks without having matched them
    free_before = pool.free
    pool.log.clear()
    assert pool.promote(a, 0, 2, SRC) == 2
    assert pool.log == [] and pool.free == free_before + 2 and pool.active == dict.fromkeys(a, 2)


def test_lru_evicts_oldest_release_first_and_a_sequence_tail_before_its_prefix():
    pool = BlockPool(6, 4)
    a, b = chain((1, 1, 1)), chain((2, 2, 2))
    admit(pool, a)
    admit(pool, b)
    pool.release(a, 3, 0)  # a released first -> evicted first, its last block before its first
    pool.release(b, 3, 0)
    pool.log.clear()
    pool.allocate(4)
    assert removed(pool) == [a[2], a[1], a[0], b[2]]
    assert pool.log == [(REMOVED, [a[2], a[1], a[0], b[2]])]


def test_reactivated_block_leaves_the_lru_order():
    pool = BlockPool(4, 4)
    a, b = chain((1,)), chain((2,))
    admit(pool, a)
    admit(pool, b)
    pool.release(a, 1, 0)
    pool.release(b, 1, 0)
    admit(pool, a)  # a is active again; b is now the only evictable block
    pool.release(a, 1, 0)  # a released again: newer than b
    pool.log.clear()
    pool.allocate(4)
    assert removed(pool) == [b[0], a[0]]


@pytest.mark.parametrize("policy", ["lru", "lineage"])
def test_shared_parent_outlives_its_children_under_both_policies(policy):
    pool = BlockPool(5, 4, eviction=policy)
    base = chain((9,))
    x, y = chain((9, 1)), chain((9, 2))
    admit(pool, x)
    admit(pool, y)  # shares the parent block
    pool.release(x, 2, 0)  # x's leaf goes inactive; the parent is still held by y
    pool.release(y, 2, 0)  # y's leaf, then the parent
    pool.log.clear()
    pool.allocate(pool.free + 2)
    assert removed(pool) == [x[1], y[1]]  # leaves first, oldest first
    assert base[0] in pool.inactive
    pool.allocate(1)
    assert removed(pool)[-1] == base[0]
    pool.check()


@pytest.mark.parametrize("policy", ["lru", "lineage"])
def test_no_block_is_evicted_before_its_cached_descendants(policy):
    # Sequences hold prefixes and release tail first, so a parent is always released after its
    # children: LRU already evicts leaves first, and lineage checks the leaf property explicitly.
    pool = BlockPool(9, 4, eviction=policy)
    paths = [(1, 2, 3), (1, 2), (1, 4), (5,), (1, 2, 3, 6)]
    seqs = [chain(p) for p in paths]
    for h in seqs:
        admit(pool, h)
    for h in (seqs[0], seqs[3], seqs[1], seqs[4], seqs[2]):
        pool.release(h, len(h), 0)
    pool.allocate(pool.free)
    pool.log.clear()
    parent = {c[i]: c[i - 1] for c in seqs for i in range(1, len(c))}
    order = []
    while pool.inactive:
        pool.allocate(1)
        victim = removed(pool)[-1]
        order.append(victim)
        assert not any(parent.get(h) == victim for h in pool.cached_hashes())
        pool.check()
    assert len(order) == 6 and order[-1] == seqs[0][0]


def test_release_keeps_blocks_shared_with_running_sequences_active():
    pool = BlockPool(8, 4)
    a = chain((1, 2, 3))
    admit(pool, a)
    admit(pool, a[:2])
    pool.release(a, 3, 0)
    assert pool.active == dict.fromkeys(a[:2], 1) and list(pool.inactive) == [a[2]]


def test_partial_blocks_count_as_active_and_return_to_free():
    pool = BlockPool(4, 4)
    pool.allocate(3)
    assert pool.num_active_blocks == 3 and pool.free == 1
    pool.release([], 0, 3)
    assert pool.free == 4 and pool.num_active_blocks == 0


def test_allocate_beyond_available_is_refused_unchanged():
    pool = BlockPool(2, 4)
    pool.allocate(2)
    with pytest.raises(InvalidArgument, match="3 blocks requested, only 0 available"):
        pool.allocate(3)
    assert pool.free == 0 and not pool.log


def test_reset_refused_while_in_use_then_clears_everything():
    pool = BlockPool(4, 4)
    a = chain((1, 2))
    admit(pool, a)
    assert pool.reset() is False and pool.active
    pool.release(a, 2, 0)
    pool.log.clear()
    assert pool.reset() is True
    assert pool.log == [(CLEARED,)] and pool.free == 4 and not pool.inactive
    assert pool.match_prefix(a, 2) == (0, 0)
    admit(pool, a)
    assert stored(pool) == a  # announced again after the reset


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 0, "block_size": 4}, "num_gpu_blocks"),
        ({"num_blocks": 4, "block_size": 0}, "block_size"),
        ({"num_blocks": 4, "block_size": 4, "eviction": "fifo"}, "eviction_policy"),
    ],
)
def test_pool_arguments_are_validated(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        BlockPool(**kwargs)


# ------------------------------------------------------------------ state machine vs a reference model


class Model:
    """Straightforward reference: lists and sets, linear scans, no cleverness."""

    def __init__(self, n: int, lineage: bool) -> None:
        self.n = n
        self.lineage = lineage
        self.free = n
        self.refs: dict[int, int] = {}
        self.inactive: list[tuple[int, int]] = []  # (tick, hash) in release order
        self.parent: dict[int, int | None] = {}
        self.tick = 0
        self.stored: list[int] = []
        self.removed: list[int] = []

    def cached(self) -> set[int]:
        return set(self.refs) | {h for _, h in self.inactive}

    def available(self) -> int:
        return self.free + len(self.inactive)

    def evict_one(self) -> None:
        if self.lineage:
            cached = self.cached()
            with_children = {p for h, p in self.parent.items() if h in cached and p is not None}
            i = min(
                (i for i, (_, h) in enumerate(self.inactive) if h not in with_children),
                key=lambda i: self.inactive[i][0],
            )
        else:
            i = 0
        _, h = self.inactive.pop(i)
        self.parent.pop(h, None)
        self.removed.append(h)

    def allocate(self, k: int) -> None:
        take = min(k, self.free)
        self.free -= take
        for _ in range(k - take):
            self.evict_one()

    def hit(self, h: int) -> None:
        if h in self.refs:
            self.refs[h] += 1
        else:
            self.inactive = [(t, x) for t, x in self.inactive if x != h]
            self.refs[h] = 1

    def promote(self, hashes: list[int], lo: int, hi: int) -> None:
        for i in range(lo, hi):
            h = hashes[i]
            if h in self.refs or h in {x for _, x in self.inactive}:
                self.hit(h)
                self.free += 1
            else:
                self.refs[h] = 1
                self.parent[h] = hashes[i - 1] if i else None
                self.stored.append(h)

    def release(self, hashes: list[int], n_full: int, n_partial: int) -> None:
        self.free += n_partial
        for i in range(n_full - 1, -1, -1):
            h = hashes[i]
            self.refs[h] -= 1
            if not self.refs[h]:
                del self.refs[h]
                self.tick += 1
                self.inactive.append((self.tick, h))


class Seq:
    """A sequence holding the first ``full`` blocks of its chain plus ``partial`` partial blocks."""

    def __init__(self, path: tuple[int, ...], hashes: list[int], full: int) -> None:
        self.path = path
        self.hashes = hashes
        self.full = full
        self.partial = 0


class PoolMachine(RuleBasedStateMachine):
    """Random admissions, growth, partial blocks, releases and resets on a tiny pool."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.model: Model | None = None
        self.live: list[Seq] = []
        self.announced: set[int] = set()
        self.gone: set[int] = set()

    @rule(n=st.integers(2, 12), lineage=st.booleans())
    @precondition(lambda self: self.pool is None)
    def create(self, n: int, lineage: bool) -> None:
        self.pool = BlockPool(n, 4, eviction="lineage" if lineage else "lru")
        self.model = Model(n, lineage)

    def _sync_log(self) -> None:
        pool, model = self.pool, self.model
        assert stored(pool) == model.stored, (stored(pool), model.stored)
        assert removed(pool) == model.removed, (removed(pool), model.removed)
        for e in pool.log:
            if e[0] == STORED:
                hashes, parent, first = e[1], e[2], e[4]
                for k, h in enumerate(hashes):
                    assert model.parent[h] == (parent if k == 0 else hashes[k - 1])
                assert (parent is None) == (first == 0)
        self.announced |= set(stored(pool))
        self.gone |= set(removed(pool))
        for h in stored(pool):
            self.gone.discard(h)
        pool.log.clear()
        model.stored.clear()
        model.removed.clear()

    @rule(target=seqs, path=st.lists(st.integers(0, 2), min_size=1, max_size=5).map(tuple))
    @precondition(lambda self: self.pool is not None)
    def admit_seq(self, path: tuple[int, ...]):
        pool, model = self.pool, self.model
        hashes = chain(path)
        hits, inactive_hits = pool.match_prefix(hashes, len(hashes))
        cached = model.cached()
        exp_hits = 0
        while exp_hits < len(hashes) and hashes[exp_hits] in cached:
            exp_hits += 1
        assert hits == exp_hits
        assert inactive_hits == sum(1 for h in hashes[:hits] if h not in model.refs)
        need = len(hashes) - hits
        if need > pool.available - inactive_hits:
            return None
        pool.take_hits(hashes, hits)
        for h in hashes[:hits]:
            model.hit(h)
        pool.allocate(need)
        model.allocate(need)
        pool.promote(hashes, hits, len(hashes), SRC)
        model.promote(hashes, hits, len(hashes))
        self._sync_log()
        seq = Seq(path, hashes, len(hashes))
        self.live.append(seq)
        return seq

    @rule(seq=seqs, token=st.integers(0, 2))
    def grow(self, seq, token: int) -> None:
        if seq is None or seq not in self.live or self.pool.available < 1:
            return
        pool, model = self.pool, self.model
        seq.path = seq.path + (token,)
        seq.hashes = chain(seq.path)
        if seq.partial:
            seq.partial -= 1  # the partial block fills up
        else:
            pool.allocate(1)
            model.allocate(1)
        pool.promote(seq.hashes, seq.full, seq.full + 1, SRC)
        model.promote(seq.hashes, seq.full, seq.full + 1)
        seq.full += 1
        self._sync_log()

    @rule(seq=seqs)
    def add_partial(self, seq) -> None:
        if seq is None or seq not in self.live or seq.partial or self.pool.available < 1:
            return
        self.pool.allocate(1)
        self.model.allocate(1)
        seq.partial = 1
        self._sync_log()

    @rule(seq=consumes(seqs))
    def finish(self, seq) -> None:
        if seq is None or seq not in self.live:
            return
        self.live.remove(seq)
        self.pool.release(seq.hashes, seq.full, seq.partial)
        self.model.release(seq.hashes, seq.full, seq.partial)
        self._sync_log()

    @rule()
    @precondition(lambda self: self.pool is not None)
    def reset(self) -> None:
        ok = self.pool.reset()
        assert ok == (not self.live)
        if ok:
            self.model = Model(self.model.n, self.model.lineage)
            self.announced.clear()
            self.gone.clear()
            assert self.pool.log == [(CLEARED,)]
            self.pool.log.clear()

    @invariant()
    def consistent(self) -> None:
        pool, model = self.pool, self.model
        if pool is None:
            return
        pool.check()
        assert pool.free == model.free
        assert pool.active == model.refs
        assert sorted(pool.inactive, key=pool.inactive.__getitem__) == [h for _, h in model.inactive]
        # blocks announced minus blocks removed == what the pool caches
        assert self.announced - self.gone == pool.cached_hashes() == model.cached()
        partial = sum(s.partial for s in self.live)
        assert pool.free + partial + len(pool.active) + len(pool.inactive) == pool.num_blocks
        assert pool.num_active_blocks == partial + len(pool.active)


PoolMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPoolMachine = PoolMachine.TestCase
