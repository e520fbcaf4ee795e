"""Engine configuration: the reference defaults and validation messages that name the field."""

import msgspec
import pytest

from kvemu.errors import InvalidArgument
from workers.config import EngineConfig


def test_defaults_are_the_reference_mocker_defaults():
    c = EngineConfig()
    assert (c.num_gpu_blocks, c.block_size, c.max_num_seqs, c.max_num_batched_tokens) == (16384, 64, 256, 8192)
    assert c.enable_prefix_caching and c.enable_chunked_prefill
    assert (c.speedup_ratio, c.decode_speedup_ratio) == (1.0, 1.0)
    assert (c.preemption_mode, c.eviction_policy, c.dp_size) == ("lifo", "lru", 1)
    assert c.capacity_tokens == 16384 * 64


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_gpu_blocks", 0),
        ("num_gpu_blocks", -3),
        ("block_size", 0),
        ("block_size", 1.5),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("dp_size", 0),
        ("num_gpu_blocks", True),
    ],
)
def test_counts_must_be_positive_integers(field, value):
    with pytest.raises(InvalidArgument, match=f"^{field} must be (an integer|>= 1)"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("field", ["speedup_ratio", "decode_speedup_ratio"])
@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf"), "2"])
def test_ratios_must_be_finite_and_non_negative(field, value):
    with pytest.raises(InvalidArgument, match=f"^{field} must be (a number|a finite number|>= 0)"):
        EngineConfig(**{field: value})


def test_zero_speedup_is_allowed_and_means_no_delay():
    c = EngineConfig(speedup_ratio=0, decode_speedup_ratio=0.0)
    assert c.speedup_ratio == 0


def test_budget_must_cover_one_decode_per_running_request():
    with pytest.raises(InvalidArgument, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("preemption_mode", "random", "preemption_mode must be 'fifo' or 'lifo', got 'random'"),
        ("eviction_policy", "mru", "eviction_policy must be 'lineage' or 'lru', got 'mru'"),
        ("enable_prefix_caching", 1, "enable_prefix_caching must be a bool, got 1"),
    ],
)
def test_choices_are_checked(field, value, message):
    with pytest.raises(InvalidArgument, match=message):
        EngineConfig(**{field: value})


def test_unknown_fields_are_rejected_when_decoding():
    with pytest.raises(msgspec.ValidationError, match="num_gpu_block"):
        msgspec.convert({"num_gpu_block": 4}, EngineConfig)
    assert msgspec.convert({"num_gpu_blocks": 4, "block_size": 16}, EngineConfig).num_gpu_blocks == 4
