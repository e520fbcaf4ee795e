"""The native per-block maps (``kvemu._blockmap``) behind ``kvemu.index.PrefixIndex``, against the pure dicts.

Two levels. The maps alone: a native ``HashMap`` / ``SegMap`` and the pure dict subclasses of ``kvemu.blockmap``
go through the same random operations and must agree on every return value, every exception type, their
contents and (``SegMap``) the references they hold. The index: one ``PrefixIndex`` on the native maps and one on
the dicts are driven alike (stores, removals, clears, hostile hashes that move the native one to the dicts) and
must agree on every observable after each step. Iteration order is unspecified natively and compared as sets:
the index never depends on it. Skipped when the extension is not built; ``.ci/sanitize`` runs the tests not
marked ``installed_build`` against a sanitizer build (``tests.native``).
"""

from __future__ import annotations

import sys
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvemu import blockmap
from kvemu.errors import KvemuError
from kvemu.hashing import sequence_hashes
from kvemu.index import PrefixIndex
from tests.kvemu.test_index import ALL_QUERIES, PROMPTS, RANDOM_EXTS, UNKNOWN, WORKERS, exts_for
from tests.native import EXAMPLES, assert_built_and_selected, assert_stale_when_edited, load_native, selected

NAME = "kvemu._blockmap"
U64_MASK = (1 << 64) - 1
POOL = [0, 1, 2, 3, 5, 8, 13, 1 << 40, U64_MASK, U64_MASK - 1, 1 << 63, 0x9E3779B97F4A7C15]
MAP_HOSTILE = [-1, 1 << 64, -(1 << 70), 10 ** 30, 1.5, None, "1", b"x", (1,), True]
"""Keys the maps meet alike: an int outside [0, 2**64) or a non-number is never present (and never stored
natively). A float equal to an int (2.0) finds that int in a dict only: the index never hands one to the native
maps (it moves to the dicts first), so it is tested there."""
HOSTILE = MAP_HOSTILE + [2.0, 3.0]


def _module() -> ModuleType:
    return load_native(NAME)


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return _module()


def outcome(fn, *args) -> tuple[str, object]:
    """("ok", result) or (exception type name, None)."""
    try:
        return "ok", fn(*args)
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return type(exc).__name__, None


def unordered(value: object) -> object:
    """A listing compared regardless of order (iteration order is unspecified natively)."""
    if isinstance(value, (list, tuple)) or type(value).__name__ in ("dict_keys", "dict_values", "dict_items"):
        return sorted(map(repr, value))
    return value


# ---------------------------------------------------------------------- the maps alone


class MapsMachine(RuleBasedStateMachine):
    """Native HashMap and SegMap against the dict subclasses; SegMap values are tokens whose references count."""

    def __init__(self) -> None:
        super().__init__()
        module = _module()
        self.nh, self.ph = module.HashMap(), blockmap.HashMap()
        self.ns, self.ps = module.SegMap(), blockmap.SegMap()
        self.ntok = [object() for _ in range(4)]  # the native map's values; the pure one's are their twins
        self.ptok = [object() for _ in range(4)]

    keys = st.lists(st.sampled_from(POOL), max_size=8)
    any_keys = st.lists(st.one_of(st.sampled_from(POOL), st.sampled_from(MAP_HOSTILE)), max_size=5)

    def hash_both(self, name: str, *args):
        a = outcome(getattr(self.nh, name), *args)
        b = outcome(getattr(self.ph, name), *args)
        assert (a[0], unordered(a[1])) == (b[0], unordered(b[1])), (name, args)
        return a[0]

    def seg_both(self, name: str, *args, token: int | None = None):
        nargs = args + ((self.ntok[token],) if token is not None else ())
        pargs = args + ((self.ptok[token],) if token is not None else ())
        a = outcome(getattr(self.ns, name), *nargs)
        b = outcome(getattr(self.ps, name), *pargs)
        assert a[0] == b[0], (name, args, a, b)
        assert self.twin(a[1]) == b[1] or (isinstance(b[1], list) and unordered(self.twin(a[1])) == unordered(b[1]))
        return a[0]

    def twin(self, value: object) -> object:
        """A native result with each native token replaced by its pure twin."""
        if isinstance(value, list):
            return [self.twin(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.twin(v) for v in value)
        for n, p in zip(self.ntok, self.ptok):
            if value is n:
                return p
        return value

    @rule(keys=keys, values=keys)
    def update_pairs(self, keys, values):
        self.hash_both("update_pairs", keys, values[: len(keys)] if len(values) >= len(keys) else values)

    @rule(keys=keys)
    def update_pairs_same(self, keys):
        assert self.hash_both("update_pairs", keys, list(reversed(keys))) == "ok"

    @rule(key=st.sampled_from(POOL), value=st.sampled_from(POOL))
    def setitem(self, key, value):
        self.nh[key] = value
        self.ph[key] = value

    @rule(keys=any_keys)
    def lookups(self, keys):
        self.hash_both("get_many", keys)
        self.hash_both("isdisjoint", keys)
        self.seg_both("get_many", keys)
        for key in keys:
            self.hash_both("get", key)
            self.hash_both("get", key, -7)
            self.hash_both("__getitem__", key)
            self.hash_both("__contains__", key)
            self.seg_both("get", key)
            self.seg_both("__getitem__", key)
            self.seg_both("__contains__", key)

    @rule(keys=any_keys)
    def delete_many(self, keys):
        self.hash_both("delete_many", keys)
        self.seg_both("delete_many", keys)

    @rule(data=st.data())
    def delete_held(self, data):
        held = sorted(self.ph)
        if held:
            self.hash_both("delete_many", data.draw(st.lists(st.sampled_from(held), max_size=4, unique=True)))
        held = sorted(self.ps)
        if held:
            keys = data.draw(st.lists(st.sampled_from(held), max_size=4, unique=True))
            self.seg_both("delete_many", keys)

    @rule(key=st.one_of(st.sampled_from(POOL), st.sampled_from(MAP_HOSTILE)))
    def delitem(self, key):
        self.hash_both("__delitem__", key)
        self.seg_both("__delitem__", key)

    @rule(keys=any_keys)
    def discard_many(self, keys):
        self.seg_both("discard_many", keys)

    @rule(keys=keys, token=st.integers(0, 3))
    def set_many(self, keys, token):
        self.seg_both("set_many", keys, token=token)

    @rule(key=st.sampled_from(POOL), token=st.integers(0, 3))
    def seg_setitem(self, key, token):
        self.seg_both("__setitem__", key, token=token)

    @precondition(lambda self: len(self.ph) > 6)
    @rule()
    def clear(self):
        self.hash_both("clear")
        self.seg_both("clear")

    @invariant()
    def equal(self):
        assert len(self.nh) == len(self.ph) and len(self.ns) == len(self.ps)
        assert sorted(self.nh.items()) == sorted(self.ph.items())
        assert sorted(self.nh.keys()) == sorted(self.ph.keys())
        assert sorted(self.nh.values()) == sorted(self.ph.values())
        assert sorted(self.ns.keys()) == sorted(self.ps.keys())
        assert sorted((k, self.ntok.index(v)) for k, v in self.ns.items()) == sorted(
            (k, self.ptok.index(v)) for k, v in self.ps.items())
        assert [self.twin(v) for v in self.ns.values()].count(self.ptok[0]) == list(self.ps.values()).count(
            self.ptok[0])
        for n, p in zip(self.ntok, self.ptok):
            assert sys.getrefcount(n) == sys.getrefcount(p)  # one reference per entry, no leak


TestMapsMachine = MapsMachine.TestCase
TestMapsMachine.settings = settings(max_examples=max(EXAMPLES // 10, 25), stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("bad", MAP_HOSTILE[:-1] + [2.0])
def test_hostile_keys_are_never_stored(native, bad):
    nh, ph = native.HashMap(), blockmap.HashMap()
    for m in (nh, ph):
        m.update_pairs([1, 2], [3, 4])
    kind = "TypeError" if not isinstance(bad, int) else "OverflowError"
    assert outcome(nh.update_pairs, [5, bad], [6, 7])[0] == kind
    assert outcome(nh.update_pairs, [5, 6], [7, bad])[0] == kind
    assert outcome(nh.__setitem__, bad, 1)[0] == kind
    assert outcome(native.SegMap().set_many, [1, bad], object())[0] == kind
    assert sorted(nh.items()) == [(1, 3), (2, 4)]  # nothing changed
    for call in ("get", "__contains__"):
        assert outcome(getattr(nh, call), bad) == outcome(getattr(ph, call), bad) or bad == 2.0  # (see MAP_HOSTILE)
    assert native.all_u64([1, bad]) is False is blockmap.all_u64_py([1, bad])


def test_all_u64_agrees(native):
    for items in ([], [0, U64_MASK], [True], [1, -1], [1 << 64], [1.0], [None], [2**63]):
        assert native.all_u64(items) == blockmap.all_u64_py(items), items
    for bad in ((1, 2), None, 5, "ab"):
        assert outcome(native.all_u64, bad)[0] == "TypeError"


@settings(max_examples=max(EXAMPLES // 2, 50), deadline=None)
@given(items=st.one_of(*(st.lists(st.one_of(st.sampled_from(POOL), st.integers(0, 80), st.sampled_from(MAP_HOSTILE + [2.0])),
                                  min_size=lo, max_size=hi) for lo, hi in ((0, 16), (17, 70)))),
       extra=st.one_of(st.none(), st.sampled_from(POOL), st.integers(0, 40), st.sampled_from(MAP_HOSTILE + [2.0])))
def test_distinct_u64_agrees(native, items, extra):
    """A store's chain check: None for a value the native maps cannot hold, else whether the chain and its parent
    are pairwise distinct; pairwise up to 16 values, through a table beyond (lists of up to 70)."""
    assert native.distinct_u64(items, extra) is blockmap.distinct_u64_py(items, extra)


def test_distinct_u64_finds_a_repeat_anywhere_in_long_chains(native):
    chain = [i * 0x9E3779B97F4A7C15 & U64_MASK for i in range(1, 5_000)]
    assert native.distinct_u64(chain, None) is True and native.distinct_u64(chain, 0) is True
    for at in (0, 17, 4_998):
        assert native.distinct_u64(chain + [chain[at]], None) is False
        assert native.distinct_u64(chain, chain[at]) is False
    assert native.distinct_u64([], None) is True and native.distinct_u64([], 1 << 64) is None
    assert native.distinct_u64(chain + [-1], None) is None and native.distinct_u64(chain + [True], None) is None
    for bad in ((1, 2), None, 5, iter([1])):
        assert outcome(native.distinct_u64, bad, None)[0] == "TypeError"
    for args in ((), ([1],), ([1], None, None)):
        assert outcome(native.distinct_u64, *args)[0] == "TypeError"


def test_arguments_are_checked(native):
    nh, ns = native.HashMap(), native.SegMap()
    for call in (lambda: nh.get(), lambda: nh.get(1, 2, 3), lambda: nh.update_pairs([1]), lambda: ns.set_many([1]),
                 lambda: nh.get_many((1, 2)), lambda: nh.delete_many(iter([1])), lambda: ns.discard_many(None),
                 lambda: nh.isdisjoint({1}), lambda: nh.update_pairs((1,), (2,)), lambda: native.HashMap(1),
                 lambda: native.SegMap(x=1)):
        with pytest.raises(TypeError):
            call()
    with pytest.raises(ValueError):
        nh.update_pairs([1, 2], [3])
    assert outcome(blockmap.HashMap().update_pairs, [1, 2], [3])[0] == "ValueError"


def test_a_large_map_grows_and_empties(native):
    """200,000 keys in bulk, most removed again, then all (tombstones dropped on rebuild)."""
    nh, ns, tok = native.HashMap(), native.SegMap(), object()
    keys = [(i * 0x9E3779B97F4A7C15) & U64_MASK for i in range(200_000)]
    before = sys.getrefcount(tok)
    nh.update_pairs(keys, list(range(200_000)))
    ns.set_many(keys, tok)
    assert len(nh) == len(ns) == 200_000 and sys.getrefcount(tok) == before + 200_000
    assert nh.get_many(keys[::1000]) == list(range(0, 200_000, 1000))
    nh.delete_many(keys[:150_000])
    ns.delete_many(keys[:150_000])
    assert len(nh) == 50_000 and nh.isdisjoint(keys[:150_000]) and not nh.isdisjoint(keys[-1:])
    for i in range(3):  # churn: stores and removals of fresh keys reuse the tombstones
        fresh = [k ^ (i + 1) << 62 for k in keys[:100_000]]
        nh.update_pairs(fresh, fresh)
        nh.delete_many(fresh)
    assert len(nh) == 50_000 and nh.get_many(keys[150_000:150_003]) == [150_000, 150_001, 150_002]
    ns.discard_many(keys)
    nh.clear()
    assert len(nh) == len(ns) == 0 and sys.getrefcount(tok) == before


def test_segmap_references_are_released_and_collected(native):
    import gc
    import weakref

    class Seg:
        pass

    seg = Seg()
    ref = weakref.ref(seg)
    m = native.SegMap()
    m.set_many([1, 2, 3], seg)
    seg.owner = m  # a cycle through the map: the collector must see it
    del seg, m
    gc.collect()
    assert ref() is None


# ---------------------------------------------------------------------- the index on either maps


def twin_indexes(module: ModuleType) -> tuple[PrefixIndex, PrefixIndex]:
    """(native-maps, dict) indexes, both fresh."""
    nat = PrefixIndex()
    nat._use_maps(module)
    pure = PrefixIndex()
    pure._use_maps(None)
    return nat, pure


def index_snapshot(idx: PrefixIndex) -> dict:
    """Every observable of an index (find_matches for every known query, early exit too)."""
    matches = [(q, sorted(idx.find_matches(list(q)).items()), sorted(idx.find_matches(list(q), True).items()))
               for q in ALL_QUERIES]
    sizes = [(w, r, idx.tree_size(w, r)) for w in WORKERS + (9,) for r in (0, 1)]
    paths = []
    for q in ALL_QUERIES:
        depth = max(idx.find_matches(list(q)).values(), default=0)
        paths.append(idx.path_sequence_hashes(list(q), depth))
    return {"dump": idx.dump(), "matches": matches, "sizes": sizes, "size": idx.current_size,
            "blocks": idx.num_blocks, "ranks": idx.ranks(), "paths": paths}


def attempt(fn, *args, **kwargs) -> tuple[str, str]:
    try:
        fn(*args, **kwargs)
    except (KvemuError, TypeError, OverflowError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


class IndexTwins(RuleBasedStateMachine):
    """A PrefixIndex on the native maps and one on the dicts, driven alike, equal after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.nat, self.pure = twin_indexes(_module())
        self.held: dict[tuple[int, int], set] = {}

    keys = st.tuples(st.sampled_from(WORKERS), st.sampled_from((0, 1)))

    def both(self, name: str, *args, **kwargs) -> str:
        a = attempt(getattr(self.nat, name), *args, **kwargs)
        b = attempt(getattr(self.pure, name), *args, **kwargs)
        assert a == b, (name, args, kwargs)
        return a[0]

    def store(self, key, parent, locs, exts, hashed=False):
        if self.both("store", key[0], locs, exts, parent_hash=parent, dp_rank=key[1], sequence_hashed=hashed) == "ok":
            self.held.setdefault(key, set()).update(exts)

    @rule(key=keys, prompt=st.sampled_from(PROMPTS), data=st.data(),
          mode=st.sampled_from(["engine", "engine", "salted", "hashed"]))
    def store_chain(self, key, prompt, data, mode):
        n = len(prompt)
        start = data.draw(st.one_of(st.just(0), st.integers(0, n - 1)), label="start")
        end = data.draw(st.integers(start, n), label="end")
        exts = exts_for(prompt, "salted" if mode == "salted" else "engine", key[0])
        parent = exts[start - 1] if start else None
        if start and data.draw(st.booleans(), label="bogus parent"):
            parent = data.draw(st.sampled_from(UNKNOWN + RANDOM_EXTS[:3]), label="parent")
        self.store(key, parent, list(prompt[start:end]), exts[start:end], hashed=mode == "hashed")

    @rule(key=keys, prompt=st.sampled_from(PROMPTS), data=st.data())
    def store_random_exts(self, key, prompt, data):
        n = len(prompt)
        start = data.draw(st.integers(0, n - 1), label="start")
        end = data.draw(st.integers(start, n), label="end")
        exts = data.draw(st.lists(st.sampled_from(RANDOM_EXTS), min_size=end - start, max_size=end - start))
        parent = None
        if start:
            parent = data.draw(st.sampled_from(sorted(self.held.get(key, set()), key=repr) + list(RANDOM_EXTS[:2])))
        self.store(key, parent, list(prompt[start:end]), exts)

    @rule(key=keys, prompt=st.sampled_from(PROMPTS), data=st.data(), bad=st.sampled_from(HOSTILE))
    def store_hostile(self, key, prompt, data, bad):
        """A hash the native maps cannot hold: the native index moves to the dicts, nothing observable differs."""
        exts = exts_for(prompt, "engine", key[0])
        i = data.draw(st.integers(0, len(prompt) - 1))
        exts[i] = bad
        where = data.draw(st.sampled_from(["block", "parent"]))
        if where == "parent":
            self.store(key, bad, list(prompt), exts_for(prompt, "engine", key[0]))
        else:
            self.store(key, None, list(prompt), exts)

    @rule(key=keys, data=st.data())
    def remove(self, key, data):
        pool = sorted(self.held.get(key, set()), key=repr) + list(UNKNOWN) + list(RANDOM_EXTS[:2])
        hashes = data.draw(st.lists(st.sampled_from(pool), max_size=5), label="hashes")
        self.both("remove", key[0], hashes, dp_rank=key[1])

    @rule(key=keys, bad=st.lists(st.sampled_from(HOSTILE), min_size=1, max_size=2))
    def remove_hostile(self, key, bad):
        self.both("remove", key[0], bad, dp_rank=key[1])

    @rule(key=keys, block=st.one_of(st.sampled_from(HOSTILE), st.sampled_from(RANDOM_EXTS)))
    def holds(self, key, block):
        """(The compiled build refuses a non-int argument with TypeError, in both.)"""
        assert outcome(self.nat.holds, key[0], block, key[1]) == outcome(self.pure.holds, key[0], block, key[1])

    @rule(key=keys)
    def clear(self, key):
        self.both("clear", *key)

    @rule(worker=st.sampled_from(WORKERS))
    def clear_all_blocks(self, worker):
        self.both("clear_all_blocks", worker)

    @rule(worker=st.sampled_from(WORKERS))
    def remove_worker(self, worker):
        self.both("remove_worker", worker)

    @invariant()
    def equal(self):
        # (check_invariants' typed loops refuse a float hash in the compiled build: in both, as before)
        assert attempt(self.nat.check_invariants) == attempt(self.pure.check_invariants)
        assert outcome(index_snapshot, self.nat) == outcome(index_snapshot, self.pure)
        for key, exts in self.held.items():
            for ext in exts:
                assert outcome(self.nat.holds, key[0], ext, key[1]) == outcome(self.pure.holds, key[0], ext, key[1])


TestIndexTwins = IndexTwins.TestCase
# (bounded: .ci/sanitize gives each module 150 s under ASan)
TestIndexTwins.settings = settings(max_examples=max(EXAMPLES // 10, 25), stateful_step_count=30, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


def test_a_hostile_hash_moves_the_index_to_the_dicts_once(native):
    nat, pure = twin_indexes(native)
    locs = [1, 2, 3]
    seqs = sequence_hashes(locs)
    for idx in (nat, pure):
        idx.store(1, locs, seqs)
    assert nat._maps is native
    for idx in (nat, pure):
        idx.store(2, locs, [-1, 5, 1 << 64])  # an engine with odd hashes: the reference keeps them
    assert nat._maps is None and type(nat._blocks) is blockmap.SegMap
    assert index_snapshot(nat) == index_snapshot(pure)
    for idx in (nat, pure):
        idx.remove(2, [5])
    assert index_snapshot(nat) == index_snapshot(pure) and nat.holds(2, -1) and not nat.holds(2, 5)
    nat.check_invariants()


@settings(max_examples=max(EXAMPLES // 4, 50), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]), st.integers(0, 2),
                              st.lists(st.one_of(st.integers(0, 6), st.sampled_from(HOSTILE)), max_size=6),
                              st.one_of(st.none(), st.integers(0, 6), st.sampled_from(HOSTILE))), max_size=12))
def test_random_junk_meets_the_same_outcome(native, ops):
    nat, pure = twin_indexes(native)
    for op, worker, hashes, parent in ops:
        locs = [h if isinstance(h, int) and 0 <= h < 7 else 1 for h in hashes]
        outcomes = []
        for idx in (nat, pure):
            if op == "store":
                outcomes.append(attempt(idx.store, worker, locs, list(hashes), parent_hash=parent))
            elif op == "remove":
                outcomes.append(attempt(idx.remove, worker, list(hashes)))
            else:
                outcomes.append(attempt(idx.clear, worker))
        assert outcomes[0] == outcomes[1]
        assert attempt(nat.check_invariants) == attempt(pure.check_invariants)
        assert outcome(index_snapshot, nat) == outcome(index_snapshot, pure)


_PROBE = """
from kvemu.index import PrefixIndex
SELECTED = {"native": PrefixIndex()._maps is not None}
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
