"""The routing truth's probe: a rank's cached prefix of a prompt, as an admission there would find it, read-only."""

from __future__ import annotations

import pytest

from kvemu.clock import MAX_TIME_NS
from kvemu.hashing import local_block_hashes, sequence_hashes
from workers.config import EngineConfig, KvGroupSpec
from workers.mock_worker import engine_core
from workers.request import Request

BS = 16
CONFIGS = {
    "vllm": EngineConfig(num_gpu_blocks=64, block_size=BS),
    "sglang": EngineConfig(backend="sglang", num_gpu_blocks=64 * BS, block_size=BS),
    "hybrid": EngineConfig(num_gpu_blocks=64, block_size=BS, kv_groups=[
        KvGroupSpec(kind="full_attention", layers=1), KvGroupSpec(kind="sliding_window", layers=1, window=40)]),
}


def _hashes(tokens: list[int]) -> list[int]:
    return sequence_hashes(local_block_hashes(tokens, BS))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_probe_finds_what_the_next_admission_finds_and_changes_nothing(name):
    core = engine_core(CONFIGS[name])
    shared = list(range(1000, 1000 + 6 * BS))
    first = shared + list(range(5000, 5010))
    core.add_request(Request(request_id="a", token_ids=first, max_tokens=3))
    core.advance_to(10**9)
    second = shared + list(range(7000, 7030))
    probed = core.cached_prefix_blocks(_hashes(second))
    assert probed == core.cached_prefix_blocks(_hashes(second))  # read-only
    assert core.cached_prefix_blocks(_hashes(list(range(9000, 9100)))) == 0
    rec = core.add_request(Request(request_id="b", token_ids=second, max_tokens=3, arrival_ns=10**9))
    core.advance_to(MAX_TIME_NS)
    assert probed > 0 and probed * BS == rec.engine.cached_tokens


def test_without_prefix_caching_nothing_is_cached():
    core = engine_core(EngineConfig(num_gpu_blocks=64, block_size=BS, enable_prefix_caching=False))
    tokens = list(range(100))
    core.add_request(Request(request_id="a", token_ids=tokens, max_tokens=2))
    core.advance_to(MAX_TIME_NS)
    assert core.cached_prefix_blocks(_hashes(tokens)) == 0
