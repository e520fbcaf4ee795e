"""The SGLang oracle driver held to what SGLang 0.5.23's scheduler must do on workloads small enough to work out
by hand.

All workloads run in one driver process (SGLang's imports take ~15 s; each workload then gets a forked child and
a fresh ``Scheduler``). Pages are single tokens (``block_size`` 1), so the pool of ``num_gpu_blocks`` tokens is
all free at the start (SGLang has no null page to hold back). The rules the expectations come from (SGLang
0.5.23, ``managers/scheduler.py``, ``schedule_policy.py``, ``schedule_batch.py``):

* ``event_loop_normal``: a step runs either one prefill (extend) batch or one decode batch, never both (mixed
  chunks are off): while a prefill is possible the running requests do not decode.
* A prefill batch takes the chunked request first, then waiting requests in the policy's order, while the
  token budget (``max_prefill_tokens``, and ``chunked_prefill_size`` per chunk) lasts; a request that does not
  fit whole is cut to the budget left and becomes the chunked request.
* A prefill samples the request's first token (unless it was a chunk); each decode step one more. A request
  holds a KV slot for every token it has processed: its prompt, and one per decode step (the token fed in).
* The radix tree gets a request's prompt when its prefill runs (``BlockStored`` at that step; a chunk's tokens
  one step later, when the next chunk is scheduled), and its generated tokens when it finishes; the last
  generated token has no KV, so it is never stored. A finished request's tokens stay in the tree (evictable).
* LPM sorts the waiting queue by the longest prefix already in the tree; FCFS keeps the order of arrival.
* Admission reserves a request's whole ``max_new_tokens`` and, for running requests, ``new_token_ratio`` (0.7
  at start) of their remaining tokens, or all of them when ``ignore_eos`` (no early end possible). With
  ``ignore_eos`` off admission can over-commit; a decode step with fewer free + evictable slots than requests
  retracts requests from the end of the batch sorted by (generated tokens, -prompt tokens), descending
  (``retract_decode``); a retracted request frees its KV except what the tree holds (its prompt) and goes back
  to the waiting queue; re-admitted, it prefills prompt + generated tokens.
* KV events: ``["cleared"]`` once when the tree is reset at start-up; with pages of 1 token each stored token
  has its own hash, and a stored run's parent is the hash of the token before it (``None`` at the root).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.oracle.conftest import OracleServer, run_sglang_oracle_batch
from tests.oracle.env import SGLANG

pytestmark = pytest.mark.oracle


def config(**overrides: Any) -> dict[str, Any]:
    base = {"block_size": 1, "num_gpu_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
            "enable_chunked_prefill": True, "enable_prefix_caching": True, "policy": "fcfs",
            "async_scheduling": False, "max_model_len": 1024, "long_prefill_token_threshold": 0}
    base.update(overrides)
    return base


def request(rid: str, prompt: list[int], output: list[int], arrive: int = 0,
            abort: int | None = None) -> dict[str, Any]:
    return {"id": rid, "prompt": prompt, "output": output, "arrive_step": arrive, "priority": 0,
            "abort_step": abort}


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


PREFIX = tokens(1000, 32)
CACHED = request("w", PREFIX + tokens(1, 4), [5])  # finishes at its prefill: PREFIX stays in the tree

WORKLOADS: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {
    # 40 prompt tokens, 3 generated: one prefill step, two decode steps.
    "single": (config(), [request("r0", tokens(1, 40), [100, 101, 102])]),
    # Two prompts sharing 32 tokens; the second arrives while the first is running.
    "shared_prefix": (config(), [request("a", PREFIX + tokens(1, 8), [300, 301, 302]),
                                 request("b", PREFIX + tokens(2001, 8), [400, 401], arrive=1)]),
    # The same without prefix caching (the tree is built with its disable flag): no hit, no events.
    "no_cache": (config(enable_prefix_caching=False),
                 [request("a", PREFIX + tokens(1, 8), [300, 301, 302]),
                  request("b", PREFIX + tokens(2001, 8), [400, 401], arrive=1)]),
    # A budget of 16 tokens: a 40-token prompt goes 16 + 16 + 8; the 8-token prompt behind it takes the 8 left.
    "chunked": (config(max_num_batched_tokens=16), [request("a", tokens(1, 40), [800, 801]),
                                                    request("b", tokens(5001, 8), [900, 901])]),
    # "x" (no hit) and "y" (32-token hit on what "w" left in the tree) arrive together, "x" first.
    "fcfs": (config(policy="fcfs"), [CACHED, request("x", tokens(3001, 8), [6, 7], arrive=2),
                                     request("y", PREFIX + tokens(2001, 8), [8, 9], arrive=2)]),
    "lpm": (config(policy="lpm"), [CACHED, request("x", tokens(3001, 8), [6, 7], arrive=2),
                                   request("y", PREFIX + tokens(2001, 8), [8, 9], arrive=2)]),
    # 95 slots; two requests of 2 + 50 tokens need 104: admitted on the 0.7 estimate, one is retracted.
    "retraction": (config(num_gpu_blocks=95, ignore_eos=False),
                   [request("a", [11, 12], tokens(100, 50)), request("b", [21, 22], tokens(200, 50), arrive=1)]),
    # "r1" is aborted while waiting (the step it arrives), "r0" while decoding.
    "abort": (config(), [request("r0", tokens(1, 20), tokens(700, 10), abort=2),
                         request("r1", tokens(3001, 5), [1, 2], arrive=1, abort=1)]),
}


def workload(name: str) -> dict[str, Any]:
    cfg, requests = WORKLOADS[name]
    return {"config": cfg, "requests": requests, "max_steps": 200}


@pytest.fixture(scope="module")
def runs(sglang_oracle_python: Path) -> dict[str, list[dict[str, Any]]]:
    names = list(WORKLOADS)
    results = run_sglang_oracle_batch(sglang_oracle_python, [workload(name) for name in names])
    return dict(zip(names, results))


def column(records: list[dict[str, Any]], key: str) -> list[Any]:
    return [record[key] for record in records]


def stored(record: dict[str, Any]) -> list[list[int]]:
    """The token ids of each BlockStored event of a step."""
    return [event[3] for event in record["events"] if event[0] == "stored"]


def test_one_request_step_by_step(runs: dict[str, list[dict[str, Any]]]) -> None:
    records = runs["single"]
    assert column(records, "step") == [0, 1, 2]
    assert column(records, "mode") == ["extend", "decode", "decode"]
    assert column(records, "scheduled") == [[["r0", 40]], [["r0", 1]], [["r0", 1]]]
    assert column(records, "admitted") == [[["r0", 0]], [], []]
    assert column(records, "finished") == [[], [], [["r0", "length"]]]
    # 256 - 40 after the prefill; one slot per decode step (the token fed in: 100, then 101)
    assert column(records, "free_tokens") == [216, 215, 214]
    assert column(records, "free_blocks") == [216, 215, 214]
    # the prompt is in the tree (locked) from its prefill; at the end it and 100, 101 are evictable
    assert column(records, "evictable_tokens") == [0, 0, 42]
    assert column(records, "num_running") == [1, 1, 0] and column(records, "num_waiting") == [0, 0, 0]
    first = records[0]["events"]
    assert first[0] == ["cleared"]
    assert [e[0] for e in first[1:]] == ["stored"] and first[1][2] is None and first[1][3] == tokens(1, 40)
    assert len(first[1][1]) == 40 and first[1][4] == 1  # one hash per one-token page
    assert stored(records[1]) == [] and stored(records[2]) == [[100, 101]]
    assert records[2]["events"][0][2] == first[1][1][-1]  # chained to the prompt's last page
    assert not any(record["preempted"] or record["idle"] for record in records)


def test_shared_prefix_is_a_hit_while_the_first_request_runs(runs: dict[str, list[dict[str, Any]]]) -> None:
    records = runs["shared_prefix"]
    # step 1 is b's prefill only: a does not decode in a prefill step
    assert column(records, "scheduled")[:3] == [[["a", 40]], [["b", 8]], [["a", 1], ["b", 1]]]
    assert column(records, "admitted")[:2] == [[["a", 0]], [["b", 32]]]
    assert column(records, "free_tokens")[:3] == [216, 208, 206]
    prompt_a = records[0]["events"][1]
    assert prompt_a[3] == PREFIX + tokens(1, 8)
    (event_b,) = records[1]["events"]
    assert event_b[3] == tokens(2001, 8) and event_b[2] == prompt_a[1][31]  # hangs off PREFIX's last page
    # a: prefill 300, decode 301, 302 (steps 2, 3); b: prefill 400, decode 401 (step 2)
    assert column(records, "finished") == [[], [], [["b", "length"]], [["a", "length"]]]


def test_without_prefix_caching_nothing_is_shared_or_kept(runs: dict[str, list[dict[str, Any]]]) -> None:
    records = runs["no_cache"]
    assert column(records, "scheduled")[:2] == [[["a", 40]], [["b", 40]]]
    assert column(records, "admitted")[:2] == [[["a", 0]], [["b", 0]]]
    assert column(records, "finished") == [[], [], [["b", "length"]], [["a", "length"]]]
    # a finished request frees every slot it held: b 40 + 1 decode slot at step 2, a 40 + 2 at step 3
    assert column(records, "free_tokens") == [216, 176, 174 + 41, 214 + 42]
    assert column(records, "events") == [[], [], [], []]
    assert column(records, "evictable_tokens") == [0, 0, 0, 0]


def test_chunked_prefill_fills_a_small_budget(runs: dict[str, list[dict[str, Any]]]) -> None:
    records = runs["chunked"]
    assert column(records, "scheduled") == [[["a", 16]], [["a", 16]], [["a", 8], ["b", 8]],
                                            [["a", 1], ["b", 1]]]
    assert column(records, "admitted") == [[["a", 0]], [], [["b", 0]], []]
    assert column(records, "num_waiting") == [1, 1, 0, 0]
    assert column(records, "free_tokens") == [240, 224, 208, 206]
    # a chunk reaches the tree when the next chunk is scheduled
    assert [stored(record) for record in records[:3]] == [[], [tokens(1, 16)], [tokens(17, 24), tokens(5001, 8)]]
    assert column(records, "finished")[3] == [["a", "length"], ["b", "length"]]


def test_lpm_admits_the_longest_hit_first_fcfs_the_first_arrived(runs: dict[str, list[dict[str, Any]]]) -> None:
    fcfs, lpm = runs["fcfs"], runs["lpm"]
    for records in (fcfs, lpm):
        assert column(records, "finished")[0] == [["w", "length"]]
        assert records[1]["idle"] is True and records[1]["schedule_called"] is True
    assert fcfs[2]["admitted"] == [["x", 0], ["y", 32]]
    assert fcfs[2]["scheduled"] == [["x", 8], ["y", 8]] and fcfs[3]["scheduled"] == [["x", 1], ["y", 1]]
    assert lpm[2]["admitted"] == [["y", 32], ["x", 0]]
    assert lpm[2]["scheduled"] == [["y", 8], ["x", 8]] and lpm[3]["scheduled"] == [["y", 1], ["x", 1]]
    assert [stored(r) for r in (fcfs[2], lpm[2])] == [[tokens(3001, 8), tokens(2001, 8)],
                                                       [tokens(2001, 8), tokens(3001, 8)]]


def test_kv_pressure_retracts_the_request_with_fewer_generated_tokens(
        runs: dict[str, list[dict[str, Any]]]) -> None:
    records = runs["retraction"]
    by_step = {record["step"]: record for record in records}
    # b is admitted at step 1: 93 free - 0.7 * 49 (a's remaining) >= 2 + 50
    assert by_step[1]["admitted"] == [["b", 0]] and by_step[1]["free_tokens"] == 91
    # steps 2..46 decode both: 91 - 2 * 45 = 1 free at the end of step 46
    assert all(by_step[k]["scheduled"] == [["a", 1], ["b", 1]] for k in range(2, 47))
    assert by_step[46]["free_tokens"] == 1
    # step 47 needs 2 slots, has 1: one is retracted. Both have 46 generated tokens and 2-token prompts, so the
    # (generated, -prompt) sort (descending, stable) keeps the batch order [a, b] and the last one, b, goes. It
    # keeps its 2-token prompt in the tree; its 45 decode slots are freed; a decodes alone
    assert [k for k, r in by_step.items() if r["preempted"]] == [47]
    assert by_step[47]["preempted"] == ["b"] and by_step[47]["scheduled"] == [["a", 1]]
    assert by_step[47]["free_tokens"] == 1 + 45 - 1 and by_step[47]["evictable_tokens"] == 2
    assert by_step[47]["num_waiting"] == 1 and by_step[47]["num_running"] == 1
    # a: first token at its prefill, 49 decodes (steps 2..50); then b prefills prompt + 46 generated, hit 2
    assert by_step[50]["finished"] == [["a", "length"]]
    assert by_step[51]["admitted"] == [["b", 2]] and by_step[51]["scheduled"] == [["b", 46]]
    assert by_step[54]["finished"] == [["b", "length"]] and max(by_step) == 54


def test_abort_while_waiting_and_while_decoding(runs: dict[str, list[dict[str, Any]]]) -> None:
    records = runs["abort"]
    assert column(records, "scheduled") == [[["r0", 20]], [["r0", 1]], [["r0", 1]]]
    assert column(records, "admitted") == [[["r0", 0]], [], []]
    # r1 leaves the waiting queue at once; r0, aborted before step 2's batch, is finished by that batch's result
    assert column(records, "finished") == [[], [["r1", "abort"]], [["r0", "abort"]]]
    assert stored(records[2]) == [[700, 701]]


@pytest.mark.parametrize("hash_seed", [0, 12345])
def test_the_records_do_not_depend_on_the_hash_seed_or_the_run(
        sglang_oracle_python: Path, runs: dict[str, list[dict[str, Any]]], hash_seed: int) -> None:
    names = ["shared_prefix", "retraction"]
    again = run_sglang_oracle_batch(sglang_oracle_python, [workload(name) for name in names], hash_seed=hash_seed)
    assert again == [runs[name] for name in names]


def test_serve_mode_answers_workloads_and_refusals(sglang_oracle_python: Path,
                                                   runs: dict[str, list[dict[str, Any]]]) -> None:
    server = OracleServer(sglang_oracle_python, SGLANG.driver)
    try:
        assert server.run(workload("chunked")) == runs["chunked"]
        refused = workload("single")
        refused["config"] = config(async_scheduling=True)
        with pytest.raises(pytest.fail.Exception, match="overlap loop"):
            server.run(refused)
        assert server.run(workload("single")) == runs["single"]
    finally:
        server.close()
