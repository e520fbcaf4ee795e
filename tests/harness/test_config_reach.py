"""Every router and engine knob is defined once, can be set from scenario YAML, and reaches the component.

The tables below name a valid non-default value for every field of ``RouterConfig``, ``RouterSettings``
and ``EngineConfig``; a knob added to any of them without an entry here fails ``test_every_knob_is_walked``.
"""

import anyio
import kvemu
import msgspec
import pytest
import yaml

from kvemu.clock import ManualClock, WallClock
from kvemu.config import RouterConfig
from kvemu.registry import WorkerSpec
from kvemu.routing_core import RoutingCore
from kvemu.hooks import Hooks
from kvemu.runtime.loop import run_live, run_virtual
from kvemu.messages import ClientRequest
from kvemu.runtime.router import RouterSettings
from kvemu.runtime.transport import NoRouterEnd
from kvemu.wire.codec import profile_for
from pathlib import Path

from workers.config import (EngineConfig, HostOffloadConfig, InterpolatedTimingSpec, KvGroupSpec, SglangConfig,
                            SpeculativeConfig, VllmConfig)

from harness.run.cluster import cluster
from harness.procs import worker as worker_proc
from harness.scenario import parse_scenario

ROUTER_VALUES = {
    "overlap_score_credit": 0.5,
    "overlap_score_credit_decay": 0.25,
    "prefill_load_scale": 2.0,
    "decode_active_request_weight": 3.0,
    "host_cache_hit_weight": 0.5,
    "disk_cache_hit_weight": 0.125,
    "shared_cache_multiplier": 0.5,
    "router_temperature": 0.7,
    "use_kv_events": False,
    "router_track_active_blocks": False,
    "router_track_output_blocks": True,
    "router_assume_kv_reuse": False,
    "router_track_prefill_tokens": False,
    "router_ttl_secs": 30.0,
    "router_max_tree_size": 4096,
    "router_prune_target_ratio": 0.5,
    "router_queue_threshold": 0.75,
    "router_queue_policy": "wspt",
    "router_queue_limit_per_worker": 3,
}

SETTINGS_VALUES = {
    "retry_limit": 1,
    "dispatch_timeout_s": 2.5,
    "heartbeat_timeout_s": 7.0,
    "startup_grace_s": 0.5,
    "max_unacked_dispatches": 5,
    "request_deadline_s": 120.0,
    "kv_replay_on_connect": False,
    "max_workers": 64,
    "max_ranks": 256,
    "max_ranks_per_worker": 8,
    "registrations_per_s": 50.0,
    "registration_burst": 64,
    "kv_replay_timeout_s": 5.0,
    "max_pending_workers": 32,
    "probation_ack_timeout_s": 1.5,
    "first_token_timeout_s": 30.0,
}

ENGINE_VALUES = {
    "backend": "trtllm",
    "num_gpu_blocks": 512,
    "block_size": 32,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 4096,
    "enable_prefix_caching": False,
    "enable_chunked_prefill": False,
    "speedup_ratio": 4.0,
    "decode_speedup_ratio": 2.0,
    "preemption_mode": "fifo",
    "eviction_policy": "lineage",
    "dp_size": 3,
    "record_token_times": False,
    "kv_transfer_bandwidth": 25.0,
    "kv_transfer_bytes_per_token": 131072,
    "kv_transfer_timing_mode": "destination_missing",
    "timing_model": InterpolatedTimingSpec(path=str(Path(__file__).parents[1] / "data" / "tiny-profile.csv")),
    "vllm": VllmConfig(semantics="vllm-0.34", async_scheduling=True, scheduling_policy="fcfs"),
    "sglang": SglangConfig(semantics="sglang-0.5.23", schedule_policy="lpm", max_prefill_tokens=4096, chunked_prefill_size=2048,
                           clip_max_new_tokens=512, schedule_conservativeness=0.5, prefill_decode_interval=2),
    "kv_cache_bytes_per_token": 4096,
    "native_host_offload": HostOffloadConfig(num_host_blocks=64),
    "speculative": SpeculativeConfig(method="eagle", num_speculative_tokens=2, acceptance_rates=[0.5, 0.25],
                                     seed=7, draft_cost=0.1),
    "kv_groups": [KvGroupSpec(kind="full_attention", layers=2), KvGroupSpec(kind="sliding_window", layers=6, window=256)],
}
SINGLE_VALUED = {"trtllm"}
"""Sections whose knobs take one value only (the reference's), so no non-default value exists."""


def started(text: str):
    """The router and the workers' ``MockWorker``s of a scenario, as the harness composes them."""
    scenario = parse_scenario(text)
    clock = ManualClock()

    async def main():
        async with cluster(scenario, clock, Hooks()) as c:
            return c.router, [actor.worker for actor in c.workers.values()]

    return run_virtual(main, clock)


def test_every_knob_is_walked():
    assert list(ROUTER_VALUES) == list(RouterConfig.__struct_fields__)
    assert list(SETTINGS_VALUES) == list(RouterSettings.__struct_fields__)
    assert list(ENGINE_VALUES) == [f for f in EngineConfig.__struct_fields__ if f not in SINGLE_VALUED]
    for config, values in ((RouterConfig(), ROUTER_VALUES), (RouterSettings(), SETTINGS_VALUES),
                           (EngineConfig(), ENGINE_VALUES)):
        for name, value in values.items():
            assert getattr(config, name) != value, f"{name}: pick a non-default test value"


@pytest.mark.parametrize("name", list(ROUTER_VALUES))
def test_router_knob_is_set_from_yaml_and_reaches_the_router(name):
    value = ROUTER_VALUES[name]
    router, _ = started(f"cluster: {{workers: 1}}\nrouter:\n  {name}: {yaml.safe_dump(value).split(chr(10))[0]}\n")
    assert getattr(router.core.config, name) == value
    assert msgspec.structs.replace(RouterConfig(), **{name: value}) == router.core.config


@pytest.mark.parametrize("name", list(SETTINGS_VALUES))
def test_router_runtime_knob_is_set_from_yaml_and_reaches_the_router(name):
    value = SETTINGS_VALUES[name]
    router, _ = started(f"cluster: {{workers: 1}}\nrouter:\n  {name}: {yaml.safe_dump(value).split(chr(10))[0]}\n")
    assert router.settings == msgspec.structs.replace(RouterSettings(), **{name: value})


@pytest.mark.parametrize("name", list(ENGINE_VALUES))
def test_engine_knob_is_set_from_yaml_and_reaches_every_rank(name):
    value = ENGINE_VALUES[name]
    path = "cluster.dp_size" if name == "dp_size" else f"cluster.engine.{name}"
    text = "cluster: {workers: 2}\n"
    data = _set(yaml.safe_load(text), path, value)
    if name == "native_host_offload":  # it needs the block bytes
        data = _set(data, "cluster.engine.kv_cache_bytes_per_token", 4096)
    scenario_text = yaml.safe_dump(data)
    _, workers = started(scenario_text)
    assert len(workers) == 2
    for mock in workers:
        assert getattr(mock.config, name) == value
        assert len(mock.cores) == mock.config.dp_size
        for core in mock.cores:
            assert getattr(core.config, name) == value
            if name == "speculative":  # each rank draws from its own stream
                assert core.spec is not None and core.spec.rates == [0.5, 0.25]
            if name == "vllm":  # vLLM's own semantics, asynchronous, arrival order only
                sch = core.scheduler
                assert sch.exact and sch.lag and not sch.by_priority and core.pool.available == 16384 - 1


def _set(data: dict, path: str, value):
    node = data
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = msgspec.to_builtins(value)
    return data


BYTES_FORM = "cluster: {workers: 2, dp_size: 2, kv_events_version: '0.24', kv_events_hash_form: bytes}\n"


@pytest.mark.parametrize("mode", ["virtual", "live"])
def test_kv_events_hash_form_reaches_every_publisher(mode):
    """``cluster.kv_events_hash_form`` (with ``kv_events_version``): every rank's KV publisher encodes in it,
    in-memory (virtual) and ZeroMQ (live)."""
    scenario = parse_scenario(BYTES_FORM + f"run: {{mode: {mode}}}\n")
    clock = ManualClock() if mode == "virtual" else WallClock()

    async def main():
        async with cluster(scenario, clock, Hooks()) as c:
            return [pub.profile for pubs in c.kv_publishers.values() for pub in pubs]

    profiles = run_virtual(main, clock) if mode == "virtual" else run_live(main)
    assert profiles == [profile_for("0.24", "bytes")] * 4


def test_kv_events_hash_form_reaches_the_worker_process_publishers():
    """``kvemu worker`` (with a router, or alone in a ``kvemu fleet``) builds its ranks' publishers with the
    scenario's hash form."""

    async def main():
        _, pubs = worker_proc.build_worker(parse_scenario(BYTES_FORM), 1, "aggregated", 2, "tcp://127.0.0.1:0", None,
                                           NoRouterEnd())
        try:
            return [pub.profile for pub in pubs]
        finally:
            for pub in pubs:
                pub.close(drain_timeout_s=0)

    assert anyio.run(main) == [profile_for("0.24", "bytes")] * 2


@pytest.mark.parametrize("mode", ["virtual", "live"])
def test_kv_events_block_hashes_reach_every_publisher(mode):
    """``cluster.kv_events_block_hashes: vllm-0.34``: every rank's publisher (in-memory, ZeroMQ, a worker process's)
    rewrites its events with vLLM's hashes."""
    scenario = parse_scenario("cluster: {workers: 2, dp_size: 2, kv_events_block_hashes: vllm-0.34}\n"
                              f"run: {{mode: {mode}}}\n")
    clock = ManualClock() if mode == "virtual" else WallClock()

    async def main():
        async with cluster(scenario, clock, Hooks()) as c:
            return [pub._vllm_hashes is not None for pubs in c.kv_publishers.values() for pub in pubs]

    assert (run_virtual(main, clock) if mode == "virtual" else run_live(main)) == [True] * 4

    async def process():
        _, pubs = worker_proc.build_worker(scenario, 1, "aggregated", 2, "tcp://127.0.0.1:0", None, NoRouterEnd())
        try:
            return [pub._vllm_hashes is not None for pub in pubs]
        finally:
            for pub in pubs:
                pub.close(drain_timeout_s=0)

    assert anyio.run(process) == [True] * 2


def test_approximate_index_knobs_reach_the_approximate_index():
    router, _ = started("cluster: {workers: 1}\nrouter: {use_kv_events: false, router_ttl_secs: 30, "
                        "router_max_tree_size: 4096, router_prune_target_ratio: 0.5}\n")
    approx = router.core.approx
    assert approx is not None and approx.ttl_ns == 30 * 10**9
    assert approx.max_tree_size == 4096 and approx.prune_target == 2048


def test_queue_threshold_and_policy_build_the_router_queue():
    router, _ = started("cluster: {workers: 1}\n")
    assert router.queue is None  # unset threshold: requests never wait
    router, _ = started("cluster: {workers: 1, engine: {max_num_batched_tokens: 1000}}\n"
                        "router: {router_queue_threshold: 0.5, router_queue_policy: lcfs}\n")
    spec = router.queue.class_spec("default")
    assert spec.busy_threshold_frac == 0.5 and spec.policy == "lcfs"
    assert router.queue.limits.requests_per_worker is None
    router, _ = started("cluster: {workers: 1}\nrouter: {router_queue_threshold: 0, router_queue_limit_per_worker: 2}\n")
    assert router.queue.limits.requests_per_worker == 2
    key = router.core.registry.rank_keys()[0]
    assert not router.queue.is_busy(key)
    router.core.load.add("r", key, [], prefill_tokens=501)  # above 0.5 x 1000 batched tokens
    assert router.queue.is_busy(key)


def test_output_block_tracking_counts_crossed_block_boundaries():
    for track, expected in ((True, 3.0), (False, 0.0)):
        core = RoutingCore(block_size=16, config=RouterConfig(router_track_output_blocks=track))
        core.add_worker(WorkerSpec(worker_id=1, block_size=16))
        req = core.prepare(list(range(20)), request_id="r")
        core.book("r", core.select(req), req)
        core.note_output("r", 20, 0, 11)  # 20 → 31 tokens: no boundary
        core.note_output("r", 20, 11, 12)  # 32: one
        core.note_output("r", 20, 12, 45)  # 65: two more
        assert core.load.rank((1, 0)).output_blocks == expected


@pytest.mark.skipif(kvemu.compiled, reason="instruments RoutingCore.note_output by assignment, which a compiled "
                                          "class refuses; runs on the pure-Python build (.ci/run's first step)")
def test_the_router_reports_generated_tokens_for_output_tracking():
    scenario = parse_scenario("cluster: {workers: 1, engine: {block_size: 16}}\nrouter: {router_track_output_blocks: true}\n")
    clock = ManualClock()
    seen = []

    async def main():
        async with cluster(scenario, clock, Hooks()) as c:
            note = c.router.core.note_output
            c.router.core.note_output = lambda rid, isl, before, after, osl=None: (seen.append((isl, before, after)),
                                                                         note(rid, isl, before, after))
            result = await c.handle(ClientRequest(request_id="r", tokens=list(range(40)), max_tokens=50))
            await anyio.sleep(0)
            return result

    result = run_virtual(main, clock)
    assert result.output_tokens == 50
    assert seen and all(isl == 40 for isl, _, _ in seen)
    assert seen[0][1] == 0 and seen[-1][2] == 50
    assert all(a[2] == b[1] for a, b in zip(seen, seen[1:]))  # contiguous growth, nothing counted twice


def test_an_expected_output_length_weights_tracked_output_blocks_by_what_is_left():
    core = RoutingCore(block_size=16, config=RouterConfig(router_track_output_blocks=True))
    core.add_worker(WorkerSpec(worker_id=1, block_size=16))
    req = core.prepare(list(range(20)), request_id="r")
    core.book("r", core.select(req), req)
    core.note_output("r", 20, 0, 12, osl=40)  # 32 tokens: a block 12/40 of the way, 28/40 left
    core.note_output("r", 20, 12, 60, osl=40)  # past the expected length: more blocks weigh nothing
    assert core.load.rank((1, 0)).output_blocks == pytest.approx(0.7)
