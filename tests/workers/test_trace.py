"""Trace requests: hash_ids expansion, clamping, lazy token sequences and their fast block hashes."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvemu.errors import InvalidArgument
from kvemu.hashing import local_block_hashes, sequence_hashes
from harness import untrusted_files
from harness.workload.traces import mooncake as trace
from workers.config import EngineConfig
from workers.vllm.engine import VllmEngineCore
from workers.hash_id_prompt import HashIdTokens, clamped_input_length, expand_hash_ids
from harness.workload.traces.mooncake import mooncake_request, mooncake_row, read_mooncake


def test_expansion_repeats_each_id_and_truncates():
    assert expand_hash_ids([7, 8], 5, trace_block_size=3) == [7, 7, 7, 8, 8]
    assert expand_hash_ids([7, 8], 6, trace_block_size=3) == [7, 7, 7, 8, 8, 8]
    assert expand_hash_ids([7, 8], 0, trace_block_size=3) == []
    assert len(expand_hash_ids([1, 2, 3], 1200)) == 1200  # default trace block size 512


def test_input_length_is_clamped_to_what_the_hash_ids_describe():
    assert clamped_input_length([1, 2], 5000, 512) == 1024
    assert expand_hash_ids([4, 5], 5000, trace_block_size=2) == [4, 4, 5, 5]
    assert expand_hash_ids([], 10) == []


@pytest.mark.parametrize(
    ("kw", "field"), [({"input_length": -1}, "input_length"), ({"trace_block_size": 0}, "trace_block_size")]
)
def test_bad_trace_values_are_rejected(kw, field):
    args = {"hash_ids": [1], "input_length": 4, "trace_block_size": 2, **kw}
    with pytest.raises(InvalidArgument, match=field):
        expand_hash_ids(**args)


@given(
    ids=st.lists(st.integers(0, 2**32 - 1), max_size=6),
    length=st.integers(0, 80),
    tbs=st.sampled_from([1, 4, 8, 12]),
    bs=st.sampled_from([1, 2, 3, 4, 8]),
)
def test_lazy_tokens_equal_the_expansion_and_hash_identically(ids, length, tbs, bs):
    lazy = HashIdTokens(ids, length, tbs)
    full = expand_hash_ids(ids, length, tbs)
    assert len(lazy) == len(full) and lazy.to_list() == full and list(lazy) == full and lazy == full
    assert lazy[3:17] == full[3:17] and lazy[::2] == full[::2]
    if full:
        assert lazy[0] == full[0] and lazy[-1] == full[-1]
    assert lazy.local_block_hashes(bs) == local_block_hashes(full, bs)
    assert lazy.sequence_hashes(bs) == sequence_hashes(local_block_hashes(full, bs))
    other = 1 if bs != 1 else 2  # the memo follows the block size asked for
    assert lazy.sequence_hashes(other) == sequence_hashes(local_block_hashes(full, other))
    assert lazy.local_block_hashes(bs) == local_block_hashes(full, bs)


def test_a_trace_prompt_is_hashed_once_for_router_and_engine():
    """The router's load tracking and the engine's cache use the same memoized sequence hashes."""
    from kvemu import RoutingCore
    from workers.vllm.engine import VllmEngineCore
    from workers.config import EngineConfig
    from workers.request import Request

    lazy = HashIdTokens([5, 6, 7], 40, 16)
    prepared = RoutingCore(block_size=4).prepare(lazy)
    assert prepared.seq_hashes is lazy.sequence_hashes(4)  # shared, not recomputed
    assert prepared.seq_hashes == sequence_hashes(local_block_hashes(lazy.to_list(), 4))
    core = VllmEngineCore(EngineConfig(num_gpu_blocks=64, block_size=4))
    core.add_request(Request(request_id="r", token_ids=lazy, max_tokens=2, arrival_ns=0))
    core.advance_to(10**9)
    assert core.check_invariants() is None
    assert lazy.sequence_hashes(4) == sequence_hashes(local_block_hashes(lazy.to_list(), 4))  # not mutated


def test_lazy_tokens_index_errors_and_validation():
    lazy = HashIdTokens([1, 2], 3, 2)
    with pytest.raises(IndexError):
        lazy[3]
    with pytest.raises(InvalidArgument, match=r"hash_ids\[0\]"):
        HashIdTokens([-1], 4, 4)


def test_mooncake_record_becomes_a_request(tmp_path):
    rec = {"timestamp": 1500, "input_length": 700, "output_length": 12, "hash_ids": [3, 4]}
    r = mooncake_request(rec, request_id="m1")
    assert r.arrival_ns == 1_500_000_000 and r.max_tokens == 12 and len(r.token_ids) == 700
    assert r.token_ids == expand_hash_ids([3, 4], 700)
    assert mooncake_request(rec, request_id="m2", arrival_ns=7).arrival_ns == 7
    with pytest.raises(InvalidArgument, match="missing field 'hash_ids'"):
        mooncake_request({"timestamp": 0, "input_length": 1, "output_length": 1}, request_id="bad")
    path = tmp_path / "t.jsonl"
    path.write_text("\n\n".join(json.dumps({**rec, "timestamp": i}) for i in range(5)) + "\n")
    assert [(n, r.timestamp) for n, r in read_mooncake(path, 3)] == [(1, 0), (3, 1), (5, 2)]  # blank lines not counted


@pytest.mark.parametrize(
    ("row", "field", "text"),
    [
        ({"input_length": 4, "output_length": 1}, "hash_ids", "missing field 'hash_ids'"),
        ({"hash_ids": [1, -1], "input_length": 4, "output_length": 1}, "hash_ids", r"hash_ids\[1\] must be an integer in \[0, 2\*\*64\)"),
        ({"hash_ids": [2**64], "input_length": 4, "output_length": 1}, "hash_ids", "2\\*\\*64"),
        ({"hash_ids": [1.5], "input_length": 4, "output_length": 1}, "hash_ids", "hash_ids\\[0\\]"),
        ({"hash_ids": "12", "input_length": 4, "output_length": 1}, "hash_ids", "list of integers"),
        ({"hash_ids": [1], "input_length": 0, "output_length": 1}, "input_length", "empty prompt"),
        ({"hash_ids": [1], "input_length": 4, "output_length": -1}, "output_length", r"integer in \[0, 4,194,304\]"),
        ({"hash_ids": [1], "input_length": 4, "output_length": 2**22 + 1}, "output_length", "4,194,304"),
        ({"hash_ids": [1] * 8193, "input_length": 2**23, "output_length": 1}, "input_length",
         "4,194,816 tokens is longer than kvemu simulates"),
        ({"hash_ids": [1], "input_length": 4, "output_length": 1, "timestamp": -3}, "timestamp", r"in \[0, 3e\+11\]"),
        ({"hash_ids": [1], "input_length": 4, "output_length": 1, "timestamp": 1e300}, "timestamp", "ten years"),
        ({"hash_ids": [1], "input_length": 4, "output_length": 1, "delay": float("nan")}, "delay", "ten years"),
        ({"hash_ids": [1], "input_length": 4, "output_length": 1, "output_token_ids": [2**32]}, "output_token_ids", "2\\*\\*32"),
    ],
)
def test_bad_trace_rows_are_rejected_naming_the_field(row, field, text):
    with pytest.raises(InvalidArgument, match=text) as exc:
        mooncake_row(row)
    assert exc.value.field == field


def test_bad_lines_name_the_file_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"hash_ids": [1], "input_length": 4, "output_length": 1}\n\n{not json\n')
    with pytest.raises(InvalidArgument, match=r"t.jsonl:3: not JSON"):
        list(read_mooncake(path))


def test_undecodable_and_overlong_lines_name_the_file_and_line(tmp_path, monkeypatch):
    good = b'{"hash_ids": [1], "input_length": 4, "output_length": 1}\n'
    path = tmp_path / "t.jsonl"
    path.write_bytes(good + good + b'{"hash_ids": [1], "session_id": "a\xff"}\n')
    with pytest.raises(InvalidArgument, match=r"t.jsonl:3: not UTF-8 text \(byte 0xff at column 35\)"):
        list(read_mooncake(path))
    monkeypatch.setattr(untrusted_files, "MAX_TRACE_LINE_BYTES", len(good) + 10)
    path.write_bytes(good + b'{"hash_ids": [' + b"1, " * 20 + b'1], "input_length": 4, "output_length": 1}\n')
    with pytest.raises(InvalidArgument, match=r"t.jsonl:2: line longer than 67 bytes"):
        list(read_mooncake(path))


def test_hash_ids_are_u64_and_tokens_their_low_32_bits():
    big = 2**40 + 7
    assert expand_hash_ids([big], 3, 2) == [7, 7]  # clamped to one block of 2
    lazy = HashIdTokens([big, 2**32], 4, 2)
    assert lazy.to_list() == [7, 7, 0, 0] and lazy.check_u32()
    assert lazy.local_block_hashes(2) == local_block_hashes([7, 7, 0, 0], 2)


def test_trace_requests_share_prefix_blocks_in_the_engine():
    eng = VllmEngineCore(EngineConfig(num_gpu_blocks=256, block_size=64))
    rec_a = {"timestamp": 0, "input_length": 1500, "output_length": 2, "hash_ids": [0, 1, 2]}
    rec_b = {"timestamp": 1000, "input_length": 1400, "output_length": 2, "hash_ids": [0, 1, 9]}
    a = eng.add_request(mooncake_request(rec_a, request_id="a"))
    b = eng.add_request(mooncake_request(rec_b, request_id="b"))
    eng.advance_to(10**11)
    assert a.done and b.done and a.engine.cached_tokens == 0 and b.engine.cached_tokens == 1024


_ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**64 + 3), st.floats(allow_nan=True),
                       st.text(max_size=3), st.lists(st.integers(-1, 2**64), max_size=3))
_NEAR_ROW = st.fixed_dictionaries(
    {"hash_ids": st.one_of(st.lists(st.integers(-1, 2**64), max_size=4), _ANY_VALUE),
     "input_length": st.one_of(st.integers(-1, 2**23), _ANY_VALUE),
     "output_length": st.one_of(st.integers(-1, 2**23), _ANY_VALUE)},
    optional={"timestamp": _ANY_VALUE, "delay": st.one_of(st.floats(-1, 4e11), _ANY_VALUE),
              "session_id": _ANY_VALUE, "output_token_ids": _ANY_VALUE, "extra": _ANY_VALUE})


@given(row=st.one_of(_NEAR_ROW, _ANY_VALUE), tbs=st.sampled_from([1, 4, 512]))
def test_the_fast_row_decoder_accepts_only_what_the_checked_path_does_and_equals_it(row, tbs):
    line = json.dumps(row)
    fast = trace._fast_row(line, tbs)
    try:
        checked = mooncake_row(json.loads(line), tbs)
    except InvalidArgument:
        assert fast is None  # read_mooncake then takes the checked path, which names the field
        return
    assert fast is None or fast == checked


def test_a_valid_row_takes_the_fast_decoder():
    line = '{"timestamp": 3, "hash_ids": [1, 18446744073709551615], "input_length": 9, "output_length": 0, ' \
        '"session_id": 7, "output_token_ids": [5]}'
    assert trace._fast_row(line, 4) == mooncake_row(json.loads(line), 4) == \
        trace.MooncakeRow((1, 2**64 - 1), 9, 1, 3.0, None, "7", [5])
