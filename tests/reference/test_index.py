"""Differential tests against the real reference: the ``ai-dynamo-runtime==1.6.1`` Python binding.

Hashing: ``kvemu.hashing.local_block_hashes`` must equal ``dynamo._core.compute_block_hash_for_seq`` for
random tokens, block sizes, LoRA names, cache namespaces, multimodal objects and eagle mode.

Index: the same random KV-event streams go into ``dynamo._core.RadixTree`` (as JSON ``KvCacheEvent``s),
into ``kvemu.index.PrefixIndex`` and into the simple ``ModelIndex``; after every step all three must give
identical overlap scores, and an event must fail in all of them or in none (with the same error kind).

Known divergences of 1.6.1, which the random streams deliberately avoid (each is pinned by a
``test_divergence_*`` test below so that a change in either implementation is noticed):

* **No cascade after a one-block shared prefix.** 1.6.1 does not always drop a rank from the
  descendants of a block it removes: when the rank's chain diverges from another rank's chain right
  after a single shared block, removing that shared block leaves the rank's child run orphaned, and
  re-storing the removed block makes the binding credit the whole old chain again. Example: worker 1
  stores locals 0..8 (external 100..108), worker 2 stores [0, 77] (external 100, 500), worker 1 removes
  [100] and re-stores [(100, 0)]: the binding scores worker 1 at depth 9, the spec (§3.3) and kvemu at 1.
  Engines evict leaf-first (a block is only evicted once nothing cached depends on it), so the streams
  here only remove blocks of a rank that have no descendant held by that rank (the ModelIndex tells
  which), or a block together with all of the rank's blocks below it in one event (which also ends
  equal); arbitrary removal orders are covered against the ModelIndex in ``tests/kvemu/test_index.py``.
* **Repeated external hash within one stored event.** 1.6.1 accepts it (the later block wins the name);
  kvemu rejects the event with ``InvalidBlockSequence`` (as Dynamo's ZMQ converter drops such events).
* **Re-storing a held block under a new external hash.** 1.6.1 keeps the first name; kvemu (and the
  ModelIndex) rename the block to the new hash.
* **Different workers naming the same prefix differently** breaks 1.6.1's parent lookups (spec §1.4),
  so the streams use engine-like external hashes: the rolling sequence hash of the prompt prefix, equal
  for equal prefixes on every worker.
* **Order of the store checks.** 1.6.1 rejects a store whose parent hash reappears among its blocks as
  ``InvalidBlockSequence`` even when the rank does not hold that parent; kvemu (and the ModelIndex) look
  the parent up first and report ``ParentBlockNotFound``. Both reject the event; only the kind differs,
  and the streams accept either kind for exactly that case.
* ``early_exit=True`` scores differ by design (1.6.1 stops per block, kvemu at the end of a run) and are
  not compared.
"""

import json
import random
from collections import Counter

import pytest

from kvemu.errors import BlockNotFound, InvalidArgument, InvalidBlockSequence, ParentBlockNotFound
from kvemu.hashing import local_block_hashes, mm_hash_from_identifier, sequence_hashes
from kvemu.index import PrefixIndex
from tests.index_model import ModelIndex

pytestmark = pytest.mark.reference

# Bound from the ``dynamo_core`` fixture (tests/conftest.py) before the first test of this module runs:
# without the binding every test skips, or fails under KVEMU_REQUIRE_REFERENCE=1.
RadixTree = compute_block_hash_for_seq = None


@pytest.fixture(scope="module", autouse=True)
def _reference_binding(dynamo_core):
    global RadixTree, compute_block_hash_for_seq
    RadixTree = dynamo_core.RadixTree
    compute_block_hash_for_seq = dynamo_core.compute_block_hash_for_seq

ERRORS = (ParentBlockNotFound, BlockNotFound, InvalidBlockSequence)


# --------------------------------------------------------------------------- hashing


def _random_tokens(rng, n):
    edge = (0, 1, 2**32 - 1, 2**31, 2**16)
    return [rng.choice(edge) if rng.random() < 0.05 else rng.getrandbits(32) for _ in range(n)]


@pytest.mark.parametrize("bs", [1, 2, 3, 4, 16, 32, 64, 128])
@pytest.mark.parametrize(
    "lora,ns",
    [(None, None), ("", ""), ("my-lora", None), (None, "tenant-a"), ("my-lora", "tenant-a"), ("ü-lora ☃", ""),
     ("", "ns/with spaces")],
)
def test_local_hashes_match_reference(bs, lora, ns):
    rng = random.Random(f"{bs}-{lora}-{ns}")
    for _ in range(20):
        tokens = _random_tokens(rng, rng.randint(0, 5 * bs + 3))
        expected = compute_block_hash_for_seq(tokens, bs, lora_name=lora, cache_namespace=ns)
        assert local_block_hashes(tokens, bs, lora_name=lora, cache_namespace=ns) == expected
        assert len(expected) == len(tokens) // bs


@pytest.mark.parametrize("bs", [1, 2, 4, 16, 64])
def test_eagle_hashes_match_reference(bs):
    rng = random.Random(bs)
    for _ in range(20):
        tokens = _random_tokens(rng, rng.randint(0, 5 * bs + 3))
        lora = rng.choice([None, "my-lora"])
        expected = compute_block_hash_for_seq(tokens, bs, is_eagle=True, lora_name=lora)
        assert local_block_hashes(tokens, bs, eagle=True, lora_name=lora) == expected
        assert len(expected) == max(0, (len(tokens) - 1) // bs)


@pytest.mark.parametrize("bs", [1, 4, 16, 64])
@pytest.mark.parametrize("eagle", [False, True])
def test_multimodal_hashes_match_reference(bs, eagle):
    rng = random.Random(f"mm-{bs}-{eagle}")
    for _ in range(20):
        tokens = _random_tokens(rng, rng.randint(bs + 1, 6 * bs + 1))
        n = (len(tokens) - 1) // bs if eagle else len(tokens) // bs
        infos, mm = [], {}
        for i in range(n):
            if rng.random() < 0.4:
                hashes = [rng.getrandbits(64) for _ in range(rng.randint(1, 3))]
                if rng.random() < 0.2:
                    hashes.append(mm_hash_from_identifier(rng.choice(["img-1", "f" * 64, "0123456789abcdef" * 4])))
                infos.append({"mm_objects": [{"mm_hash": h, "offsets": [[0, 1]]} for h in hashes]})
                mm[i] = hashes
            else:
                infos.append(None)
        ns = rng.choice([None, "tenant-a"])
        expected = compute_block_hash_for_seq(
            tokens, bs, block_mm_infos=infos, is_eagle=eagle or None, cache_namespace=ns
        )
        assert local_block_hashes(tokens, bs, block_mm_hashes=mm, eagle=eagle, cache_namespace=ns) == expected


def test_invalid_tokens_rejected_by_both():
    for tokens in ([1, 2, 3, 4, -1], [2**32], [1, 2, 3, 4, 5, 6, 7, 2**32]):
        with pytest.raises(OverflowError):
            compute_block_hash_for_seq(tokens, 4)
        with pytest.raises(InvalidArgument):
            local_block_hashes(tokens, 4)


# --------------------------------------------------------------------------- index: event plumbing


class Reference:
    """RadixTree fed with JSON KvCacheEvents; errors are mapped to kvemu's error names."""

    def __init__(self):
        self.tree = RadixTree()
        self.event_id = 0

    def _apply(self, worker, data, rank):
        self.event_id += 1
        payload = json.dumps({"event_id": self.event_id, "data": data, "dp_rank": rank}).encode()
        try:
            self.tree.apply_event(worker, payload)
        except RuntimeError as exc:
            msg = str(exc)
            if "parent block" in msg:
                return "ParentBlockNotFound"
            if "Failed to find block" in msg:
                return "BlockNotFound"
            if "Invalid block sequence" in msg:
                return "InvalidBlockSequence"
            raise AssertionError(f"unexpected reference error: {msg}") from None
        return None

    def store(self, key, parent, locs, exts):
        blocks = [{"block_hash": e, "tokens_hash": t} for e, t in zip(exts, locs)]
        return self._apply(key[0], {"stored": {"parent_hash": parent, "blocks": blocks}}, key[1])

    def remove(self, key, exts):
        return self._apply(key[0], {"removed": {"block_hashes": list(exts)}}, key[1])

    def clear(self, key):
        return self._apply(key[0], "cleared", key[1])

    def clear_all_blocks(self, worker):
        self.tree.clear_all_blocks(worker)

    def remove_worker(self, worker):
        self.tree.remove_worker(worker)

    def find_matches(self, locs):
        return dict(self.tree.find_matches(list(locs)).scores)

    def sizes(self):
        """Blocks per (worker, rank) according to the reference's own dump."""
        out = Counter()
        for line in self.tree.dump_tree_as_events():
            ev = json.loads(line)
            out[(ev["worker_id"], ev["event"]["dp_rank"])] += len(ev["event"]["data"]["stored"]["blocks"])
        return out


def _kvemu_call(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except ERRORS as exc:
        return type(exc).__name__
    return None


class Trio:
    """Applies every event to the reference, kvemu and the model, asserting the same outcome."""

    def __init__(self):
        self.ref = Reference()
        self.idx = PrefixIndex()
        self.model = ModelIndex()
        self.outcomes = Counter()

    def store(self, key, parent, locs, exts):
        ref = self.ref.store(key, parent, locs, exts)
        got = _kvemu_call(self.idx.store, key[0], locs, exts, parent_hash=parent, dp_rank=key[1])
        model = self.model.store(key, parent, locs, exts)
        if parent in exts and (ref, got) == ("InvalidBlockSequence", "ParentBlockNotFound"):
            ref = got  # order of checks differs (see the module docstring); both reject the event
        assert got == ref == model, ("store", key, parent, locs, exts, got, ref, model)
        self.outcomes[f"store {ref}"] += 1

    def remove(self, key, exts):
        ref = self.ref.remove(key, exts)
        got = _kvemu_call(self.idx.remove, key[0], exts, dp_rank=key[1])
        model = self.model.remove(key, exts)
        assert got == ref == model, ("remove", key, exts, got, ref, model)
        self.outcomes[f"remove {ref}"] += 1

    def clear(self, key):
        assert self.ref.clear(key) is None
        self.idx.clear(*key)
        self.model.clear(key)

    def clear_all_blocks(self, worker):
        self.ref.clear_all_blocks(worker)
        self.idx.clear_all_blocks(worker)
        self.model.clear_all_blocks(worker)

    def remove_worker(self, worker):
        self.ref.remove_worker(worker)
        self.idx.remove_worker(worker)
        self.model.remove_worker(worker)

    def check(self, queries):
        for q in queries:
            ref = self.ref.find_matches(q)
            assert self.idx.find_matches(list(q)) == ref, q
            assert self.model.find_matches(q) == ref, q
            if ref:
                self.outcomes["nonzero match"] += 1

    def check_sizes(self):
        ref = self.ref.sizes()
        for key in set(ref) | set(self.idx.ranks()):
            assert self.idx.tree_size(*key) == ref.get(key, 0), key
        assert self.idx.current_size == sum(ref.values())
        self.idx.check_invariants()


# --------------------------------------------------------------------------- index: targeted cases


def test_reference_scores_are_keyed_by_worker_and_rank():
    trio = Trio()
    locs = [5, 6, 7]
    ex = sequence_hashes(locs)
    trio.store((1, 0), None, locs, ex)
    trio.store((1, 1), None, locs[:2], ex[:2])
    trio.store((2, 0), None, locs[:1], ex[:1])
    trio.check([locs, locs[:1], [6]])
    assert trio.ref.find_matches(locs) == {(1, 0): 3, (1, 1): 2, (2, 0): 1}


def test_reference_removal_errors_after_batch_and_cascades():
    trio = Trio()
    locs = [1, 2, 3, 4]
    ex = sequence_hashes(locs)
    trio.store((1, 0), None, locs, ex)
    trio.store((2, 0), None, locs[:3], ex[:3])
    trio.remove((1, 0), [ex[3], 12345, ex[2]])  # leaf-first, with an unknown hash in between
    assert trio.outcomes["remove BlockNotFound"] == 1
    trio.check([locs])
    assert trio.ref.find_matches(locs) == {(1, 0): 2, (2, 0): 3}
    trio.remove((1, 0), [ex[2]])  # already gone
    trio.store((1, 0), ex[3], [9], [99])  # parent gone
    trio.store((1, 0), ex[0], [1], [ex[0]])  # parent repeated as a block
    trio.remove((3, 0), [ex[0]])  # unknown worker
    trio.check([locs, [1, 9]])
    assert trio.outcomes["store ParentBlockNotFound"] == 1
    assert trio.outcomes["store InvalidBlockSequence"] == 1
    assert trio.outcomes["remove BlockNotFound"] == 3
    trio.check_sizes()


def test_reference_cascaded_block_named_again_in_same_event():
    trio = Trio()
    locs = [1, 2, 3]
    ex = sequence_hashes(locs)
    trio.store((1, 0), None, locs, ex)
    trio.remove((1, 0), [ex[0], ex[1]])  # ex[1] went with the cascade of ex[0]: not an error
    assert trio.outcomes["remove None"] == 1
    trio.check([locs])
    trio.store((1, 0), None, locs, ex)
    trio.remove((1, 0), [ex[1]])
    trio.remove((1, 0), [ex[2]])  # cascaded by an earlier event: an error
    assert trio.outcomes["remove BlockNotFound"] == 1
    trio.check([locs])
    trio.check_sizes()


def test_reference_repeated_local_hashes():
    trio = Trio()
    trio.store((1, 0), None, [7, 7, 7], sequence_hashes([7, 7, 7]))
    trio.check([[7], [7, 7, 7, 7], [7, 8]])
    assert trio.ref.find_matches([7, 7, 7, 7]) == {(1, 0): 3}


def test_reference_clear_is_per_rank():
    trio = Trio()
    ex = sequence_hashes([1, 2])
    for key in [(1, 0), (1, 1), (2, 0)]:
        trio.store(key, None, [1, 2], ex)
    trio.clear((1, 1))
    trio.check([[1, 2]])
    assert trio.ref.find_matches([1, 2]) == {(1, 0): 2, (2, 0): 2}
    trio.clear_all_blocks(1)
    trio.check([[1, 2]])
    trio.store((1, 1), ex[0], [2], ex[1:])  # parent gone with the clear
    trio.store((1, 1), None, [1], ex[:1])
    trio.remove_worker(2)
    trio.check([[1, 2]])
    assert trio.ref.find_matches([1, 2]) == {(1, 1): 1}
    trio.check_sizes()


# --------------------------------------------------------------------------- index: pinned divergences


def test_divergence_no_cascade_after_one_shared_block():
    ref, idx = Reference(), PrefixIndex()
    assert ref.store((1, 0), None, list(range(9)), list(range(100, 109))) is None
    assert ref.store((2, 0), None, [0, 77], [100, 500]) is None
    assert ref.remove((1, 0), [100]) is None
    assert ref.store((1, 0), None, [0], [100]) is None
    idx.store(1, list(range(9)), list(range(100, 109)))
    idx.store(2, [0, 77], [100, 500])
    idx.remove(1, [100])
    idx.store(1, [0], [100])
    assert ref.find_matches(list(range(9))) == {(1, 0): 9, (2, 0): 1}  # 1.6.1: the orphan run is credited
    assert idx.find_matches(list(range(9))) == {(1, 0): 1, (2, 0): 1}  # spec §3.3


def test_divergence_repeated_external_hash_in_one_event():
    ref, idx = Reference(), PrefixIndex()
    assert ref.store((1, 0), None, [1, 2], [10, 10]) is None
    assert ref.find_matches([1, 2]) == {(1, 0): 2}
    with pytest.raises(InvalidBlockSequence):
        idx.store(1, [1, 2], [10, 10])
    assert idx.find_matches([1, 2]) == {}


def test_divergence_restore_under_new_external_hash():
    ref, idx = Reference(), PrefixIndex()
    assert ref.store((1, 0), None, [1], [10]) is None
    assert ref.store((1, 0), None, [1], [15]) is None
    idx.store(1, [1], [10])
    idx.store(1, [1], [15])
    assert ref.remove((1, 0), [15]) == "BlockNotFound"  # 1.6.1 kept the first name
    with pytest.raises(BlockNotFound):
        idx.remove(1, [10])  # kvemu renamed the block
    assert ref.find_matches([1]) == idx.find_matches([1]) == {(1, 0): 1}


def test_divergence_self_referencing_store_under_unknown_parent():
    ref, idx = Reference(), PrefixIndex()
    assert ref.store((1, 0), 10, [1, 2], [10, 11]) == "InvalidBlockSequence"
    with pytest.raises(ParentBlockNotFound):
        idx.store(1, [1, 2], [10, 11], parent_hash=10)
    # with the parent held, both call it an invalid sequence
    assert ref.store((1, 0), None, [1], [10]) is None
    idx.store(1, [1], [10])
    assert ref.store((1, 0), 10, [2, 3], [11, 10]) == "InvalidBlockSequence"
    with pytest.raises(InvalidBlockSequence):
        idx.store(1, [2, 3], [11, 10], parent_hash=10)
    assert ref.find_matches([1, 2, 3]) == idx.find_matches([1, 2, 3]) == {(1, 0): 1}


# --------------------------------------------------------------------------- index: random streams

WORKERS = (1, 2, 3)
RANKS = (0, 1)


def _prompts(rng):
    """Prompts that share prefixes of every length with each other, over a tiny alphabet."""
    prompts = [[rng.randint(1, 4) for _ in range(rng.randint(1, 10))]]
    while len(prompts) < 7:
        base = rng.choice(prompts)
        cut = rng.randint(0, len(base))
        prompts.append(base[:cut] + [rng.randint(1, 4) for _ in range(rng.randint(1, 8))])
    return prompts


def _leaf_first_removal(rng, model, key):
    """External hashes of blocks the rank holds, each without a held descendant when it is removed."""
    lk = model.lookup.get(key, {})
    held = {path: ext for ext, path in lk.items()}
    out = []
    for _ in range(rng.randint(1, 4)):
        leaves = [p for p in held if not any(len(q) > len(p) and q[: len(p)] == p for q in held)]
        if not leaves:
            break
        leaf = rng.choice(sorted(leaves))
        out.append(held.pop(leaf))
    return out


def _subtree_removal(rng, model, key):
    """A held block of the rank first, then all the rank's blocks below it (in any order), in one event."""
    lk = model.lookup.get(key, {})
    if not lk:
        return []
    top = rng.choice(sorted(lk.values()))
    below = [e for e, p in lk.items() if len(p) > len(top) and p[: len(top)] == top]
    rng.shuffle(below)
    return [next(e for e, p in lk.items() if p == top)] + below


def _run_stream(seed, steps):
    rng = random.Random(seed)
    prompts = _prompts(rng)
    queries = [tuple(p) for p in prompts]
    queries += [tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 8))) for _ in range(4)]
    trio = Trio()
    for step in range(steps):
        if step % 50 == 0:
            trio.check_sizes()
        key = (rng.choice(WORKERS), rng.choice(RANKS))
        holders = sorted(k for k, lk in trio.model.lookup.items() if lk)
        op = rng.random()
        if op < 0.50:  # store a chain of a prompt from an arbitrary offset, under its engine-like parent
            p = rng.choice(prompts)
            ex = sequence_hashes(p)
            held = [i + 1 for i, e in enumerate(ex[:-1]) if e in trio.model.lookup.get(key, {})]
            r = rng.random()
            if r < 0.4:
                start = 0
            elif r < 0.7 and held:
                start = rng.choice(held)  # continue a prefix the rank holds
            else:
                start = rng.randrange(len(p))
            end = rng.randint(start, len(p))
            parent = ex[start - 1] if start else None
            if rng.random() < 0.05:
                parent = rng.getrandbits(64)  # unknown parent
            trio.store(key, parent, p[start:end], ex[start:end])
        elif op < 0.53:  # a store naming its own parent again
            p = rng.choice(prompts)
            ex = sequence_hashes(p)
            start = rng.randrange(len(p))
            trio.store(key, ex[start], p[start : start + 2], ex[start : start + 2])
        elif op < 0.82:  # leaf-first eviction, sometimes with an unknown hash mixed in
            if holders and rng.random() < 0.85:
                key = rng.choice(holders)
            hashes = _leaf_first_removal(rng, trio.model, key)
            if not hashes or rng.random() < 0.1:
                hashes.insert(rng.randint(0, len(hashes)), rng.getrandbits(64))
            trio.remove(key, hashes)
        elif op < 0.84:  # a whole subtree in one event: cascaded blocks named again are not errors
            if holders:
                key = rng.choice(holders)
            trio.remove(key, _subtree_removal(rng, trio.model, key))
        elif op < 0.90:
            trio.clear(key)
        elif op < 0.95:
            trio.clear_all_blocks(key[0])
        else:
            trio.remove_worker(key[0])
        trio.check(queries)
    trio.check_sizes()
    return trio.outcomes


def test_random_event_streams_match_reference():
    totals = Counter()
    for seed in range(60):
        totals += _run_stream(seed, 300)
    # the streams exercise every outcome, and matches are mostly non-trivial
    for outcome in ("store None", "store ParentBlockNotFound", "store InvalidBlockSequence",
                    "remove None", "remove BlockNotFound"):
        assert totals[outcome] >= 50, totals
    assert totals["nonzero match"] >= 60 * 300
