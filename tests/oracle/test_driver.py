"""The oracle driver held to what vLLM 0.34.0's scheduler must do on workloads small enough to work out by hand.

Each workload runs twice, with the sync ``Scheduler`` and with the ``AsyncScheduler`` (all of them in one driver
process: vLLM's imports take ~10 s). The expected values below are derived in the comments from vLLM's rules
(/work/notes/oracle-facts.md cites the functions): block 0 is vLLM's null block, so a pool of N blocks has N-1
free; admission reserves the whole sequence (``scheduler_reserve_full_isl``); a prefix hit stops one token short
of the sequence and is whole blocks; full blocks are cached (BlockStored) when ``allocate_slots`` covers them;
block hashes are sha256 over pickle chained from sha256("vllm-none-hash"), sent as their low 64 bits.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import pytest

from tests.oracle.conftest import run_oracle_batch

pytestmark = pytest.mark.oracle

BS = 16


def config(**overrides: Any) -> dict[str, Any]:
    base = {"block_size": BS, "num_gpu_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 256,
            "enable_chunked_prefill": True, "enable_prefix_caching": True, "policy": "fcfs",
            "async_scheduling": False, "max_model_len": 4096, "long_prefill_token_threshold": 0}
    base.update(overrides)
    return base


def request(rid: str, prompt: list[int], output: list[int], arrive: int = 0, priority: int = 0,
            abort: int | None = None) -> dict[str, Any]:
    return {"id": rid, "prompt": prompt, "output": output, "arrive_step": arrive, "priority": priority,
            "abort_step": abort}


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


PREFIX = tokens(1000, 32)

WORKLOADS: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {
    # 40 prompt tokens, 3 generated: 3 blocks, the first 2 full and cached at once.
    "single": (config(), [request("r0", tokens(1, 40), [100, 101, 102])]),
    # 30 prompt tokens, 4 generated: the second block fills with the first two generated tokens.
    "output_block": (config(), [request("r0", tokens(1, 30), [200, 201, 202, 203])]),
    # Two prompts sharing 32 tokens (2 blocks), the second arriving one step later.
    "shared_prefix": (config(), [request("a", PREFIX + tokens(1, 8), [300, 301, 302]),
                                 request("b", PREFIX + tokens(2001, 8), [400, 401, 402], arrive=1)]),
    # 6 blocks (5 usable); two 32-token prompts take 2 blocks each; both need a third one on their second decode.
    "preemption": (config(num_gpu_blocks=6), [request("a", tokens(1, 32), tokens(500, 20)),
                                              request("b", tokens(3001, 32), tokens(600, 4))]),
    # Aborted while decoding (before schedule() number 2).
    "abort": (config(), [request("r0", tokens(1, 20), tokens(700, 10), abort=2)]),
    # A budget of 16 tokens: a 40-token prompt goes 16 + 16 + 8; the 8-token prompt behind it waits for room.
    "chunked": (config(max_num_batched_tokens=16), [request("a", tokens(1, 40), [800, 801]),
                                                    request("b", tokens(5001, 8), [900, 901])]),
    # long_prefill_token_threshold 8 with two requests eligible: each prefill chunk is capped at 8 tokens.
    "long_prefill": (config(long_prefill_token_threshold=8), [request("a", tokens(1, 20), [10, 11]),
                                                             request("b", tokens(6001, 20), [20, 21])]),
    # 6 blocks; a low-priority (5) request runs first, a high-priority (0) one joins a step later; the second
    # decode of "b" needs a block when none is free. fcfs preempts the last running ("b" itself), priority
    # preempts the lowest priority ("a"), which was already scheduled this step.
    "victim_fcfs": (config(num_gpu_blocks=6), [request("a", tokens(1, 32), tokens(100, 6), priority=5),
                                               request("b", tokens(7001, 32), tokens(200, 4), arrive=1)]),
    "victim_priority": (config(num_gpu_blocks=6, policy="priority"),
                        [request("a", tokens(1, 32), tokens(100, 6), priority=5),
                         request("b", tokens(7001, 32), tokens(200, 4), arrive=1)]),
}


def workload(name: str, async_scheduling: bool) -> dict[str, Any]:
    cfg, requests = WORKLOADS[name]
    return {"config": {**cfg, "async_scheduling": async_scheduling}, "requests": requests, "max_steps": 200}


NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()


def block_hashes(seq: list[int], n: int) -> list[bytes]:
    """vLLM's default chained block hashes of the first ``n`` full blocks of ``seq`` (worked out independently:
    sha256 of the pickled ``(parent hash, block tokens, extra keys = None)``, the first parent NONE_HASH)."""
    out: list[bytes] = []
    parent = NONE_HASH
    for i in range(n):
        parent = hashlib.sha256(pickle.dumps((parent, tuple(seq[i * BS:(i + 1) * BS]), None),
                                             protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


def as_int(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def stored(seq: list[int], first: int, count: int) -> list[Any]:
    """The BlockStored event of blocks ``first .. first + count - 1`` of the token sequence ``seq``."""
    hashes = [as_int(h) for h in block_hashes(seq, first + count)]
    parent = hashes[first - 1] if first else None
    return ["stored", hashes[first:], parent, seq[first * BS:(first + count) * BS], BS]


def removed(seq: list[int], index: int) -> list[Any]:
    return ["removed", [as_int(block_hashes(seq, index + 1)[index])]]


Row = tuple[bool, list[Any], list[Any], list[Any], list[Any], int, int, int]


def table(records: list[dict[str, Any]]) -> list[Row]:
    """Per step: schedule() called, scheduled, admitted, preempted, finished, free blocks, waiting, running."""
    assert [r["step"] for r in records] == list(range(len(records)))
    return [(r["schedule_called"], r["scheduled"], r["admitted"], r["preempted"], r["finished"], r["free_blocks"],
             r["num_waiting"], r["num_running"]) for r in records]


def events(records: list[dict[str, Any]]) -> dict[int, list[Any]]:
    return {r["step"]: r["events"] for r in records if r["events"]}


@pytest.fixture(scope="module")
def runs(oracle_python: Path) -> dict[tuple[str, bool], list[dict[str, Any]]]:
    """Every workload, sync and async, in one driver process."""
    keys = [(name, mode) for name in WORKLOADS for mode in (False, True)]
    results = run_oracle_batch(oracle_python, [workload(name, mode) for name, mode in keys])
    return dict(zip(keys, results, strict=True))


def test_hashes_are_vllm_defaults_as_ints(runs: dict[tuple[str, bool], list[dict[str, Any]]]) -> None:
    first = runs["single", False][0]["events"][0]
    assert first[1] == [1403909460543360175, 1643945449041937783]  # pinned: sha256/pickle, "vllm-none-hash"
    assert all(isinstance(h, int) for h in first[1])


# A request's steps. Sync: one schedule() and its output per step. Async: step k schedules batch k and processes
# the output of batch k-1, so finishes and the events of a schedule() show one step later; the last steps are
# an empty schedule() (finished ids still to be sent to the workers) and a drain of the last batch.


def test_single_request(runs: dict[tuple[str, bool], list[dict[str, Any]]]) -> None:
    seq = tokens(1, 40) + [100, 101, 102]
    # 40 tokens need 3 blocks (63 free -> 60); the 2 full ones are cached at allocation; 3 tokens are sampled
    # at steps 0, 1, 2 (prefill, decode, decode); the last frees the blocks.
    assert table(runs["single", False]) == [
        (True, [["r0", 40]], [["r0", 0]], [], [], 60, 0, 1),
        (True, [["r0", 1]], [], [], [], 60, 0, 1),
        (True, [["r0", 1]], [], [], [["r0", "length"]], 63, 0, 0),
        (True, [], [], [], [], 63, 0, 0),  # has_requests() holds for the finished id still to be sent
    ]
    assert events(runs["single", False]) == {0: [stored(seq, 0, 2)]}
    assert table(runs["single", True]) == [
        (True, [["r0", 40]], [["r0", 0]], [], [], 60, 0, 1),
        (True, [["r0", 1]], [], [], [], 60, 0, 1),
        (True, [["r0", 1]], [], [], [], 60, 0, 1),
        # 40 computed + 2 placeholders reach max_tokens: nothing scheduled; batch 2's output ends it
        (True, [], [], [], [["r0", "length"]], 63, 0, 0),
        (True, [], [], [], [], 63, 0, 0),
        (False, [], [], [], [], 63, 0, 0),  # drains the last (empty) batch
    ]
    assert events(runs["single", True]) == {0: [stored(seq, 0, 2)]}  # logged by schedule 0 (published in turn 1)


def test_output_block_is_stored_when_computed(runs: dict[tuple[str, bool], list[dict[str, Any]]]) -> None:
    seq = tokens(1, 30) + [200, 201, 202, 203]
    # Block 1 holds prompt tokens 16..29 and generated tokens 0 and 1 (positions 30, 31). It is full once token
    # 1 is sampled (step 1) and cached by the allocation that computes position 31 (step 2). The third block is
    # allocated at step 3 (position 32); the prompt needed 2 (63 -> 61).
    assert table(runs["output_block", False]) == [
        (True, [["r0", 30]], [["r0", 0]], [], [], 61, 0, 1),
        (True, [["r0", 1]], [], [], [], 61, 0, 1),
        (True, [["r0", 1]], [], [], [], 61, 0, 1),
        (True, [["r0", 1]], [], [], [["r0", "length"]], 63, 0, 0),
        (True, [], [], [], [], 63, 0, 0),
    ]
    assert events(runs["output_block", False]) == {0: [stored(seq, 0, 1)], 2: [stored(seq, 1, 1)]}
    # Async: position 31 is scheduled at step 2 before token 1 arrives (placeholder), so the block is cached
    # at step 3's allocation (which also takes the third block) and published by that step's update.
    assert table(runs["output_block", True]) == [
        (True, [["r0", 30]], [["r0", 0]], [], [], 61, 0, 1),
        (True, [["r0", 1]], [], [], [], 61, 0, 1),
        (True, [["r0", 1]], [], [], [], 61, 0, 1),
        (True, [["r0", 1]], [], [], [], 60, 0, 1),
        (True, [], [], [], [["r0", "length"]], 63, 0, 0),
        (True, [], [], [], [], 63, 0, 0),
        (False, [], [], [], [], 63, 0, 0),
    ]
    assert events(runs["output_block", True]) == {0: [stored(seq, 0, 1)], 3: [stored(seq, 1, 1)]}


def test_shared_prefix_hit(runs: dict[tuple[str, bool], list[dict[str, Any]]]) -> None:
    seq_a = PREFIX + tokens(1, 8) + [300, 301, 302]
    # "b" arrives at step 1 and hits the 2 shared blocks "a" cached at step 0: 32 tokens, 8 left to compute,
    # one new block (60 -> 59). Neither suffix fills a block: no other event.
    for mode in (False, True):
        rows = table(runs["shared_prefix", mode])
        assert rows[1][1:4] == ([["a", 1], ["b", 8]], [["b", 32]], [])
        assert rows[1][5] == 59
    assert [row[4] for row in table(runs["shared_prefix", False])] == [
        [], [], [["a", "length"]], [["b", "length"]], []]
    assert [row[4] for row in table(runs["shared_prefix", True])] == [
        [], [], [], [["a", "length"]], [["b", "length"]], [], []]
    assert events(runs["shared_prefix", False]) == {0: [stored(seq_a, 0, 2)]}
    assert events(runs["shared_prefix", True]) == {0: [stored(seq_a, 0, 2)]}


def test_preemption_and_return(runs: dict[tuple[str, bool], list[dict[str, Any]]]) -> None:
    seq_a = tokens(1, 32) + tokens(500, 20)
    seq_b = tokens(3001, 32) + tokens(600, 4)
    # 5 usable blocks: "a" and "b" take 2 each (free 1). Step 1: "a" takes the last block for position 32;
    # "b" needs one too, and fcfs preempts the last running request: "b" itself; a step with a preemption
    # admits nothing. "b" (33 tokens now) would hit its 2 cached blocks, but the whole sequence needs 3 and
    # the 2 hit blocks count as taken from the free queue: 3 > 2 free, it waits. Step 16 computes position
    # 47 and caches a's third block; step 17 needs a fourth and evicts the head of the free queue: b's block
    # 1 (b's blocks were freed tail first). "a" ends at step 19 (20 tokens); "b" returns at step 20 with a
    # hit of 16 (block 0 only) and computes 17 tokens, evicting a's block 2 and caching its block 1 again.
    sync = table(runs["preemption", False])
    assert sync[0] == (True, [["a", 32], ["b", 32]], [["a", 0], ["b", 0]], [], [], 1, 0, 2)
    assert sync[1] == (True, [["a", 1]], [], ["b"], [], 2, 1, 1)
    assert sync[2:19] == [(True, [["a", 1]], [], [], [], 2 if step < 17 else 1, 1, 1) for step in range(2, 19)]
    assert sync[19:] == [
        (True, [["a", 1]], [], [], [["a", "length"]], 5, 1, 0),
        (True, [["b", 17]], [["b", 16]], [], [], 2, 0, 1),
        (True, [["b", 1]], [], [], [], 2, 0, 1),
        (True, [["b", 1]], [], [], [["b", "length"]], 5, 0, 0),
        (True, [], [], [], [], 5, 0, 0),
    ]
    assert events(runs["preemption", False]) == {
        0: [stored(seq_a, 0, 2), stored(seq_b, 0, 2)],
        16: [stored(seq_a, 2, 1)],
        17: [removed(seq_b, 1)],
        20: [removed(seq_a, 2), stored(seq_b, 1, 1)],
    }
    # Async: the same decisions, but a's third block is cached only when position 48 is scheduled (step 17,
    # together with the eviction), and b returns one step later (a's last output is processed at step 20).
    asyn = table(runs["preemption", True])
    assert asyn[1] == (True, [["a", 1]], [], ["b"], [], 2, 1, 1)
    assert asyn[20:] == [
        (True, [], [], [], [["a", "length"]], 5, 1, 0),
        (True, [["b", 17]], [["b", 16]], [], [], 2, 0, 1),
        (True, [["b", 1]], [], [], [], 2, 0, 1),
        (True, [["b", 1]], [], [], [], 2, 0, 1),
        (True, [], [], [], [["b", "length"]], 5, 0, 0),
        (True, [], [], [], [], 5, 0, 0),
        (False, [], [], [], [], 5, 0, 0),
    ]
    assert events(runs["preemption", True]) == {
        0: [stored(seq_a, 0, 2), stored(seq_b, 0, 2)],
        17: [removed(seq_b, 1), stored(seq_a, 2, 1)],
        21: [removed(seq_a, 2), stored(seq_b, 1, 1)],
    }


@pytest.mark.parametrize("mode", [False, True], ids=["sync", "async"])
def test_preemption_victim_by_policy(runs: dict[tuple[str, bool], list[dict[str, Any]]], mode: bool) -> None:
    # Running ["a" (priority 5), "b" (priority 0)]; at step 2 "b" needs a block and none is free.
    fcfs, prio = table(runs["victim_fcfs", mode]), table(runs["victim_priority", mode])
    assert fcfs[1][1:4] == prio[1][1:4] == ([["a", 1], ["b", 32]], [["b", 0]], [])
    # fcfs: the last running request, "b" itself; "a" keeps running.
    assert fcfs[2][1:6] == ([["a", 1]], [], ["b"], [], 2)
    # priority: the lowest priority, "a", already scheduled this step: taken out of the batch, 3 blocks freed.
    assert prio[2][1:6] == ([["b", 1]], [], ["a"], [], 2)
    # "a" comes back once "b" is done: 34 tokens (2 sampled), its 2 prompt blocks hit, 2 tokens computed.
    back = 5 if not mode else 6
    assert prio[back][1:3] == ([["a", 2]], [["a", 32]])
    # fcfs: "b" (33 tokens) comes back once "a" is done, with its 2 prompt blocks hit: 1 token computed.
    back = 6 if not mode else 7
    assert fcfs[back][1:3] == ([["b", 1]], [["b", 32]])


def test_abort(runs: dict[tuple[str, bool], list[dict[str, Any]]]) -> None:
    seq = tokens(1, 20) + tokens(700, 10)
    # Aborted before schedule() number 2: its 2 blocks are freed (block 0 stays cached: no BlockRemoved), and
    # that schedule() runs empty, to send the finished id.
    assert table(runs["abort", False]) == [
        (True, [["r0", 20]], [["r0", 0]], [], [], 61, 0, 1),
        (True, [["r0", 1]], [], [], [], 61, 0, 1),
        (True, [], [], [], [["r0", "abort"]], 63, 0, 0),
    ]
    assert events(runs["abort", False]) == {0: [stored(seq, 0, 1)]}
    # Async: the same, then a drain of the last batch (whose output for the aborted request is dropped).
    assert table(runs["abort", True]) == [
        (True, [["r0", 20]], [["r0", 0]], [], [], 61, 0, 1),
        (True, [["r0", 1]], [], [], [], 61, 0, 1),
        (True, [], [], [], [["r0", "abort"]], 63, 0, 0),
        (False, [], [], [], [], 63, 0, 0),
    ]
    assert events(runs["abort", True]) == {0: [stored(seq, 0, 1)]}


def test_chunked_prefill_small_budget(runs: dict[tuple[str, bool], list[dict[str, Any]]]) -> None:
    seq_a = tokens(1, 40) + [800, 801]
    # Budget 16: "a" 16 + 16 + 8; "b" waits while the running chunk takes the whole budget, then gets the 8
    # left at step 2. Blocks are allocated per chunk (1, then 2, then 3 for "a"); the whole-sequence check
    # (3 blocks) only gates the admission.
    assert table(runs["chunked", False]) == [
        (True, [["a", 16]], [["a", 0]], [], [], 62, 1, 1),
        (True, [["a", 16]], [], [], [], 61, 1, 1),
        (True, [["a", 8], ["b", 8]], [["b", 0]], [], [], 59, 0, 2),
        (True, [["a", 1], ["b", 1]], [], [], [["a", "length"], ["b", "length"]], 63, 0, 0),
        (True, [], [], [], [], 63, 0, 0),
    ]
    assert events(runs["chunked", False]) == {0: [stored(seq_a, 0, 1)], 1: [stored(seq_a, 1, 1)]}
    assert table(runs["chunked", True])[:4] == [
        (True, [["a", 16]], [["a", 0]], [], [], 62, 1, 1),
        (True, [["a", 16]], [], [], [], 61, 1, 1),
        (True, [["a", 8], ["b", 8]], [["b", 0]], [], [], 59, 0, 2),
        (True, [["a", 1], ["b", 1]], [], [], [], 59, 0, 2),
    ]
    # each chunk's block is logged by the schedule() that allocated it, as in sync
    assert events(runs["chunked", True]) == {0: [stored(seq_a, 0, 1)], 1: [stored(seq_a, 1, 1)]}


@pytest.mark.parametrize("mode", [False, True], ids=["sync", "async"])
def test_long_prefill_threshold(runs: dict[tuple[str, bool], list[dict[str, Any]]], mode: bool) -> None:
    # Threshold 8 with 2 eligible requests: 8 + 8 + 4 tokens each, then one decode each.
    rows = table(runs["long_prefill", mode])
    assert [row[1] for row in rows[:4]] == [[["a", 8], ["b", 8]], [["a", 8], ["b", 8]], [["a", 4], ["b", 4]],
                                            [["a", 1], ["b", 1]]]
    assert rows[0][2] == [["a", 0], ["b", 0]]
