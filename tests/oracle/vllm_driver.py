"""Drive vLLM 0.34.0's real scheduler on CPU, step by step, as an oracle for kvemu's vLLM flavour.

Run by the ORACLE VENV's python (``python -m tests.oracle.env --path``), never by kvemu's: it imports only vllm,
torch, the standard library and its sibling ``driver_common.py``. It reads one workload as JSON on stdin and writes one JSON object per line on
stdout, one per step (see below). ``--batch`` reads a JSON list of workloads instead and tags each line with
``"workload": i`` (one process start, ~10 s of imports, for many small workloads); ``--serve`` answers one
workload per stdin line with its records and an ``{"end": true}`` line, until stdin ends (for hypothesis).

What runs: ``vllm.v1.core.sched.scheduler.Scheduler`` (or ``AsyncScheduler``) with its own KVCacheManager and
BlockPool, built the way ``vllm.v1.engine.core.EngineCore.__init__`` builds them, but with no model executor: the
KV cache is one full-attention group of ``num_gpu_blocks`` blocks (block 0 is vLLM's null block, so at most
``num_gpu_blocks - 1`` are ever free), the model config comes from a temporary folder holding only a tiny Llama
``config.json`` (``HF_HUB_OFFLINE=1``, ``skip_tokenizer_init=True``, ``DeviceConfig(device="cpu")``), and every
scheduling setting is set from the workload and read back from the resolved config (a mismatch is an error).
KV events: enabled in the config, with the scheduler's publisher replaced by an in-memory recorder.

The fake model: every scheduled request whose prefill is complete after this step's tokens (vLLM's own
``is_prefill_chunk`` is false right after ``schedule()``) samples ONE token, ``output[i]`` where ``i`` is its
position among the generated tokens (``num_computed_tokens - num_prompt_tokens`` after the step); requests still
in (chunked) prefill sample nothing, as vLLM's model runner discards their sample. Requests stop at
``max_tokens = len(output)`` (``ignore_eos``, no stop tokens) or at ``max_model_len``.

Input::

    {"config": {"block_size": 16, "num_gpu_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 256,
                "enable_chunked_prefill": true, "enable_prefix_caching": true, "policy": "fcfs",
                "async_scheduling": false, "max_model_len": 4096, "long_prefill_token_threshold": 0},
     "requests": [{"id": "r0", "prompt": [1, 2, 3], "output": [7, 8], "arrive_step": 0, "priority": 0,
                   "abort_step": null}],
     "max_steps": 100000}

Optional config keys (vLLM 0.34's defaults when absent, still checked): ``scheduler_reserve_full_isl`` (true),
``watermark`` (0.0).

Steps. Step ``k`` is the ``k``-th turn of EngineCore's busy loop (``run_busy_loop``): first the client's inputs
(requests with ``arrive_step == k`` are added with ``scheduler.add_request``, in input order, with
``arrival_time`` 1.0, 2.0, ... in the order of adding: the tie-break of the priority policy; requests with
``abort_step == k`` are aborted one by one, in input order, with ``scheduler.finish_requests(id,
FINISHED_ABORTED)``, as separate client disconnects reach ``EngineCore.abort_requests``; several ids in one call
would be freed in a set's order, which changes with the hash seed), then one call of the engine's step function, if the engine has work
(``scheduler.has_requests()``, or a batch in flight for async). A turn without work records ``"idle": true``
and schedules nothing. The run ends when no request is left in the scheduler or to arrive (and, async, no
batch is in flight), or after ``max_steps`` turns.

* Sync (``async_scheduling: false``): ``EngineCore.step``: ``schedule()``, the fake model's output for that
  batch, ``update_from_output()``. One record = one ``schedule()`` and the processing of its own output.
* Async (``async_scheduling: true``): ``EngineCore.step_with_batch_queue`` with a batch queue of
  ``max_concurrent_batches = 2``, as 0.34 runs it. A turn calls ``schedule()`` (if the scheduler has requests)
  and queues the batch (its fake output is computed then: the worker runs it at once); if the queue then holds
  fewer than 2 batches and something was executed or is left to schedule, the turn ends there; otherwise it
  pops the OLDEST batch and runs ``update_from_output()`` on it. So in the steady state, record ``k`` holds
  ``schedule()`` number ``k`` (decided while batch ``k-1`` is still in flight, with output placeholders) and
  the update of batch ``k-1``: its ``finished`` and its token effects belong to the previous batch. Its
  ``events`` are those this turn's ``schedule()`` logged (BlockStored at allocation, BlockRemoved at eviction)
  and then those of the update (blocks its newly read tokens complete): vLLM publishes both at the update, so
  a consumer sees a turn's schedule-time events one turn later, but the record keeps each with the batch whose
  decision made it. ``"schedule_called": false`` marks a turn that only drained a batch (the scheduler had no
  requests left).

Output, one line per step::

    {"step": k, "idle": false, "schedule_called": true,
     "scheduled": [[rid, num_scheduled_tokens], ...],  # in scheduling order (running first, then admitted)
     "admitted": [[rid, hit_tokens], ...],     # waiting/preempted requests run now; hit_tokens = the prefix hit
     "preempted": [rid, ...],                  # in preemption order
     "finished": [[rid, "length" | "abort" | "stop"], ...],  # this turn's aborts, then the update's outputs
     "events": [["stored", [hashes], parent_or_null, [token ids], block_size] | ["removed", [hashes]]
                | ["cleared"]],
     "free_blocks": int, "num_waiting": int, "num_running": int}

Block hashes in events are ints: vLLM 0.34 converts its sha256 block hashes (32 bytes) to the low 64 bits
(``int.from_bytes(h, "big") & (2**64 - 1)``) when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is on, its default;
this driver sets it to 1. The hash is vLLM's default: ``sha256`` over pickle, chained from ``NONE_HASH`` =
sha256 of the seed ``"vllm-none-hash"`` (``PYTHONHASHSEED`` is removed from the environment so that the default
seed is used).
"""

from __future__ import annotations

import json
import os
import sys
from collections import deque
from typing import Any

from driver_common import VOCAB_SIZE, EventRecorder, WorkloadError, check_workload, driver_main, expect

VLLM_VERSION = "0.34.0"

REQUIRED_CONFIG = {
    "block_size": int, "num_gpu_blocks": int, "max_num_seqs": int, "max_num_batched_tokens": int,
    "enable_chunked_prefill": bool, "enable_prefix_caching": bool, "policy": str, "async_scheduling": bool,
    "max_model_len": int, "long_prefill_token_threshold": int,
}
OPTIONAL_CONFIG: dict[str, tuple[type | tuple[type, ...], Any]] = {
    "scheduler_reserve_full_isl": (bool, True),
    "watermark": ((int, float), 0.0),
}

# A tiny Llama: the scheduler path reads the architecture, max_position_embeddings and the attention shape;
# nothing loads weights.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 1 << 20, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}


def _setup_environment() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
    os.environ["VLLM_NO_USAGE_STATS"] = "1"
    os.environ["DO_NOT_TRACK"] = "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.pop("PYTHONHASHSEED", None)  # NONE_HASH would be derived from it


# ------------------------------------------------------------------ the workload


def _check_workload(workload: Any) -> dict[str, Any]:
    checked = check_workload(workload, REQUIRED_CONFIG, OPTIONAL_CONFIG)
    resolved = checked["config"]
    if resolved["policy"] not in ("fcfs", "priority"):
        raise WorkloadError(f"config['policy'] must be 'fcfs' or 'priority', got {resolved['policy']!r}")
    if resolved["num_gpu_blocks"] < 2:
        raise WorkloadError("config['num_gpu_blocks'] must be >= 2 (block 0 is vLLM's null block)")
    return checked


# ------------------------------------------------------------------ vLLM's objects


def event_recorder() -> EventRecorder:
    """Stands in for vLLM's KV event publisher (``EventPublisher``): keeps the published batches in memory."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    return EventRecorder((BlockStored, BlockRemoved, AllBlocksCleared))


def _expect(what: str, got: Any, want: Any) -> None:
    expect("vLLM", what, got, want)


def _vllm_config(cfg: dict[str, Any], model_dir: str) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=cfg["max_model_len"],
                               dtype="float32", seed=0)
    cache_config = CacheConfig(block_size=cfg["block_size"], enable_prefix_caching=cfg["enable_prefix_caching"],
                               prefix_caching_hash_algo="sha256")
    scheduler_config = SchedulerConfig(
        max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_num_scheduled_tokens=None, max_num_active_seqs=None, max_num_inflight_kv_loads=None,
        long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
        long_prefill_token_threshold_adaptive=False, enable_chunked_prefill=cfg["enable_chunked_prefill"],
        policy=cfg["policy"], scheduler_cls=None, scheduler_reserve_full_isl=cfg["scheduler_reserve_full_isl"],
        watermark=float(cfg["watermark"]), prefill_schedule_interval=1, cache_aware_admission_window=0,
        async_scheduling=cfg["async_scheduling"], stream_interval=1,
        max_model_len=cfg["max_model_len"], is_encoder_decoder=False,
    )
    vllm_config = VllmConfig(
        model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    return vllm_config


def build_scheduler(cfg: dict[str, Any], model_dir: str) -> Any:
    """A Scheduler or AsyncScheduler built as EngineCore builds it, every setting checked after resolution."""
    import torch
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    try:
        vllm_config = _vllm_config(cfg, model_dir)
    except ValueError as exc:  # pydantic's ValidationError too: vLLM refuses the combination
        raise WorkloadError(f"vLLM 0.34 refuses this config: {exc}") from exc
    # What EngineCore._initialize_kv_caches settles from the workers' reports: one full-attention group.
    num_blocks = cfg["num_gpu_blocks"]
    spec = FullAttentionSpec(block_size=cfg["block_size"], num_kv_heads=4, head_size=16, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    scheduler_block_size, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(kv_cache_config,
                                                                                       vllm_config)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = kv_cache_utils.resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, scheduler_block_size, hash_block_size)

    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    scheduler = scheduler_cls(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config), include_finished_set=False,
        log_stats=False, block_size=scheduler_block_size, hash_block_size=hash_block_size,
    )
    # EngineCore.__init__: the request block hasher, with NONE_HASH initialised for the configured algorithm.
    hasher = None
    if vllm_config.cache_config.enable_prefix_caching:
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        kv_cache_utils.init_none_hash(hash_fn)
        hasher = kv_cache_utils.get_request_block_hasher(hash_block_size, hash_fn,
                                                         vllm_config.num_hash_lookahead_tokens)
    scheduler.kv_event_publisher.shutdown()
    scheduler.kv_event_publisher = event_recorder()

    # The resolved settings, read back: with no GPU vLLM applies no deployment defaults, and none may creep in.
    sc = vllm_config.scheduler_config
    want_cls = AsyncScheduler if cfg["async_scheduling"] else Scheduler
    _expect("the scheduler class", type(scheduler), want_cls)
    for key in ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "policy", "async_scheduling",
                "long_prefill_token_threshold", "scheduler_reserve_full_isl"):
        _expect(f"scheduler_config.{key}", getattr(sc, key), cfg[key])
    _expect("scheduler_config.watermark", sc.watermark, float(cfg["watermark"]))
    for key, want in (("max_num_scheduled_tokens", None), ("max_num_active_seqs", None),
                      ("long_prefill_token_threshold_adaptive", False), ("prefill_schedule_interval", 1),
                      ("cache_aware_admission_window", 0), ("max_num_inflight_kv_loads", None)):
        _expect(f"scheduler_config.{key}", getattr(sc, key), want)
    _expect("model_config.max_model_len", vllm_config.model_config.max_model_len, cfg["max_model_len"])
    _expect("cache_config.block_size", vllm_config.cache_config.block_size, cfg["block_size"])
    _expect("cache_config.enable_prefix_caching", vllm_config.cache_config.enable_prefix_caching,
            cfg["enable_prefix_caching"])
    _expect("cache_config.prefix_caching_hash_algo", vllm_config.cache_config.prefix_caching_hash_algo, "sha256")
    _expect("speculative_config", vllm_config.speculative_config, None)
    _expect("kv_transfer_config", vllm_config.kv_transfer_config, None)
    _expect("num_lookahead_tokens", vllm_config.num_lookahead_tokens, 0)
    _expect("pipeline_parallel_size", vllm_config.parallel_config.pipeline_parallel_size, 1)
    _expect("max_concurrent_batches", vllm_config.max_concurrent_batches, 2 if cfg["async_scheduling"] else 1)
    _expect("scheduler.max_num_running_reqs", scheduler.max_num_running_reqs, cfg["max_num_seqs"])
    _expect("scheduler.max_num_active_reqs", scheduler.max_num_active_reqs, cfg["max_num_seqs"])
    _expect("scheduler.max_num_scheduled_tokens", scheduler.max_num_scheduled_tokens,
            cfg["max_num_batched_tokens"])
    _expect("scheduler.max_model_len", scheduler.max_model_len, cfg["max_model_len"])
    _expect("scheduler.block_size", scheduler.block_size, cfg["block_size"])
    _expect("scheduler.hash_block_size", scheduler.hash_block_size, cfg["block_size"])
    _expect("scheduler.num_lookahead_tokens", scheduler.num_lookahead_tokens, 0)
    _expect("scheduler.num_spec_tokens", scheduler.num_spec_tokens, 0)
    _expect("scheduler.connector", scheduler.connector, None)
    _expect("scheduler.enable_kv_cache_events", scheduler.enable_kv_cache_events, True)
    _expect("scheduler.cache_aware_window", scheduler.cache_aware_window, 0)
    _expect("scheduler.local_prefill_interval", scheduler.local_prefill_interval, 1)
    pool = scheduler.kv_cache_manager.block_pool
    _expect("block_pool.num_gpu_blocks", pool.num_gpu_blocks, num_blocks)
    _expect("block_pool.enable_caching", pool.enable_caching, cfg["enable_prefix_caching"])
    _expect("block_pool.enable_kv_cache_events", pool.enable_kv_cache_events, True)
    _expect("the free blocks of a new pool", pool.get_num_free_blocks(), num_blocks - 1)
    _expect("kv_cache_manager.watermark_blocks", scheduler.kv_cache_manager.watermark_blocks,
            int(float(cfg["watermark"]) * num_blocks))
    return scheduler, hasher


# ------------------------------------------------------------------ the run


class Run:
    """One workload driven through the engine's loop (sync ``EngineCore.step`` or async
    ``EngineCore.step_with_batch_queue``), with a fake model."""

    def __init__(self, workload: dict[str, Any], model_dir: str) -> None:
        self.cfg = workload["config"]
        self.max_steps = workload["max_steps"]
        self.scheduler, self.hasher = build_scheduler(self.cfg, model_dir)
        self.specs = {req["id"]: req for req in workload["requests"]}
        order = sorted(range(len(workload["requests"])),
                       key=lambda i: (workload["requests"][i].get("arrive_step", 0), i))
        self.arrivals = deque(workload["requests"][i] for i in order)
        self.aborts: dict[int, list[str]] = {}
        for req in workload["requests"]:
            if req.get("abort_step") is not None:
                self.aborts.setdefault(req["abort_step"], []).append(req["id"])
        self.num_added = 0
        self.preempted_log: list[str] = []
        original_preempt = self.scheduler._preempt_request

        def recording_preempt(request: Any, *args: Any, **kwargs: Any) -> Any:
            self.preempted_log.append(request.request_id)
            return original_preempt(request, *args, **kwargs)

        self.scheduler._preempt_request = recording_preempt  # observation only: the order of preemption
        self.batch_queue: deque[tuple[Any, Any]] = deque()  # (scheduler_output, model_output), newest left
        self.batch_queue_size = 2 if self.cfg["async_scheduling"] else 1

    def make_request(self, spec: dict[str, Any]) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=len(spec["output"]), ignore_eos=True, detokenize=False)
        # arrival_time orders equal priorities (priority policy): the order of arrival, as time.time() would.
        self.num_added += 1
        return Request(request_id=spec["id"], prompt_token_ids=list(spec["prompt"]), sampling_params=params,
                       pooling_params=None, arrival_time=float(self.num_added), priority=spec.get("priority", 0),
                       block_hasher=self.hasher)

    def model_output(self, scheduler_output: Any) -> Any:
        """The fake model's output for a batch, made when the batch is scheduled (the worker runs it then)."""
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            req_ids.append(req_id)
            if request.is_prefill_chunk:
                sampled.append([])
                continue
            index = request.num_computed_tokens - request.num_prompt_tokens
            output = self.specs[req_id]["output"]
            if not 0 <= index < len(output):
                raise RuntimeError(f"request {req_id} samples generated token #{index}, past its output list "
                                   f"of {len(output)}")
            sampled.append([output[index]])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def update(self, scheduler_output: Any, model_output: Any, finished: list[list[str]]) -> None:
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        for eco in outputs.values():
            for out in eco.outputs:
                if out.finish_reason is not None:
                    finished.append([out.request_id, str(out.finish_reason)])

    def schedule(self, record: dict[str, Any]) -> Any:
        self.preempted_log.clear()
        scheduler_output = self.scheduler.schedule()
        # the events this schedule() logged are recorded with its step, not with the later update that publishes
        # them (async: the next turn's), so each step's events are its own batch's, in sync and async alike
        logged = self.scheduler.kv_cache_manager.take_events()
        if logged:
            from vllm.distributed.kv_events import KVEventBatch

            self.scheduler.kv_event_publisher.publish(KVEventBatch(ts=0.0, events=logged))
        record["schedule_called"] = True
        record["scheduled"] = [[rid, n] for rid, n in scheduler_output.num_scheduled_tokens.items()]
        record["admitted"] = [[new.req_id, new.num_computed_tokens]
                              for new in scheduler_output.scheduled_new_reqs]
        record["preempted"] = list(self.preempted_log)
        return scheduler_output

    def has_work(self) -> bool:
        return bool(self.scheduler.has_requests() or self.batch_queue)

    def engine_step(self, record: dict[str, Any], finished: list[list[str]]) -> None:
        if not self.cfg["async_scheduling"]:  # EngineCore.step
            scheduler_output = self.schedule(record)
            self.update(scheduler_output, self.model_output(scheduler_output), finished)
            return
        # EngineCore.step_with_batch_queue (no structured output: sampling is never deferred)
        if self.scheduler.has_requests():
            scheduler_output = self.schedule(record)
            model_executed = scheduler_output.total_num_scheduled_tokens > 0
            self.batch_queue.appendleft((scheduler_output, self.model_output(scheduler_output)))
            if len(self.batch_queue) < self.batch_queue_size and (model_executed
                                                                  or self.scheduler.has_requests()):
                return
        elif not self.batch_queue:
            return
        scheduler_output, model_output = self.batch_queue.pop()
        self.update(scheduler_output, model_output, finished)

    def run(self) -> list[dict[str, Any]]:
        from vllm.v1.request import RequestStatus

        records: list[dict[str, Any]] = []
        for step in range(self.max_steps):
            if not self.arrivals and not self.has_work():
                break
            finished: list[list[str]] = []
            while self.arrivals and self.arrivals[0].get("arrive_step", 0) <= step:
                self.scheduler.add_request(self.make_request(self.arrivals.popleft()))
            # one abort at a time, in input order, as separate client disconnects arrive: finish_requests given
            # several ids frees them in the order of a set of strings, which changes with the hash seed
            for rid in self.aborts.get(step, ()):
                for request in self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED):
                    finished.append([request.request_id, "abort"])
            record: dict[str, Any] = {"step": step, "idle": True, "schedule_called": False, "scheduled": [],
                                      "admitted": [], "preempted": []}
            if self.has_work():
                record["idle"] = False
                self.engine_step(record, finished)
            record["finished"] = finished
            record["events"] = self.scheduler.kv_event_publisher.take()
            record["free_blocks"] = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
            num_running, num_waiting = self.scheduler.get_request_counts()
            record["num_waiting"] = num_waiting
            record["num_running"] = num_running
            records.append(record)
        return records


def _start(model_dir: str) -> None:
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(f"this driver pins vLLM {VLLM_VERSION}; the interpreter has {vllm.__version__}")
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(TINY_LLAMA, f)


def main(argv: list[str]) -> int:
    _setup_environment()
    return driver_main(argv, "vllm_driver", _check_workload, _start,
                       lambda workload, model_dir, _index: Run(workload, model_dir).run())


if __name__ == "__main__":
    sys.exit(main(sys.argv))
