"""The native block table (``kvemu._loadtable``) behind ``kvemu.load.LoadTracker``, against the pure dicts.

A tracker on the native ``HolderTable`` and one on the dicts go through the same random operations (a small pool
of hashes, so blocks are shared across ranks and repeated within a request; more than 64 ranks in one machine, so
the native tracker moves to the dicts once) and must agree on every return value and every observable after each
step, dict orders included; hostile hashes raise the same exception type in both and change nothing. Skipped when
the extension is not built; ``.ci/sanitize`` runs the tests not marked ``installed_build`` against a sanitizer
build (``tests.native``).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvemu.load import LoadTracker
from tests.native import EXAMPLES, assert_built_and_selected, assert_stale_when_edited, load_native, selected

ROOT = Path(__file__).resolve().parents[2]
NAME = "kvemu._loadtable"
U64_MASK = (1 << 64) - 1
POOL = [0, 1, 2, 3, 5, 8, 13, 1 << 40, U64_MASK, U64_MASK - 1, 1 << 63, 0x9E3779B97F4A7C15]


def _module() -> ModuleType:
    return load_native(NAME)


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return _module()


def trackers(module: ModuleType) -> tuple[LoadTracker, LoadTracker]:
    """(native-backed, pure) trackers, both fresh."""
    nat = LoadTracker()
    nat._table = module.HolderTable()
    pure = LoadTracker()
    pure._table = None
    return nat, pure


def snapshot(t: LoadTracker) -> dict:
    """Every observable of a tracker, orders included (dicts as item lists)."""
    ranks = []
    for key, rl in t.ranks().items():
        ranks.append((key, rl.bit, rl.distinct_blocks, list(rl.extra_refs.items()), list(rl.block_refs.items()),
                      rl.active_prefill_tokens, rl.active_requests, rl.output_blocks, rl.prefilling,
                      rl.active_decode_blocks))
    bookings = sorted((r, t.booked_rank(r), t.booked_ns(r)) for r in t._bookings)
    return {"ranks": ranks, "masks": list(t._holder_masks().items()), "len": len(t), "bookings": bookings}


def outcome(fn, *args) -> tuple[str, object]:
    """("ok", result) or (exception type name, None)."""
    try:
        return "ok", fn(*args)
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return type(exc).__name__, None


def ordered(value: object) -> object:
    """A result with its dict order made visible."""
    return list(value.items()) if isinstance(value, dict) else value


class TwinMachine(RuleBasedStateMachine):
    """The native-backed tracker and the pure one, driven alike, equal after every step."""

    WORKERS = 3
    DP = 2

    def __init__(self) -> None:
        super().__init__()
        self.nat, self.pure = trackers(_module())
        self.n = 0
        self.now = 0
        self.keys = [(w, d) for w in range(self.WORKERS) for d in range(self.DP)]

    def both(self, name: str, *args, expect_ok: bool = False, **kwargs):
        a = outcome(lambda: getattr(self.nat, name)(*args, **kwargs))
        b = outcome(lambda: getattr(self.pure, name)(*args, **kwargs))
        assert (a[0], ordered(a[1])) == (b[0], ordered(b[1])), (name, args)
        assert a[0] == "ok" or not expect_ok, (name, args, a)
        return a

    chains = st.lists(st.sampled_from(POOL), min_size=0, max_size=8)

    @rule(data=st.data(), blocks=chains, prefill=st.sampled_from([0, 0, 1, 7, 300]), dt=st.integers(0, 50))
    def add(self, data, blocks, prefill, dt):
        key = data.draw(st.sampled_from(self.keys))
        self.now += dt
        self.both("add", f"r{self.n}", key, blocks, prefill, now_ns=self.now, expect_ok=True)
        self.n += 1

    @rule(data=st.data(), cut=st.integers(0, len(POOL)), prefill=st.integers(0, 3))
    def add_prefix(self, data, cut, prefill):
        """A prefix chain of the pool: the shape real requests have (shared prefixes across ranks)."""
        key = data.draw(st.sampled_from(self.keys))
        self.both("add", f"r{self.n}", key, POOL[:cut], prefill, now_ns=self.now, expect_ok=True)
        self.n += 1

    @precondition(lambda self: len(self.pure))
    @rule(data=st.data())
    def rebook(self, data):
        """A live request id booked again: BookingFailed in both, nothing changes."""
        rid = data.draw(st.sampled_from(sorted(self.pure._bookings)))
        self.both("add", rid, self.keys[0], [1], 0)

    @rule(data=st.data(), blocks=st.lists(st.one_of(st.sampled_from(POOL), st.sampled_from(
        [-1, 1 << 64, -(1 << 70), 1.5, 2.0, None, "1", b"x", (1,)])), max_size=5))
    def add_hostile(self, data, blocks):
        key = data.draw(st.sampled_from(self.keys))
        self.both("add", f"r{self.n}", key, blocks, 0)
        self.n += 1

    def rid(self, data) -> str:
        """A live request id mostly, sometimes one never booked or already freed."""
        live = sorted(self.pure._bookings)
        if live and data.draw(st.integers(0, 4)):
            return data.draw(st.sampled_from(live))
        return f"r{data.draw(st.integers(0, self.n + 1))}"

    @rule(data=st.data())
    def free(self, data):
        self.both("free", self.rid(data))

    @rule(data=st.data())
    def prefill_done(self, data):
        self.both("mark_prefill_completed", self.rid(data))

    @rule(data=st.data(), weight=st.sampled_from([1.0, 0.5, 0.25, 3.0]))
    def output_block(self, data, weight):
        self.both("add_output_block", self.rid(data), weight)

    @rule(worker=st.integers(0, 4))
    def drop_worker(self, worker):
        self.both("drop_worker", worker)

    @rule(horizon=st.integers(0, 200))
    def expire(self, horizon):
        self.both("expire", self.now, horizon)

    @rule(seq=chains, cut=st.integers(0, len(POOL)), prefix=st.booleans())
    def active_prefixes(self, seq, cut, prefix):
        self.both("active_prefixes", POOL[:cut] if prefix else seq, expect_ok=True)

    @rule(data=st.data(), seq=chains, cut=st.integers(0, len(POOL)), prefix=st.booleans())
    def project(self, data, seq, cut, prefix):
        key = data.draw(st.sampled_from(self.keys + [(99, 0)]))
        self.both("project", key, POOL[:cut] if prefix else seq, expect_ok=True)
        self.both("potential_loads", self.keys, POOL[:cut] if prefix else seq, expect_ok=True)

    @rule(seq=st.sampled_from([[-1], [1 << 64], [1.5], [None], [1, None], None, 5, "ab", [0, -1, 2]]))
    def lookups_hostile(self, seq):
        self.both("active_prefixes", seq)
        self.both("project", self.keys[0], seq)

    @invariant()
    def equal(self):
        assert snapshot(self.nat) == snapshot(self.pure)


TestTwinMachine = TwinMachine.TestCase
# (bounded: .ci/sanitize gives each module 150 s under ASan, at EXAMPLES=1000)
TestTwinMachine.settings = settings(max_examples=max(EXAMPLES // 15, 25), stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


class ManyRanksMachine(TwinMachine):
    """70 ranks: the 65th rank bit moves the native tracker to the dicts (once), and still nothing differs."""

    WORKERS = 35
    DP = 2

    @rule(count=st.sampled_from([1, 8, 63, 64, 65, 70]), blocks=TwinMachine.chains)
    def fill(self, count, blocks):
        """One request on each of ``count`` ranks (in order): many ranks quickly."""
        for key in self.keys[:count]:
            self.both("add", f"f{self.n}", key, blocks, 0, now_ns=self.now, expect_ok=True)
            self.n += 1

    @invariant()
    def native_until_a_65th_bit(self):
        if any(rl.bit >> 64 for rl in self.pure.ranks().values()):
            assert self.nat._table is None


TestManyRanksMachine = ManyRanksMachine.TestCase
TestManyRanksMachine.settings = settings(max_examples=max(EXAMPLES // 100, 10), stateful_step_count=25,
                                         deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_a_65th_rank_moves_to_the_dicts_and_dropped_bits_are_reused(native):
    nat, pure = trackers(native)
    for t in (nat, pure):
        for w in range(64):
            t.add(f"a{w}", (w, 0), [1, 2, w + 100], w)
        t.add("x", (0, 0), [1, 2, 3], 0)
    assert nat._table is not None and snapshot(nat) == snapshot(pure)
    for t in (nat, pure):  # a dropped rank's bit goes to the next new rank: still 64 bits
        assert t.drop_worker(5) == ["a5"]
        t.add("b", (70, 0), [1, 2], 0)
    assert nat._table is not None and nat.rank((70, 0)).bit == 1 << 5
    assert snapshot(nat) == snapshot(pure)
    for t in (nat, pure):
        t.add("c", (71, 0), [1, 2, 9], 4)
    assert nat._table is None and nat.rank((71, 0)).bit == 1 << 64
    assert snapshot(nat) == snapshot(pure)
    assert nat.active_prefixes([1, 2, 3]) == pure.active_prefixes([1, 2, 3])
    assert list(nat.active_prefixes([1, 2, 9])) == list(pure.active_prefixes([1, 2, 9]))
    for t in (nat, pure):
        t.free("x")
        t.drop_worker(71)
    assert snapshot(nat) == snapshot(pure)


BAD_HASHES = [[-1], [1 << 64], [1.5], [2.0], [None], ["1"], [1, None], [1, 2, -1], [(1,)], [object()],
              None, 5, 1.5, [-(1 << 100)], [10 ** 40]]


@pytest.mark.parametrize("blocks", BAD_HASHES, ids=[f"case{i}" for i in range(len(BAD_HASHES))])
def test_hostile_hashes_meet_the_same_exception_and_change_nothing(native, blocks):
    nat, pure = trackers(native)
    for t in (nat, pure):
        t.add("ok", (1, 0), [1, 2], 3)
    before = snapshot(pure)
    for key in [(1, 0), (2, 0)]:  # an existing rank, and one that would be new
        a, b = outcome(nat.add, "bad", key, blocks, 0), outcome(pure.add, "bad", key, blocks, 0)
        assert a[0] == b[0] and a[0] in ("TypeError", "OverflowError")
    assert snapshot(nat) == snapshot(pure) == before and "bad" not in nat
    for key in [(1, 0), (2, 0)]:
        a, b = outcome(nat.project, key, blocks), outcome(pure.project, key, blocks)
        assert a[0] == b[0] and a[0] in ("TypeError", "OverflowError")
    a, b = outcome(nat.active_prefixes, blocks), outcome(pure.active_prefixes, blocks)
    assert a[0] == b[0] and a[0] in ("TypeError", "OverflowError")


def test_iterables_and_index_objects_are_read_alike(native):
    class Index:
        def __index__(self) -> int:
            return 2

    nat, pure = trackers(native)
    makers = [lambda: [1, 2], lambda: (1, 2, 3), lambda: range(4), lambda: iter([5, 6]), lambda: b"\x01\x02",
              lambda: {7: 0}, lambda: [True, Index()]]
    for i, make in enumerate(makers):
        for t in (nat, pure):
            t.add(f"r{i}", (1, 0), make(), 0)
    assert snapshot(nat) == snapshot(pure)
    for seq in ([1, 2, 3], (1, 2), range(3), b"\x01\x02", [Index()]):
        assert ordered(nat.active_prefixes(seq)) == ordered(pure.active_prefixes(seq))
        assert nat.project((1, 0), seq) == pure.project((1, 0), seq)


def test_wrong_arity_is_a_type_error_in_both(native):
    nat, pure = trackers(native)
    for t in (nat, pure):
        for call, args in ((t.add, ("a", (1, 0))), (t.active_prefixes, ()), (t.project, ((1, 0),)), (t.free, ())):
            assert outcome(call, *args)[0] == "TypeError"
    table = native.HolderTable()
    for call in (lambda: table.book([1]), lambda: table.book([1], 0, 0), lambda: table.release(),
                 lambda: table.active_prefixes([1]), lambda: table.prefix_len([1]), lambda: table.check(),
                 lambda: table.block_refs(), lambda: table.masks(1), lambda: native.HolderTable(1)):
        with pytest.raises(TypeError):
            call()


def test_table_arguments_are_checked(native):
    table = native.HolderTable()
    for bad in (-1, 64, 1 << 70):
        with pytest.raises((ValueError, OverflowError)):
            table.book([1], bad)
    with pytest.raises(TypeError):
        table.book([1], 1.0)
    with pytest.raises(TypeError):
        table.active_prefixes([1], (None,))
    assert table.book([1, 2, 2], 3) == 2 and table.extra_refs(3) == {2: 1} and table.block_refs(3) == {1: 1, 2: 2}
    with pytest.raises(KeyError):
        table.release([9], 3)  # never booked
    with pytest.raises(KeyError):
        table.active_prefixes([1], [None] * 3)  # no key for the holder's index
    assert table.release([1, 2, 2], 3) == 2 and len(table) == 0 and table.masks() == {}


def test_a_large_table_grows_and_empties(native):
    """50,000 blocks on two ranks (bounded: well under a second native), booked and released in bulk."""
    nat, pure = trackers(native)
    blocks = [(i * 0x9E3779B97F4A7C15) & U64_MASK for i in range(50_000)]
    for t in (nat, pure):
        t.add("a", (1, 0), blocks, 0)
        t.add("b", (2, 0), blocks[:30_000], 0)
        t.add("c", (1, 0), blocks[:1000] + blocks[:10], 0)
    assert nat.active_prefixes(blocks) == pure.active_prefixes(blocks) == {(2, 0): 30_000, (1, 0): 50_000}
    assert nat.project((2, 0), blocks) == pure.project((2, 0), blocks)
    assert nat.rank((1, 0)).extra_refs == pure.rank((1, 0)).extra_refs
    for t in (nat, pure):
        t.free("a")
        t.free("c")
    assert snapshot(nat) == snapshot(pure)
    for t in (nat, pure):
        t.free("b")
    assert nat._holder_masks() == {} and len(nat._table) == 0


junk = st.one_of(st.sampled_from(POOL), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=True), st.none(),
                 st.text(max_size=2), st.booleans())


@settings(max_examples=max(EXAMPLES // 4, 50), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "free", "prefixes", "project"]), st.integers(0, 3),
                              st.lists(junk, max_size=6)), max_size=12))
def test_random_junk_meets_the_same_outcome(native, ops):
    nat, pure = trackers(native)
    for i, (op, rank, values) in enumerate(ops):
        if op == "add":
            calls = [(t.add, f"r{i}", (rank, 0), values, 0) for t in (nat, pure)]
        elif op == "free":
            calls = [(t.free, f"r{rank * 3}") for t in (nat, pure)]
        elif op == "prefixes":
            calls = [(t.active_prefixes, values) for t in (nat, pure)]
        else:
            calls = [(t.project, (rank, 0), values) for t in (nat, pure)]
        a, b = (outcome(*c) for c in calls)
        assert (a[0], ordered(a[1])) == (b[0], ordered(b[1]))
        assert snapshot(nat) == snapshot(pure)


_PROBE = """
from kvemu.load import LoadTracker
SELECTED = {"native": LoadTracker()._table is not None}
"""


@pytest.mark.installed_build
def test_pure_python_switch_selects_the_dicts(native):
    assert selected(NAME, _PROBE, pure=True) == {"native": False, "loaded": False}


@pytest.mark.installed_build
def test_the_built_extension_is_selected_without_the_switch(native):
    assert_built_and_selected(NAME, _PROBE)


@pytest.mark.installed_build
def test_a_c_source_edited_after_the_build_is_stale():
    assert_stale_when_edited(NAME)
