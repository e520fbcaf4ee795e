"""The native block tables (``kvemu._blockpool``) under ``workers.blocks.BlockPool`` against its pure-Python tables.

A native-backed pool and a pure one go through the same random operations (admissions with shared prefixes and
prefix hits, admissions that ignore the cache so full blocks meet cached ones, growth by ``promote_one`` and
``promote``, partial blocks, allocations that evict, releases, resets, hostile calls) and must agree on every
observable after each step: return values, the exception type, ``cached`` with its ticks, ``free``,
``num_inactive``, ``version``, the drained log entries (their container types too) and the eviction order.
Skipped when the extension is not built; a failure under ``KVEMU_REQUIRE_COMPILED=1``. ``.ci/sanitize`` runs the
tests not marked ``installed_build`` against a sanitizer build (``tests.native``).
"""

from __future__ import annotations

import random
from pathlib import Path
from types import ModuleType

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from workers.blocks import BlockPool
from tests.native import EXAMPLES, assert_built_and_selected, assert_stale_when_edited, load_native, selected

ROOT = Path(__file__).resolve().parents[2]
NAME = "kvemu._blockpool"
U64 = (1 << 64) - 1


class Src:
    """Token source stub (the log carries it; both pools get the same object)."""

    def token_slice(self, lo: int, hi: int) -> list[int]:
        return list(range(lo, hi))

    def local_hashes(self, lo: int, hi: int) -> list[int]:
        return list(range(lo, hi))


SRC = Src()


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return load_native(NAME)


def chain(path: tuple[int, ...]) -> list[int]:
    """Distinct, prefix-dependent u64 block hashes for a token path."""
    return [xxhash.xxh3_64_intdigest(repr(path[: i + 1]).encode()) for i in range(len(path))]


def lru_order(pool: BlockPool) -> list[int]:
    """The inactive blocks in eviction order, from either implementation's queue."""
    if pool.native:
        return pool._t.order()  # type: ignore[union-attr]
    return [h for h in pool._order[pool._head:] if h is not None]


def outcome(fn, *args) -> tuple[str, object]:
    try:
        return "ok", fn(*args)
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return type(exc).__name__, None


def drain(pool: BlockPool) -> list[tuple]:
    log = pool.log
    pool.log = []
    return log


def shape(entries: list[tuple]) -> list[tuple]:
    """Each entry with its containers' types: a list and a tuple of the same hashes are not the same report."""
    return [tuple((type(x).__name__, list(x)) if isinstance(x, (list, tuple)) else x for x in e) for e in entries]


def same_state(a: BlockPool, b: BlockPool) -> None:
    """Every observable of a native pool ``a`` equals the pure pool ``b``'s."""
    assert a.native and not b.native
    assert a.cached == b.cached
    assert (a.free, a.num_inactive, a.version, a.available, a.num_active_blocks) == (
        b.free, b.num_inactive, b.version, b.available, b.num_active_blocks)
    assert a.active == b.active and a.inactive == b.inactive and a.cached_hashes() == b.cached_hashes()
    assert lru_order(a) == lru_order(b)
    la, lb = drain(a), drain(b)
    assert la == lb
    assert shape(la) == shape(lb)
    a.check()
    b.check()
    assert repr(a) == repr(b)


class Seq:
    """A sequence holding the first ``full`` blocks of ``hashes`` and ``partial`` partial blocks."""

    def __init__(self, path: tuple[int, ...], full: int) -> None:
        self.path = path
        self.hashes = chain(path)
        self.full = full
        self.partial = 0


class Twin:
    """The same call on both pools: equal outcomes (return value or exception type) required."""

    def __init__(self, a: BlockPool, b: BlockPool) -> None:
        self.a, self.b = a, b

    def __call__(self, method: str, *args):
        ra = outcome(getattr(self.a, method), *args)
        rb = outcome(getattr(self.b, method), *args)
        assert ra == rb, (method, args, ra, rb)
        return ra


class DifferentialPool(RuleBasedStateMachine):
    """Random request-level operations on a native-backed and a pure pool, compared after every step."""

    module: ModuleType | None = None

    @initialize(n=st.integers(2, 40))
    def create(self, n: int) -> None:
        self.a = BlockPool(n, 4, native=self.module)
        self.b = BlockPool(n, 4, native=False)
        self.twin = Twin(self.a, self.b)
        self.live: list[Seq] = []

    def _admit(self, path: tuple[int, ...], caching: bool) -> None:
        hashes = chain(path)
        kind, (hits, inactive_hits) = self.twin("match_prefix", hashes, len(hashes)) if caching else ("ok", (0, 0))
        need = len(hashes) - hits
        if need > self.a.available - inactive_hits:
            return
        self.twin("take_hits", hashes, hits)
        self.twin("allocate", need)
        kind, released = self.twin("promote", hashes, hits, len(hashes), SRC)
        assert kind == "ok"
        self.live.append(Seq(path, len(hashes)))

    @rule(path=st.lists(st.integers(0, 2), min_size=1, max_size=8).map(tuple))
    def admit(self, path: tuple[int, ...]) -> None:
        self._admit(path, caching=True)

    @rule(path=st.lists(st.integers(0, 2), min_size=1, max_size=8).map(tuple))
    def admit_uncached(self, path: tuple[int, ...]) -> None:
        """Prefix caching off: every block is computed; those already cached are deduplicated (released)."""
        self._admit(path, caching=False)

    @rule(i=st.integers(0, 1000), token=st.integers(0, 2), one=st.booleans())
    @precondition(lambda self: self.live)
    def grow(self, i: int, token: int, one: bool) -> None:
        seq = self.live[i % len(self.live)]
        if not seq.partial and self.a.available < 1:
            return
        if seq.partial:
            seq.partial -= 1
        else:
            self.twin("allocate", 1)
        seq.path = seq.path + (token,)
        seq.hashes = chain(seq.path)
        if one:
            self.twin("promote_one", seq.hashes, seq.full, SRC)
        else:
            self.twin("promote", seq.hashes, seq.full, seq.full + 1, SRC)
        seq.full += 1

    @rule(i=st.integers(0, 1000))
    @precondition(lambda self: self.live)
    def add_partial(self, i: int) -> None:
        seq = self.live[i % len(self.live)]
        if seq.partial or self.a.available < 1:
            return
        self.twin("allocate", 1)
        seq.partial = 1

    @rule(i=st.integers(0, 1000))
    @precondition(lambda self: self.live)
    def finish(self, i: int) -> None:
        seq = self.live.pop(i % len(self.live))
        self.twin("release", seq.hashes, seq.full, seq.partial)

    @rule()
    def reset(self) -> None:
        kind, ok = self.twin("reset")
        assert ok == (not self.live)

    @rule(n=st.integers(-3, 60))
    def allocate_and_give_back(self, n: int) -> None:
        """An allocation (evicting as needed, refused beyond what is available), given back as partial blocks."""
        kind, _ = self.twin("allocate", n)
        if kind == "ok" and n > 0:
            self.twin("release", [], 0, n)

    @rule(data=st.data())
    def hostile(self, data) -> None:
        """Calls a correct caller never makes, failing before any change (or changing both alike)."""
        bad = data.draw(st.sampled_from([-1, U64 + 1, 1 << 64, -(1 << 70), 10 ** 40]))
        good = [h for s in self.live for h in s.hashes[: s.full]]
        ok = data.draw(st.sampled_from(good)) if good else 5
        junk = data.draw(st.sampled_from([1.5, "x", None, b"\x01", bad, (1,)]))
        call = data.draw(st.sampled_from(range(11)))
        if call == 0:
            self.twin("match_prefix", [ok, bad, ok], 3)
        elif call == 1:
            self.twin("match_prefix", [ok], data.draw(st.integers(-5, -1)))
        elif call == 2:
            self.twin("take_hits", [bad, ok], 2)
        elif call == 3:
            self.twin("take_hits", [ok], -1)
        elif call == 4:
            self.twin("release", [ok, bad], 2, 0)
        elif call == 5:
            self.twin("promote", [junk], 0, 1, SRC)
        elif call == 6:
            self.twin("promote", [7, 8, junk, 9], 0, 4, SRC)
        elif call == 7:
            lo, hi = data.draw(st.sampled_from([(-1, 1), (0, 5), (3, 9), (-4, -2)]))
            self.twin("promote", [1, 2, 3], lo, hi, SRC)
        elif call == 8:
            self.twin("promote_one", [1, junk], 1, SRC)
        elif call == 9:
            self.twin("promote_one", [1, 2], data.draw(st.sampled_from([-1, 2, 5])), SRC)
        else:
            self.twin("allocate", self.a.available + data.draw(st.integers(1, 5)))

    @invariant()
    def agree(self) -> None:
        same_state(self.a, self.b)


def test_differential_state_machine(native):
    DifferentialPool.module = native
    machine = DifferentialPool.TestCase
    machine.settings = settings(max_examples=max(EXAMPLES // 3, 20), stateful_step_count=40, deadline=None,
                                suppress_health_check=list(HealthCheck))
    machine().runTest()


ops = st.lists(st.tuples(st.integers(0, 4), st.integers(0, U64), st.integers(0, 50)), max_size=120)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 200), steps=ops, small=st.booleans())
def test_fuzz_single_blocks_churn_the_table(native, n, steps, small):
    """One-block requests with random keys (``small``: from a handful, so they meet again): stores, hits,
    releases and evictions that grow the table, collide and delete across its wrap-around."""
    a, b = BlockPool(n, 4, native=native), BlockPool(n, 4, native=False)
    twin = Twin(a, b)
    held: list[int] = []
    for op, key, k in steps:
        key = key % 97 if small else key
        if op == 0 and a.available >= 1:
            twin("allocate", 1)
            twin("promote_one", [key], 0, SRC)
            held.append(key)
        elif op == 1:
            kind, (hits, _) = twin("match_prefix", [key], 1)
            twin("take_hits", [key], hits)
            if hits:
                held.append(key)
        elif op == 2 and held:
            twin("release", [held.pop(k % len(held))], 1, 0)
        elif op == 3:
            kind, _ = twin("allocate", k)
            if kind == "ok" and k > 0:
                twin("release", [], 0, k)
        elif op == 4 and not held:
            twin("reset")
        same_state(a, b)


def test_a_long_run_compacts_the_queue_and_grows_the_table(native):
    """Thousands of requests through a small pool: the LRU queue is compacted (> 4096 consumed entries) and the
    table grows past its first size; the two pools stay equal throughout."""
    rng = random.Random(46)
    a, b = BlockPool(300, 16, native=native), BlockPool(300, 16, native=False)
    twin = Twin(a, b)
    live: list[Seq] = []
    for step in range(3000):
        if live and (len(live) > 6 or rng.random() < 0.45):
            seq = live.pop(rng.randrange(len(live)))
            twin("release", seq.hashes, seq.full, seq.partial)
        else:
            path = tuple(rng.randrange(3) for _ in range(rng.randint(1, 4))) + tuple(
                rng.randrange(10 ** 6) for _ in range(rng.randint(0, 12)))
            hashes = chain(path)
            kind, (hits, inactive) = twin("match_prefix", hashes, len(hashes))
            need = len(hashes) - hits
            if need <= a.available - inactive:
                twin("take_hits", hashes, hits)
                twin("allocate", need)
                twin("promote", hashes, hits, len(hashes), SRC)
                live.append(Seq(path, len(hashes)))
        if step % 100 == 0:
            same_state(a, b)
    same_state(a, b)
    assert a._t.tick > 8000  # type: ignore[union-attr]


def test_table_methods_validate_their_arguments(native):
    t = native.Table()
    with pytest.raises(TypeError):
        native.Table(1)
    with pytest.raises(TypeError):
        t.match([1])
    with pytest.raises(ValueError):
        t.match([1], -1)
    with pytest.raises(TypeError):
        t.take([1], "1")
    with pytest.raises(ValueError):
        t.evict(1)  # nothing inactive
    with pytest.raises(TypeError, match=r"block hash \[1\] must be an int"):
        t.promote([1, 2.0])
    with pytest.raises(OverflowError, match=r"block hash \[0\] must be in"):
        t.promote([1 << 64])
    with pytest.raises(OverflowError):
        t.promote_one(-1)
    with pytest.raises(TypeError):
        t.promote(5)
    assert len(t) == 0 and t.n_inactive == 0  # the refused calls changed nothing
    assert t.promote([1, 2, 3]) is None and t.promote([3, 4]) == [0] and len(t) == 4
    assert t.get(3) == 2 and t.get(-1) is None and t.get("x") is None and (1 << 70) not in t and 4 in t
    t.release([4, 3, 2, 1], 4)  # refs 1+2+1+1 != 4: one by one
    assert t.get(3) == 1 and t.get(4) == -1 and t.get(1) == -3 and t.order() == [4, 2, 1]
    assert t.evict(2) == [4, 2] and t.order() == [1] and t.n_inactive == 1
    t.check()
    t.clear()
    assert len(t) == 0 and t.items() == [] and t.tick == 3


def test_native_selection_rules(native):
    assert BlockPool(4, 4, native=native).native
    assert not BlockPool(4, 4, native=False).native
    assert not BlockPool(4, 4, eviction="lineage").native
    assert not BlockPool(4, 4, groups=2).native
    with pytest.raises(ValueError):
        BlockPool(4, 4, eviction="lineage", native=native)
    with pytest.raises(ValueError):
        BlockPool(4, 4, groups=3, native=native)


_PROBE = """
from workers.blocks import BlockPool
SELECTED = {"native": BlockPool(4, 4).native}
"""


@pytest.mark.installed_build
def test_pure_python_switch_selects_the_reference(native):
    assert selected(NAME, _PROBE, pure=True) == {"native": False, "loaded": False}


@pytest.mark.installed_build
def test_the_built_extension_is_selected_without_the_switch(native):
    assert_built_and_selected(NAME, _PROBE)


@pytest.mark.installed_build
def test_a_c_source_edited_after_the_build_is_stale():
    assert_stale_when_edited(NAME)
