"""Packed prompts (issue #27): u32 bytes that hash like the token list they hold, move over the wire as one
``bin``, and are hashed a slice at a time."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvemu.errors import InvalidArgument
from kvemu.hashing import local_block_hashes, sequence_hashes
from kvemu.packed_tokens import PackedTokens
from kvemu.messages import (
    PACK_FROM_TOKENS,
    ClientRequest,
    Dispatch,
    decode_client_request,
    decode_router_message,
    encode,
)
from kvemu.messages import MAX_PROMPT_TOKENS
from workers.hash_id_prompt import HashIdTokens

u32 = st.integers(0, 2**32 - 1)


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(u32, min_size=1, max_size=300), block_size=st.integers(1, 40),
       steps=st.lists(st.integers(1, 7), min_size=1, max_size=60))
def test_packed_hashes_equal_the_list_hashes_however_the_work_is_sliced(tokens, block_size, steps):
    whole = PackedTokens.from_ids(tokens)
    expected = local_block_hashes(tokens, block_size)
    assert whole.local_block_hashes(block_size) == expected
    assert whole.sequence_hashes(block_size) == sequence_hashes(expected)
    sliced = PackedTokens.from_ids(tokens)
    done = False
    for n in steps * 50:  # slices of random sizes until every block is hashed
        done = sliced.hash_ahead(block_size, n)
        if done:
            break
    assert done and sliced.local_block_hashes(block_size) == expected
    assert sliced.sequence_hashes(block_size) == sequence_hashes(expected)
    other = block_size + 1  # another block size starts over, and the first one's lists stay as they were
    kept = whole.local_block_hashes(block_size)
    assert whole.local_block_hashes(other) == local_block_hashes(tokens, other) and kept == expected
    # a LoRA seed cannot use the memo: it hashes the packed bytes as it would the list
    assert local_block_hashes(whole, block_size, lora_name="a") == local_block_hashes(tokens, block_size, lora_name="a")


@given(tokens=st.lists(u32, max_size=50), i=st.integers(-60, 60), lo=st.integers(-60, 60), hi=st.integers(-60, 60))
def test_a_packed_prompt_reads_as_its_list(tokens, i, lo, hi):
    p = PackedTokens.from_ids(tokens)
    assert len(p) == len(tokens) and list(p) == tokens and p == tokens and p.to_list() == tokens
    assert p[lo:hi] == tokens[lo:hi] and p[::2] == tokens[::2]
    if -len(tokens) <= i < len(tokens):
        assert p[i] == tokens[i]
    else:
        with pytest.raises(IndexError):
            p[i]
    assert PackedTokens(p.u32_bytes()) == p and p.check_u32()


@pytest.mark.parametrize("bad", [[1, -1], [2**32], [1, "2"], [1.0]])
def test_ids_outside_u32_are_refused_naming_the_field(bad):
    with pytest.raises(InvalidArgument, match=r"prompt\[2\]: every token id must be an integer in \[0, 2\*\*32\)") as exc:
        PackedTokens.from_ids(bad, field="prompt[2]")
    assert exc.value.field == "prompt[2]"


def test_bytes_that_are_not_whole_u32_ids_are_refused():
    with pytest.raises(InvalidArgument, match="5 bytes is not a whole number"):
        PackedTokens(b"\x00" * 5)


@given(ids=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=6), size=st.integers(1, 6),
       length=st.integers(1, 40))
def test_a_trace_prompt_packs_to_its_expansion(ids, size, length):
    lazy = HashIdTokens(ids, length, size)
    assert PackedTokens(lazy.u32_bytes()) == lazy.to_list()


def _wire_tokens(data: bytes) -> object:
    return msgspec.msgpack.decode(data)["tokens"]


def test_packed_and_lazy_prompts_travel_as_bin_and_arrive_packed():
    for tokens in (PackedTokens.from_ids(range(5, 105)), HashIdTokens([7, 2**40 + 9], 100, 64)):
        data = encode(ClientRequest(request_id="r", tokens=tokens))
        assert isinstance(_wire_tokens(data), bytes) and len(_wire_tokens(data)) == 400
        got = decode_client_request(data)
        assert isinstance(got.tokens, PackedTokens) and got.tokens == list(tokens)
        msg = decode_router_message(encode(Dispatch(request_id="r", dp_rank=0, tokens=tokens, max_tokens=1)))
        assert isinstance(msg.tokens, PackedTokens) and msg.tokens == list(tokens)


def test_a_long_list_is_packed_on_arrival_a_short_or_invalid_one_stays_a_list():
    short = decode_client_request(encode(ClientRequest(request_id="r", tokens=[1, 2, 3])))
    assert type(short.tokens) is list and short.tokens == [1, 2, 3]
    long = decode_client_request(encode(ClientRequest(request_id="r", tokens=list(range(PACK_FROM_TOKENS)))))
    assert isinstance(long.tokens, PackedTokens) and long.tokens == list(range(PACK_FROM_TOKENS))
    bad = [5] * PACK_FROM_TOKENS + [-1]  # refused downstream, with the reason any prompt of ids gets
    assert type(decode_client_request(encode(ClientRequest(request_id="r", tokens=bad))).tokens) is list


def test_a_packed_prompt_that_is_not_whole_ids_or_too_long_fails_to_decode():
    def raw(tokens: bytes) -> bytes:
        return msgspec.msgpack.encode({"type": "ClientRequest", "request_id": "r", "tokens": tokens})

    with pytest.raises(msgspec.ValidationError, match=r"7 bytes .*\$\.tokens"):
        decode_client_request(raw(b"\x01" * 7))
    with pytest.raises(msgspec.ValidationError, match=r"length <= 16777216"):
        decode_client_request(raw(b"\x00" * (4 * MAX_PROMPT_TOKENS + 4)))
    assert len(decode_client_request(raw(b"\x00" * 4 * MAX_PROMPT_TOKENS)).tokens) == MAX_PROMPT_TOKENS
