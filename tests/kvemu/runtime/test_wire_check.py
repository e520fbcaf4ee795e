"""Virtual delivery of message objects and router-model KV batches vs the bytes live mode carries.

``cluster.kv_wire_check`` makes every in-memory actor message and KV-event batch travel as the exact
msgpack bytes the ZeroMQ transports and vLLM publishers send, decoded again on arrival. The reports
must be byte-identical to the object path's, chaos included: same routing, same KV view, same records.
"""

from __future__ import annotations

import json

import pytest

from harness.run.runner import run_scenario
from harness.scenario import parse_scenario

CHAOS = """
name: wire-check
cluster:
  workers: 3
  dp_size: 2
  kv_events_version: "{version}"
  kv_events_hash_form: {hash_form}
  engine: {{block_size: 16, num_gpu_blocks: 160, speedup_ratio: 4, decode_speedup_ratio: 2}}
router: {{policy: kv, affinity: {{enabled: true, ttl_secs: 30}}, heartbeat_timeout_s: 2,
          kv_event_lag_ms: 3, network_latency_ms: 1, router_track_output_blocks: true}}
workload: {{kind: synthetic, rate_rps: 8, turns: 3, think_time_s: 0.4, system_prefix_tokens: 96, sub_agents: 1,
           isl: {{kind: constant, mean: 200}}, osl: {{kind: constant, mean: 20}}}}
run: {{mode: virtual, seed: 11, duration_s: 14}}
chaos:
  - {{at_s: 2, action: drop_kv_events, worker: 0, dp_rank: 1, count: 3}}
  - {{at_s: 3, action: delay_kv_events, lag_ms: 40}}
  - {{at_s: 4, action: remove_worker, worker: 1, graceful: false}}
  - {{at_s: 5, action: add_worker}}
  - {{at_s: 6, action: kill_rank, worker: 2, dp_rank: 0}}
  - {{at_s: 7, action: slow_worker, worker: 0, factor: 2}}
  - {{at_s: 8, action: restart_router}}
"""


def _report(tmp_path, text: str, wire_check: bool) -> dict[str, bytes]:
    scenario = parse_scenario(text, overrides=[f"cluster.kv_wire_check={str(wire_check).lower()}"])
    out = tmp_path / ("wire" if wire_check else "objects")
    run_scenario(scenario, out)
    return {name: (out / name).read_bytes() for name in ("summary.json", "requests.jsonl")}


def _without_wall_time(summary: bytes) -> bytes:
    """The one line of summary.json that differs between identical runs (host time) is dropped."""
    lines = summary.splitlines(keepends=True)
    kept = [line for line in lines if not line.startswith(b'  "wall_time_ms": ')]
    assert len(kept) == len(lines) - 1
    return b"".join(kept)


@pytest.mark.parametrize(("version", "hash_form"), [("0.33", "int"), ("0.11", "int"), ("0.33", "bytes")])
def test_objects_and_wire_bytes_give_identical_reports_under_chaos(tmp_path, version, hash_form):
    """(Block hashes as digest bytes route the same as integers: the object path has no hash form at all.)"""
    text = CHAOS.format(version=version, hash_form=hash_form)
    objects = _report(tmp_path, text, wire_check=False)
    wire = _report(tmp_path, text, wire_check=True)
    assert _without_wall_time(objects["summary.json"]) == _without_wall_time(wire["summary.json"])
    assert objects["requests.jsonl"] == wire["requests.jsonl"]
    # the run went through the paths where the two forms differ: stores, removal runs, replays after
    # a router restart, and requests that failed for each fault
    kv = json.loads(objects["summary.json"])["kvemu"]
    totals = {k: sum(w[k] for w in kv["kv_events"]["per_worker"]) for k in ("blocks_stored", "blocks_removed",
                                                                            "replayed_batches", "restarts")}
    restarts = totals.pop("restarts")
    assert all(totals.values()), totals
    # no engine restarted: batches published late (delay_kv_events) are numbered when they are published,
    # so none arrives behind a replay and looks like a sequence going backwards
    assert restarts == 0
    assert set(kv["failed_requests_by_reason"]) == {"rank_lost", "router_restart", "worker_lost"}


def test_lazy_trace_prompts_and_their_wire_lists_give_identical_reports(tmp_path):
    """Trace prompts stay ``HashIdTokens`` in process (hashed per trace block); on the wire they are packed u32
    bytes, which arrive as ``PackedTokens`` (hashed from their bytes)."""
    rows = []
    for i in range(80):
        shared = [1, 2, 3] if i % 2 else [7, 8]
        rows.append({"timestamp": i * 40, "input_length": 64 * (len(shared) + 2) - 5, "output_length": 6 + i % 5,
                     "hash_ids": shared + [100 + i, 2**40 + i]})
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = f"""
name: lazy-prompts
cluster: {{workers: 3, engine: {{block_size: 16, num_gpu_blocks: 96}}}}
router: {{policy: kv, heartbeat_timeout_s: 2}}
workload: {{kind: trace, trace: {trace}, trace_block_size: 64}}
run: {{mode: virtual, seed: 3}}
chaos:
  - {{at_s: 1, action: remove_worker, worker: 2, graceful: false}}
"""
    objects = _report(tmp_path, text, wire_check=False)
    wire = _report(tmp_path, text, wire_check=True)
    assert _without_wall_time(objects["summary.json"]) == _without_wall_time(wire["summary.json"])
    assert objects["requests.jsonl"] == wire["requests.jsonl"]
    summary = json.loads(objects["summary.json"])
    assert summary["completed_requests"] + summary["kvemu"]["failed_requests"] == len(rows)
    assert summary["prefix_cache_reused_ratio"] > 0.2  # the shared trace blocks were found in the index
