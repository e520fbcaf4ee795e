"""The vLLM flavour's two semantics: Dynamo's mocker (the default) and vLLM 0.34's own scheduler, sync and async.

Each case is small enough to derive by hand; tests/oracle checks the same modes against vLLM itself.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvemu.errors import InvalidArgument
from tests.oracle.kvemu_driver import run_kvemu
from workers.config import EngineConfig, HostOffloadConfig, VllmConfig
from workers.vllm.engine import VllmEngineCore


def workload(requests: list[dict[str, Any]], **config: Any) -> dict[str, Any]:
    base = {"block_size": 4, "num_gpu_blocks": 8, "max_num_seqs": 4, "max_num_batched_tokens": 64,
            "enable_chunked_prefill": True, "enable_prefix_caching": True, "policy": "fcfs",
            "async_scheduling": False}
    base.update(config)
    return {"config": base, "requests": requests}


def request(rid: str, first: int, outputs: int, arrive: int = 0, priority: int = 0,
            abort: int | None = None) -> dict[str, Any]:
    """A one-block prompt of four distinct tokens from ``first``."""
    return {"id": rid, "prompt": list(range(first, first + 4)), "output": [900 + i for i in range(outputs)],
            "arrive_step": arrive, "priority": priority, "abort_step": abort}


def step_of(records: list[dict[str, Any]], field: str, value: Any) -> int:
    return next(r["step"] for r in records if value in r[field])


def test_vllm_keeps_a_null_block():
    dynamo = VllmEngineCore(EngineConfig(num_gpu_blocks=8, block_size=4))
    exact = VllmEngineCore(EngineConfig(num_gpu_blocks=8, block_size=4, vllm=VllmConfig(semantics="vllm-0.34")))
    assert (dynamo.pool.available, exact.pool.available) == (8, 7)


def test_under_priority_vllm_preempts_the_lowest_priority_and_dynamo_the_latest_admitted():
    # B (priority 2) runs first; A (0) and C (1) join; every request grows to a third block and 7 blocks run out
    # when A needs its third: vLLM preempts B, the lowest priority (already scheduled in the pass, so its token is
    # given back); Dynamo's mocker preempts C, the latest admitted
    w = workload([request("B", 1, 8, arrive=0, priority=2), request("A", 20, 8, arrive=1, priority=0),
                  request("C", 40, 8, arrive=1, priority=1)], policy="priority")
    exact, dynamo = run_kvemu(w, "vllm-0.34"), run_kvemu(w, "dynamo")
    assert [r["preempted"] for r in exact if r["preempted"]][0] == ["B"]
    assert [r["preempted"] for r in dynamo if r["preempted"]][0] == ["C"]
    step = step_of(exact, "preempted", "B")
    assert step == step_of(dynamo, "preempted", "C") == 6
    assert [rid for rid, _ in exact[step]["scheduled"]] == ["A", "C"]
    assert [rid for rid, _ in dynamo[step]["scheduled"]] == ["B", "A"]


@pytest.mark.parametrize("policy, first", [("fcfs", "early"), ("priority", "urgent")])
def test_fcfs_ignores_priorities(policy, first):
    w = workload([request("early", 1, 2, priority=5), request("urgent", 20, 2, priority=0)], policy=policy,
                 max_num_seqs=1)
    records = run_kvemu(w, "vllm-0.34")
    assert records[0]["admitted"] == [[first, 0]]


@pytest.mark.parametrize("semantics", ["dynamo", "vllm-0.34"])
def test_sync_frees_a_finished_request_at_once(semantics):
    w = workload([request("X", 1, 2), request("Y", 20, 2)], max_num_seqs=1)
    records = run_kvemu(w, semantics)
    assert step_of(records, "finished", ["X", "length"]) == 1
    assert step_of(records, "admitted", ["Y", 0]) == 2


def test_async_holds_a_finished_request_until_its_last_token_is_read():
    # the pass after X's last one is decided before that token is read: X keeps its slot, Y waits one pass more
    w = workload([request("X", 1, 2), request("Y", 20, 2)], max_num_seqs=1, async_scheduling=True)
    records = run_kvemu(w, "vllm-0.34")
    assert step_of(records, "finished", ["X", "length"]) == 2
    assert records[2]["scheduled"] == [] and records[2]["free_blocks"] == 7
    assert step_of(records, "admitted", ["Y", 0]) == 3


def test_async_abort_of_a_request_whose_last_token_is_unread_frees_it_at_once():
    w = workload([request("X", 1, 2, abort=2), request("Y", 20, 2)], max_num_seqs=1, async_scheduling=True)
    records = run_kvemu(w, "vllm-0.34")
    assert records[2]["finished"] == [["X", "abort"]]
    assert step_of(records, "admitted", ["Y", 0]) == 2


@pytest.mark.parametrize("async_scheduling, step", [(False, 4), (True, 5)])
def test_async_caches_a_block_once_the_token_that_fills_it_is_read(async_scheduling, step):
    # prompt 0..3 fills block 0; outputs fill block 1 (positions 4..7): its KV is complete after the pass computing
    # position 7 (step 4), when the token at position 7 is known (sync) or read one pass later (async)
    w = workload([request("X", 1, 6)], async_scheduling=async_scheduling)
    records = run_kvemu(w, "vllm-0.34")
    stores = [r["step"] for r in records for e in r["events"] if e[0] == "stored"]
    assert stores == [0, step]


@pytest.mark.parametrize("config, field", [
    (dict(vllm=VllmConfig(async_scheduling=True)), "vllm.async_scheduling"),
    (dict(backend="sglang", vllm=VllmConfig(semantics="vllm-0.34")), "vllm.semantics"),
    (dict(preemption_mode="fifo", vllm=VllmConfig(semantics="vllm-0.34")), "preemption_mode"),
    (dict(native_host_offload=HostOffloadConfig(num_host_blocks=8), kv_cache_bytes_per_token=2,
          vllm=VllmConfig(semantics="vllm-0.34")), "native_host_offload"),
    (dict(num_gpu_blocks=1, vllm=VllmConfig(semantics="vllm-0.34")), "num_gpu_blocks"),
])
def test_vllm_semantics_refuse_what_they_were_not_checked_with(config, field):
    with pytest.raises(InvalidArgument) as err:
        EngineConfig(**config)
    assert err.value.field == field
