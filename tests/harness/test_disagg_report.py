"""The report of a disaggregated run: each pool's routing truth and each rank's KV in use.

The prefill router predicts the prompt's cached prefix; the prefill engine finds it. The decode leg receives
its KV by transfer, so its router predicts no prefix and its ranks publish no KV events: the report must not
hold the decode leg's empty prediction against the prefill engine's finding, nor show decode ranks empty.
"""

from __future__ import annotations

import json

import pytest

from harness.run.runner import run_scenario
from harness.scenario import parse_scenario

SCENARIO = """
name: disagg-small
cluster:
  prefill: {workers: 2, engine: {block_size: 16, num_gpu_blocks: 2048, kv_transfer_bandwidth: 25.0,
            kv_transfer_bytes_per_token: 1000}}
  decode: {workers: 3, engine: {block_size: 16, num_gpu_blocks: 2048}}
router: {policy: kv}
workload:
  kind: synthetic
  rate_rps: 2.0
  turns: 3
  think_time_s: 2.0
  isl: {kind: normal, mean: 512, std: 64, low: 128, high: 1024}
  osl: {kind: normal, mean: 32, std: 8, low: 8, high: 64}
  system_prefix_tokens: 256
  num_prefix_groups: 2
run: {mode: virtual, seed: 3, duration_s: 10}
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("disagg")
    outcome = run_scenario(parse_scenario(SCENARIO), out)
    return outcome, json.loads((out / "summary.json").read_text()), (out / "report.md").read_text()


def test_the_prefill_pools_prediction_is_held_against_the_prefill_engines_finding(run):
    outcome, summary, _ = run
    routing = summary["kvemu"]["routing"]
    prefill = routing["pools"]["prefill"]
    assert prefill["engine_cached_tokens"] > 0
    assert prefill["predicted_cached_tokens"] > 0  # was 0: the decode leg's (empty) prediction was recorded
    assert prefill["requests_compared"] == summary["completed_requests"]
    assert prefill["underestimated_requests"] < prefill["requests_compared"] // 4
    assert 0 < prefill["selection_overlap_blocks"] <= prefill["best_overlap_blocks"]
    for key, value in prefill.items():  # the top-level figures are the prefill pool's
        assert routing[key] == value
    recs = [r for r in outcome.data.records if r.done]
    assert any(r.predicted_overlap_blocks for r in recs)


def test_the_decode_pool_states_that_its_kv_comes_by_transfer(run):
    _, summary, report = run
    decode = summary["kvemu"]["routing"]["pools"]["decode"]
    assert decode["kv_source"] == "transfer"
    assert decode["requests_received_kv"] == summary["completed_requests"]
    assert decode["transferred_prompt_tokens"] == summary["total_input_tokens"]
    assert "prefill pool's" in report and "receives its prompt's KV by transfer" in report


def test_decode_ranks_show_the_kv_they_hold(run):
    outcome, summary, _ = run
    pools = {s.worker_id: s.pool for s in outcome.data.samples}
    assert sorted(set(pools.values())) == ["decode", "prefill"]
    decode_ranks = [r for r in summary["kvemu"]["per_rank"] if pools[r["worker_id"]] == "decode"]
    assert len(decode_ranks) == 3
    assert all(r["max_kv_blocks"] > 0 for r in decode_ranks)  # was 0: decode ranks publish no KV events
