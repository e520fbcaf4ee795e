"""Block hashing: the spec's test vectors (reference §1.2-1.3) and the edge cases around them."""

import random

import pytest
import xxhash

from kvemu.errors import InvalidArgument
from kvemu.hashing import (
    BASE_SEED,
    U64_MASK,
    block_seed,
    extend_sequence_hashes,
    local_block_hashes,
    mm_hash_from_identifier,
    sequence_hashes,
    to_u64,
)

TOKENS_64 = list(range(64))

PLAIN = [15310707395893867146, 15292316782987903195, 5532946206955930018, 14928757266181269122]
LORA = [7774427462321301335, 11306793257002815283, 5227710324928887427, 16227747212725006563]
NAMESPACE = [2130915519417463704, 14342547135021016991, 11634673069974245442, 3876172088424304685]
MM_BLOCK0 = 10080518416733111448
SEQ_PLAIN = [15310707395893867146, 13769157705258532664, 11879827756109914528, 3888788807566526800]


# --------------------------------------------------------------------------- spec test vectors


def test_vector_plain():
    assert local_block_hashes(TOKENS_64, 16) == PLAIN


def test_vector_lora():
    assert local_block_hashes(TOKENS_64, 16, lora_name="my-lora") == LORA


def test_vector_namespace():
    assert local_block_hashes(TOKENS_64, 16, cache_namespace="tenant-a") == NAMESPACE


def test_vector_mm_on_block_0():
    assert local_block_hashes(TOKENS_64, 16, block_mm_hashes={0: [0xDEADBEEF]}) == [MM_BLOCK0] + PLAIN[1:]


def test_vector_four_tokens():
    assert local_block_hashes([1, 2, 3, 4], 4) == [14643705804678351452]


def test_vector_sequence_hashes():
    assert sequence_hashes(PLAIN) == SEQ_PLAIN
    assert sequence_hashes(local_block_hashes(TOKENS_64, 16)) == SEQ_PLAIN


# --------------------------------------------------------------------------- seeds


def test_empty_lora_and_namespace_count_as_absent():
    assert local_block_hashes(TOKENS_64, 16, lora_name="", cache_namespace="") == PLAIN
    assert local_block_hashes(TOKENS_64, 16, lora_name=None, cache_namespace=None) == PLAIN
    assert block_seed("", "") == block_seed() == BASE_SEED


def test_block_seed_mixing_formula():
    lora = xxhash.xxh3_64_intdigest(b"my-lora", 0)
    ns = xxhash.xxh3_64_intdigest(b"tenant-a", 1)
    assert block_seed("my-lora") == (1337 + lora) & U64_MASK
    assert block_seed(None, "tenant-a") == (1337 + ns) & U64_MASK
    assert block_seed("my-lora", "tenant-a") == (1337 + lora + ns) & U64_MASK


def test_lora_and_namespace_combined_differ_from_each_alone():
    both = local_block_hashes(TOKENS_64, 16, lora_name="my-lora", cache_namespace="tenant-a")
    assert len(both) == 4
    assert both != LORA and both != NAMESPACE and both != PLAIN
    # the explicit seed is exactly what the names mix into
    assert both == local_block_hashes(TOKENS_64, 16, seed=block_seed("my-lora", "tenant-a"))


def test_explicit_seed_overrides_names():
    assert local_block_hashes(TOKENS_64, 16, seed=BASE_SEED, lora_name="my-lora") == PLAIN


def test_local_hash_is_xxh3_of_le_u32_tokens():
    toks = [0, 1, 0xFFFFFFFF, 123456789]
    raw = b"".join(t.to_bytes(4, "little") for t in toks)
    assert local_block_hashes(toks, 4) == [xxhash.xxh3_64_intdigest(raw, 1337)]


# --------------------------------------------------------------------------- block splitting


def test_partial_trailing_block_is_dropped():
    assert local_block_hashes(TOKENS_64 + [1, 2, 3], 16) == PLAIN
    assert local_block_hashes(TOKENS_64[:63], 16) == PLAIN[:3]
    assert local_block_hashes(TOKENS_64[:15], 16) == []


def test_hashes_are_position_independent():
    # the same 16 tokens hash the same wherever the block sits
    assert local_block_hashes(TOKENS_64[16:32], 16) == [PLAIN[1]]
    assert local_block_hashes(TOKENS_64[16:32] * 3, 16) == [PLAIN[1]] * 3


def test_empty_input():
    assert local_block_hashes([], 16) == []
    assert local_block_hashes([], 1, eagle=True) == []
    assert sequence_hashes([]) == []
    assert extend_sequence_hashes(12345, []) == []


def test_block_size_one():
    got = local_block_hashes([5, 6, 5], 1)
    assert len(got) == 3 and got[0] == got[2] != got[1]


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40, -(2**31)])
@pytest.mark.parametrize("where", [0, 5])
def test_invalid_token_raises_invalid_argument(bad, where):
    toks = list(range(8))
    toks[where] = bad
    with pytest.raises(InvalidArgument, match="tokens"):
        local_block_hashes(toks, 4)
    with pytest.raises(InvalidArgument, match="tokens"):
        local_block_hashes(toks, 4, eagle=True)


@pytest.mark.parametrize("toks", [[1, 2, 3, 4, -1], [1, 2, 3, 4, 2**32], [-1], [2**32, 1, 2]])
def test_invalid_token_in_partial_block_raises(toks):
    # the reference rejects the whole token list, even where no block hash would use the bad token
    with pytest.raises(InvalidArgument, match="tokens"):
        local_block_hashes(toks, 4)


def test_non_integer_token_raises_invalid_argument():
    with pytest.raises(InvalidArgument, match="tokens"):
        local_block_hashes([1.5, 2, 3, 4], 4)
    with pytest.raises(InvalidArgument, match="tokens"):
        local_block_hashes(["a", 2, 3, 4], 4)


def test_largest_token_is_accepted():
    assert len(local_block_hashes([0xFFFFFFFF] * 4, 4)) == 1


@pytest.mark.parametrize("bs", [0, -1, -16])
def test_non_positive_block_size_raises(bs):
    with pytest.raises(InvalidArgument, match="block_size"):
        local_block_hashes(TOKENS_64, bs)
    with pytest.raises(InvalidArgument, match="block_size"):
        local_block_hashes([], bs, eagle=True)


# --------------------------------------------------------------------------- eagle


@pytest.mark.parametrize("n", [0, 1, 4, 5, 8, 9, 12, 13, 64, 65])
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_eagle_block_count(n, bs):
    assert len(local_block_hashes(list(range(n)), bs, eagle=True)) == max(0, (n - 1) // bs)


def test_eagle_windows_overlap_by_one_token():
    toks = list(range(33))
    got = local_block_hashes(toks, 16, eagle=True)
    assert got == [local_block_hashes(toks[0:17], 17)[0], local_block_hashes(toks[16:33], 17)[0]]
    # and the windows are not the plain blocks
    assert got != local_block_hashes(toks, 16)[:2]


def test_eagle_mm_appends_to_the_window():
    toks = list(range(33))
    got = local_block_hashes(toks, 16, eagle=True, block_mm_hashes={1: [9]})
    raw = b"".join(t.to_bytes(4, "little") for t in toks[16:33]) + (9).to_bytes(8, "little")
    assert got[1] == xxhash.xxh3_64_intdigest(raw, 1337)
    assert got[0] == local_block_hashes(toks, 16, eagle=True)[0]


# --------------------------------------------------------------------------- multimodal


def test_mm_hashes_are_sorted_and_signed_values_reinterpreted():
    base = local_block_hashes(TOKENS_64, 16)
    a = local_block_hashes(TOKENS_64, 16, block_mm_hashes={2: [5, 3, 2**63]})
    b = local_block_hashes(TOKENS_64, 16, block_mm_hashes={2: [-(2**63), 3, 5]})
    assert a == b
    assert a[:2] == base[:2] and a[3] == base[3] and a[2] != base[2]
    raw = b"".join(t.to_bytes(4, "little") for t in TOKENS_64[32:48])
    raw += b"".join(h.to_bytes(8, "little") for h in (3, 5, 2**63))
    assert a[2] == xxhash.xxh3_64_intdigest(raw, 1337)


def test_mm_uses_request_seed():
    got = local_block_hashes(TOKENS_64, 16, lora_name="my-lora", block_mm_hashes={0: [0xDEADBEEF]})
    raw = b"".join(t.to_bytes(4, "little") for t in TOKENS_64[:16]) + (0xDEADBEEF).to_bytes(8, "little")
    assert got == [xxhash.xxh3_64_intdigest(raw, block_seed("my-lora"))] + LORA[1:]


def test_mm_empty_list_and_out_of_range_blocks_are_plain():
    assert local_block_hashes(TOKENS_64, 16, block_mm_hashes={0: []}) == PLAIN
    assert local_block_hashes(TOKENS_64, 16, block_mm_hashes={4: [1], -1: [1]}) == PLAIN


def test_mm_hash_from_identifier_hex64_uses_first_16_hex_digits():
    ident = "deadbeef00112233" + "f" * 48
    assert mm_hash_from_identifier(ident) == 0xDEADBEEF00112233
    assert mm_hash_from_identifier("0" * 64) == 0
    assert mm_hash_from_identifier("F" * 64) == U64_MASK


@pytest.mark.parametrize("ident", ["", "img-1", "abc123", "deadbeef" * 7, "x" * 65])
def test_mm_hash_from_identifier_other_ids_are_xxh3_seed0(ident):
    assert mm_hash_from_identifier(ident) == xxhash.xxh3_64_intdigest(ident.encode(), 0)


def test_mm_hash_from_identifier_non_hex_64_chars_falls_back_to_xxh3():
    ident = "z" * 64
    assert mm_hash_from_identifier(ident) == xxhash.xxh3_64_intdigest(ident.encode(), 0)


# --------------------------------------------------------------------------- sequence hashes


def test_sequence_hash_formula():
    a, b = 11, 22
    pair = a.to_bytes(8, "little") + b.to_bytes(8, "little")
    assert sequence_hashes([a, b]) == [a, xxhash.xxh3_64_intdigest(pair, 1337)]


def test_sequence_hashes_are_position_dependent():
    s = sequence_hashes([7, 7, 7])
    assert s[0] == 7 and len(set(s)) == 3


def test_extend_sequence_hashes_equals_tail_of_full_chain():
    rng = random.Random(1)
    for _ in range(50):
        full = [rng.getrandbits(64) for _ in range(rng.randint(1, 12))]
        k = rng.randint(0, len(full))
        prefix, tail = full[:k], full[k:]
        parent = sequence_hashes(prefix)[-1] if prefix else None
        assert extend_sequence_hashes(parent, tail) == sequence_hashes(full)[k:]


def test_extend_sequence_hashes_from_token_blocks():
    parent = SEQ_PLAIN[1]
    assert extend_sequence_hashes(parent, PLAIN[2:]) == SEQ_PLAIN[2:]


def test_to_u64():
    assert to_u64(-1) == U64_MASK
    assert to_u64(-(2**63)) == 2**63
    assert to_u64(5) == 5
    assert to_u64(U64_MASK) == U64_MASK
