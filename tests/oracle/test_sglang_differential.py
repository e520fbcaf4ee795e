"""kvemu's SGLang flavour against SGLang 0.5.23's own scheduler and radix cache, step by step.

By default the SGLang flavour re-implements Dynamo's mocker (``workers/sglang/engine.py``), not SGLang itself;
``sglang.semantics: sglang-0.5.23`` makes it decide as SGLang 0.5.23 does (docs/vllm-semantics.md, "SGLang").

* **Under the SGLang semantics every step agrees**: generated workloads with KV pressure (evictions,
  retractions), aborts, chunked prefill or none, fcfs or lpm, and every workload below, compared on every field,
  the pool's free and evictable slots and the tokens each step caches included.
* **Under Dynamo's semantics, where the two are meant to agree, they do**: generated workloads (fcfs and lpm,
  chunked prefill or not, prefix caching on or off, shared prefixes) on a pool that never binds and without
  aborts give the same steps: extend or decode, which requests run with how many tokens in batch order,
  admissions with their prefix hits, retractions (none), finishes, and the waiting and running counts.
* **Where they differ, each difference is pinned by the step that shows it** (so a change on either side is seen):
  the first output token's KV slot, admission under KV pressure, the prefill budget's boundary, an abort of a
  running request, and retraction. Each is Dynamo's mocker's behaviour, which the flavour keeps (its replay
  figures are the contract).

Timing stays kvemu's model: one oracle step is one kvemu pass, whatever it lasts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.oracle.conftest import run_sglang_oracle_batch
from tests.oracle.kvemu_driver import run_kvemu_sglang
from tests.oracle.workloads import generate_retracting, generate_sglang

pytestmark = pytest.mark.oracle

COMPARED = ("mode", "scheduled", "admitted", "preempted", "finished", "num_waiting", "num_running")
AGREEING_SEEDS = range(3000, 3030)
EXACT_SEEDS = range(4000, 4022)
RETRACTING_SEEDS = range(5000, 5040)
MIN_STEPS = 3000
EXACT_MIN_STEPS = 10_000


def stored_tokens(records: list[dict[str, Any]]) -> list[list[tuple[int, ...]]]:
    """Each step's newly cached token positions, each named by its tokens from the root (the two sides hash
    differently and group a step's pages into events differently, so only content is comparable)."""
    path: dict[Any, tuple[int, ...]] = {}
    steps = []
    for record in records:
        stored = []
        for event in record["events"]:
            if event[0] == "cleared":
                path.clear()
            elif event[0] == "stored":
                _, hashes, parent, tokens, _ = event
                here = path[parent] if parent is not None else ()
                for h, token in zip(hashes, tokens):
                    here = path[h] = here + (token,)
                    stored.append(here)
        steps.append(sorted(stored))
    return steps


def observed(record: dict[str, Any], free: bool = False) -> dict[str, Any]:
    """The compared fields of one step (finishes as a sorted list: both report a step's ends as a set); with
    ``free``, the slots free or evictable too (the oracle's two counts, kvemu's one)."""
    seen = {key: sorted(record[key]) if key == "finished" else record[key] for key in COMPARED}
    if free:
        seen["free"] = record["free_tokens"] + record.get("evictable_tokens", 0)
    return seen


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def request(rid: str, prompt: list[int], output: list[int], arrive: int = 0, abort: int | None = None) -> dict[str, Any]:
    return {"id": rid, "prompt": prompt, "output": output, "arrive_step": arrive, "priority": 0, "abort_step": abort}


def workload(requests: list[dict[str, Any]], **config: Any) -> dict[str, Any]:
    base = {"block_size": 1, "num_gpu_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
            "enable_chunked_prefill": True, "enable_prefix_caching": True, "policy": "fcfs",
            "async_scheduling": False, "max_model_len": 4096, "long_prefill_token_threshold": 0, "ignore_eos": False}
    return {"config": {**base, **config}, "requests": requests, "max_steps": 400}


EVIDENCE = {
    # 40 prompt tokens, 3 generated
    "first_slot": workload([request("r0", tokens(10, 40), [100, 101, 102])]),
    # 120 slots; "b" (60 prompt tokens, 5 out) arrives while "a" decodes: its first 16-token chunk fits what is left,
    # its whole prompt and output do not
    "pressure": workload([request("a", tokens(10, 40), tokens(100, 30)), request("b", tokens(500, 60), tokens(200, 5),
                                                                                 arrive=5)],
                         num_gpu_blocks=120, max_num_batched_tokens=16),
    # no chunking, a 64-token prefill budget; "a" (30) and "b" (34) arrive together: b fills what a leaves exactly
    "budget_boundary": workload([request("a", tokens(10, 30), [100, 101]), request("b", tokens(500, 34), [200, 201])],
                                enable_chunked_prefill=False, max_num_batched_tokens=64),
    # two seats; "a" is aborted at step 4 while it decodes, "c" waits for a seat
    "abort_running": workload([request("a", tokens(10, 8), tokens(100, 20), abort=4),
                               request("b", tokens(300, 8), tokens(200, 20)),
                               request("c", tokens(600, 8), tokens(400, 5), arrive=1)], max_num_seqs=2),
    # 95 slots; two requests of 2 + 50 tokens need 104: admitted on the 0.7 estimate, one is retracted
    "retraction": workload([request("a", [11, 12], tokens(100, 50)),
                            request("b", [21, 22], tokens(200, 50), arrive=1)], num_gpu_blocks=95),
}


Runs = list[tuple[dict[str, Any], list[dict[str, Any]]]]


@pytest.fixture(scope="module")
def oracle(sglang_oracle_python: Path) -> dict[str, Runs]:
    """Every workload of the module through SGLang in one driver process (its imports take ~15 s), by group."""
    groups = {
        "agreeing": [generate_sglang(seed, pressure=False, aborts=False) for seed in AGREEING_SEEDS],
        "exact": ([generate_sglang(seed, n_requests=40) for seed in EXACT_SEEDS]
                  + [generate_retracting(seed) for seed in RETRACTING_SEEDS]),
        "evidence": list(EVIDENCE.values()),
    }
    workloads = [wl for group in groups.values() for wl in group]
    records = iter(run_sglang_oracle_batch(sglang_oracle_python, workloads))
    return {name: [(wl, next(records)) for wl in group] for name, group in groups.items()}


@pytest.fixture(scope="module")
def evidence(oracle: dict[str, Runs]) -> dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    return {name: (records, run_kvemu_sglang(wl)) for name, (wl, records) in zip(EVIDENCE, oracle["evidence"])}


def test_the_sglang_semantics_agree_with_sglang_on_every_step(oracle: dict[str, Runs]) -> None:
    steps = retractions = aborts = 0
    for wl, records in oracle["exact"] + oracle["evidence"]:
        kvemu = run_kvemu_sglang(wl, "sglang-0.5.23")
        assert len(kvemu) == len(records), wl["config"]
        for theirs, ours in zip(records, kvemu):
            assert observed(ours, free=True) == observed(theirs, free=True), (wl["config"], theirs["step"])
        assert stored_tokens(kvemu) == stored_tokens(records), wl["config"]  # what each step caches, token by token
        steps += len(records)
        retractions += sum(len(r["preempted"]) for r in records)
        aborts += sum(1 for r in records for _, why in r["finished"] if why == "abort")
    assert steps >= EXACT_MIN_STEPS
    assert retractions > 20 and aborts > 20, (retractions, aborts)  # the draw reaches both


def test_agrees_step_by_step_where_the_pool_never_binds(oracle: dict[str, Runs]) -> None:
    steps = hits = chunks = 0
    for wl, records in oracle["agreeing"]:
        kvemu = run_kvemu_sglang(wl)
        assert len(kvemu) == len(records), wl["config"]
        for theirs, ours in zip(records, kvemu):
            assert observed(ours) == observed(theirs), (wl["config"], theirs["step"])
        steps += len(records)
        hits += sum(1 for r in records for _, hit in r["admitted"] if hit)
        chunks += sum(1 for r in records if r["mode"] == "extend" and len(r["admitted"]) < len(r["scheduled"]))
    assert steps >= MIN_STEPS
    configs = [wl["config"] for wl, _ in oracle["agreeing"]]  # the draw covers each setting the comparison stands for
    assert {c["policy"] for c in configs} == {"fcfs", "lpm"}
    assert {c["enable_chunked_prefill"] for c in configs} == {True, False}
    assert {c["enable_prefix_caching"] for c in configs} == {True, False}
    assert hits > 100 and chunks > 50, (hits, chunks)  # prefix hits; steps that continue a chunked prompt


def test_the_first_output_token_takes_its_slot_at_the_prefill_in_kvemu_at_the_next_decode_in_sglang(
        evidence: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]]) -> None:
    oracle, kvemu = evidence["first_slot"]
    assert [observed(r) for r in kvemu] == [observed(r) for r in oracle]  # the same decisions
    # free + evictable slots of 256: SGLang holds 40 after the prefill, kvemu 41 (its first token's slot too); at
    # the end SGLang caches 42 (the last token is never fed back), kvemu 43
    assert [r["free_tokens"] + r["evictable_tokens"] for r in oracle] == [216, 215, 256]
    assert [r["free_tokens"] for r in kvemu] == [215, 214, 256]
    assert oracle[-1]["evictable_tokens"] == 42


def test_under_kv_pressure_sglang_charges_the_whole_prompt_kvemu_the_chunk(
        evidence: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]]) -> None:
    oracle, kvemu = evidence["pressure"]
    assert [observed(r) for r in kvemu[:5]] == [observed(r) for r in oracle[:5]]
    # b's first chunk (16) fits what "a" leaves; its whole prompt and output (65) do not: SGLang waits for "a" to
    # finish (step 31), kvemu starts b at once
    admitted = {name: [(r["step"], r["admitted"]) for r in records if r["admitted"]] for name, records in
                (("sglang", oracle), ("kvemu", kvemu))}
    assert admitted == {"sglang": [(0, [["a", 0]]), (32, [["b", 0]])], "kvemu": [(0, [["a", 0]]), (5, [["b", 0]])]}
    assert [r["finished"] for r in oracle if r["finished"]] == [[["a", "length"]], [["b", "length"]]]
    assert len(oracle) == len(kvemu) == 40  # (b's 60 tokens run beside a's decodes in kvemu, after them in SGLang)


def test_a_prompt_that_fills_the_prefill_budget_exactly_waits_in_sglang(
        evidence: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]]) -> None:
    oracle, kvemu = evidence["budget_boundary"]
    # SGLang admits a further prompt only while it is shorter than what is left of max_prefill_tokens (34 >= 34
    # stops it), kvemu (as Dynamo's mocker) while it is not longer
    assert (oracle[0]["scheduled"], kvemu[0]["scheduled"]) == ([["a", 30]], [["a", 30], ["b", 34]])
    assert oracle[1]["scheduled"] == [["b", 34]]


def test_an_aborted_running_request_keeps_its_seat_for_one_more_step_in_sglang(
        evidence: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]]) -> None:
    oracle, kvemu = evidence["abort_running"]
    assert [observed(r) for r in kvemu[:4]] == [observed(r) for r in oracle[:4]]
    assert oracle[4]["finished"] == kvemu[4]["finished"] == [["a", "abort"]]
    # SGLang runs the aborted request in that step's batch and frees its seat after it; kvemu frees it at once
    assert (oracle[4]["scheduled"], kvemu[4]["scheduled"]) == ([["a", 1], ["b", 1]], [["c", 8]])
    # and SGLang keeps its tokens in the tree (evictable), kvemu frees its uncached pages
    assert oracle[4]["evictable_tokens"] == 12


def test_retraction_differs_in_its_step_its_victim_and_the_victims_return(
        evidence: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]]) -> None:
    oracle, kvemu = evidence["retraction"]
    retractions = {name: [(r["step"], r["preempted"]) for r in records if r["preempted"]] for name, records in
                   (("sglang", oracle), ("kvemu", kvemu))}
    # kvemu's pool fills a step earlier (the first token's slot) and it retracts the fewest-generated request,
    # the earliest admitted on a tie ("a"); SGLang the last in batch order on a tie of (generated, prompt) ("b")
    assert retractions == {"sglang": [(47, ["b"])], "kvemu": [(46, ["a"]), (48, ["b"])]}
    # kvemu caches the retracted request's whole sequence and takes it back at once (and so retracts the other one
    # a step later); SGLang keeps only its prompt and takes it back when the other one has finished
    returns = {name: [(r["step"], r["admitted"]) for r in records if r["step"] > 1 and r["admitted"]]
               for name, records in (("sglang", oracle), ("kvemu", kvemu))}
    assert returns == {"sglang": [(51, [["b", 2]])], "kvemu": [(47, [["a", 46]]), (52, [["b", 43]])]}
    assert (oracle[-1]["step"], kvemu[-1]["step"]) == (54, 55)
