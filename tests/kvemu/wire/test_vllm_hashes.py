"""vLLM's block hashes in a worker's KV events (``kvemu.wire.vllm_hashes``): the values vLLM 0.34 sends, a
translator that follows the blocks' lives, and routing unchanged by them. tests/oracle checks every event of its
workloads against vLLM itself, byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvemu.errors import InvalidArgument
from kvemu.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvemu.wire.vllm_hashes import VllmHashes, block_digests, external_hash, vllm_hashes

ROOT = Path(__file__).resolve().parents[3]


def stored(hashes: list[int], parent: int | None, tokens: list[int], bs: int = 16) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=bs)


def test_the_hashes_are_the_ones_vllm_sent():
    # vLLM 0.34.0's events for the 40-token prompt 1..40 (block size 16), as its scheduler sent them on the oracle
    assert [external_hash(d) for d in block_digests(None, list(range(1, 41)), 16)] == [
        1403909460543360175, 1643945449041937783]


def test_a_chain_split_over_two_events_hashes_as_one():
    tokens = list(range(100, 164))
    whole = block_digests(None, tokens, 16)
    first = block_digests(None, tokens[:32], 16)
    assert first + block_digests(first[-1], tokens[32:], 16) == whole
    assert len(set(whole)) == 4


def test_the_translator_follows_each_block_from_store_to_removal():
    t = VllmHashes()
    a = list(range(1, 33))
    out = t.events([stored([11, 12], None, a), stored([13], 12, list(range(33, 49)))])
    digests = block_digests(None, a + list(range(33, 49)), 16)
    assert [ev.block_hashes for ev in out] == [[external_hash(d) for d in digests[:2]], [external_hash(digests[2])]]
    assert out[1].parent_block_hash == external_hash(digests[1]) and out[0].parent_block_hash is None
    assert len(t) == 3
    removed = t.events([BlockRemoved(block_hashes=[13])])
    assert removed[0].block_hashes == [external_hash(digests[2])] and len(t) == 2
    t.events([AllBlocksCleared()])
    assert len(t) == 0
    batch = t.batch(KVEventBatch(ts=1.5, events=[stored([21], None, list(range(16)))], data_parallel_rank=3))
    assert batch.ts == 1.5 and batch.data_parallel_rank == 3
    assert batch.events[0].block_hashes == [external_hash(block_digests(None, list(range(16)), 16)[0])]


@pytest.mark.parametrize("events, says", [
    ([stored([1], 99, list(range(16)))], "parent 99 is not a cached block"),
    ([BlockRemoved(block_hashes=[7])], "7 is not a cached block"),
    ([stored([1, 2], None, list(range(16)))], "2 blocks but 16 tokens"),
])
def test_events_that_name_blocks_it_never_saw_are_refused(events, says):
    with pytest.raises(InvalidArgument, match=says):
        VllmHashes().events(events)


def test_an_unknown_hash_name_is_refused():
    assert vllm_hashes("kvemu") is None
    with pytest.raises(InvalidArgument) as err:
        vllm_hashes("sha1")
    assert err.value.field == "kv_events_block_hashes"


def _run(tmp_path: Path, name: str, *overrides: str) -> Path:
    out = tmp_path / name
    sets = [a for o in ("run.max_requests=120", *overrides) for a in ("--set", o)]
    subprocess.run([sys.executable, "-m", "harness.cli", "run", "--quiet", "--plots", "wait", "-o", str(out), *sets],
                   check=True, cwd=ROOT, capture_output=True)
    return out


def test_routing_is_the_same_with_vllms_hashes(tmp_path):
    """The router names blocks by their tokens and takes the engine's hashes only as identities: the quickstart
    routes every request alike whichever hashes the workers send (both carried as wire bytes)."""
    ours = _run(tmp_path, "kvemu", "cluster.kv_wire_check=true")
    theirs = _run(tmp_path, "vllm", "cluster.kv_events_block_hashes=vllm-0.34")
    assert (ours / "requests.jsonl").read_bytes() == (theirs / "requests.jsonl").read_bytes()
    stats = json.loads((theirs / "summary.json").read_text())["kvemu"]["kv_events"]["per_worker"]
    assert sum(w["blocks_stored"] for w in stats) > 0 and not any(w["apply_errors"] for w in stats)


@pytest.mark.parametrize("bus", ["zmq", "memory"])
def test_a_publisher_sends_vllms_hashes_on_the_wire(bus, monkeypatch):
    """Both publishers (live ZeroMQ, in-memory) encode the events with vLLM's hashes, in the version's wire form."""
    from kvemu.runtime.kv_bus import MemoryKvBus
    from kvemu.wire.codec import decode_batch
    from kvemu.wire.publisher import KvEventPublisher

    sent: list[bytes] = []
    tokens = list(range(1, 33))
    batch = KVEventBatch(ts=0.0, events=[stored([5, 6], None, tokens), BlockRemoved(block_hashes=[6])])
    if bus == "zmq":
        pub = KvEventPublisher("tcp://127.0.0.1:*", bind=True, block_hashes="vllm-0.34")
        monkeypatch.setattr(pub, "publish_payload", lambda payload: sent.append(payload) or True)
        try:
            pub.publish(batch)
        finally:
            pub.close(drain_timeout_s=0)
    else:
        memory = MemoryKvBus(block_hashes="vllm-0.34")
        memory.connect(lambda worker_id, dp_rank, seq, payload: sent.append(payload))
        memory.publisher(0, 0).publish(batch)
    got = decode_batch(sent[0])
    digests = [external_hash(d) for d in block_digests(None, tokens, 16)]
    assert got.events[0].block_hashes == digests and got.events[0].parent_block_hash is None
    assert got.events[1].block_hashes == [digests[1]]
