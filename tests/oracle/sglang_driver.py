"""Drive SGLang 0.5.23's real Scheduler on CPU, step by step, as an oracle for kvemu's SGLang flavour.

Run by the SGLang ORACLE VENV's python (``python -m tests.oracle.env --sglang --path``), never by kvemu's: it
imports only sglang, torch, the standard library and its siblings ``sglang_stubs.py`` and ``driver_common.py``.
It reads one workload as JSON on stdin and writes one JSON object per line on stdout, one per step; ``--batch`` reads a JSON list of
workloads and tags each line with ``"workload": i``; ``--serve`` answers one workload per stdin line with its
records and an ``{"end": true}`` line (``{"end": true, "error": reason}`` for a refused workload), until stdin
ends. The input is vllm_driver.py's, so one workload can go to both oracles. The process imports SGLang once
(~15 s) and runs each workload in a child forked from it (SGLang builds its process-wide parallel runtime once,
in the first ``Scheduler``), ~1-2 s of ``Scheduler.__init__`` each.

What runs: ``sglang.srt.managers.scheduler.Scheduler``, built by its own ``__init__`` (with the ``ServerArgs``
and ``PortArgs`` that ``run_scheduler_process`` would get, and ``runtime_context.publish`` done first, as there),
with its own ``SchedulePolicy``/``PrefillAdder``, ``ScheduleBatch``, ``TokenToKVPoolAllocator`` and tree cache
(``UnifiedRadixCache``, SGLang's default, with its Rust core; with its ``disable`` flag when prefix caching is
off). The
model is faked (``sglang_stubs.py``): no weights, empty logits, and ``sample`` returns the workload's output
tokens. A model config is a tiny Llama ``config.json`` in a temporary folder. Every scheduling setting is set
from the workload and read back from what the Scheduler resolved; a mismatch is an error. Environment variables
named ``SGLANG_*`` are removed, so SGLang's own defaults (new-token ratio, retraction steps, ...) hold.

The loop is ``Scheduler.event_loop_normal`` (SGLang's non-overlap loop; its default ``event_loop_overlap``,
which processes each batch's result one step later, is not covered: ``async_scheduling: true`` is refused).
Step ``k``: the requests with ``arrive_step == k`` enter through ``process_input_requests`` (in input order),
then those with ``abort_step == k`` are aborted one by one (an ``AbortReq`` each; SGLang matches abort ids by
prefix, so the driver gives SGLang ids that are not prefixes of each other), then
``get_next_batch_to_run``; a batch is run (``run_batch``, the fake model) and its result processed
(``process_batch_result``); no batch calls ``on_idle`` and records ``"idle": true``. After each step the
scheduler's own KV-event publisher (``SchedulerKvEventsPublisher.publish_kv_events``, which drains the tree's
events into a ``KVEventBatch``) publishes to an in-memory recorder that replaces its ZeroMQ socket. The run ends
when nothing is left to arrive and the scheduler holds no request, or after ``max_steps``.

The fake model: every request of a batch samples one token, ``output[i]`` with ``i`` the number of tokens it has
generated so far; SGLang itself drops the sample of a request whose prefill is not complete (a chunk).

Input::

    {"config": {"block_size": 1, "num_gpu_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                "enable_chunked_prefill": true, "enable_prefix_caching": true, "policy": "lpm",
                "async_scheduling": false, "max_model_len": 4096, "long_prefill_token_threshold": 0},
     "requests": [{"id": "r0", "prompt": [1, 2, 3], "output": [7, 8], "arrive_step": 0, "priority": 0,
                   "abort_step": null}],
     "max_steps": 100000}

Mapping: ``block_size`` is SGLang's ``page_size`` (1 is what the tests use; larger pages are passed through,
checked, and not otherwise exercised); the KV pool holds ``num_gpu_blocks * block_size`` tokens
(``max_total_tokens``, read back as ``max_total_num_tokens``); ``max_num_seqs`` is ``max_running_requests``;
``max_num_batched_tokens`` is ``max_prefill_tokens`` (the token budget of one prefill batch) and, with
``enable_chunked_prefill``, also ``chunked_prefill_size`` (else chunking is off: -1); ``policy`` is
``schedule_policy``: ``fcfs``, ``lpm`` or ``lof`` (``random``, ``dfs-weight`` and priority scheduling are
refused); ``enable_prefix_caching: false`` is ``disable_radix_cache``; ``max_model_len`` is ``context_length``;
``long_prefill_token_threshold`` must be 0 and ``priority`` 0 (no such settings are used).
Optional SGLang keys: ``chunked_prefill_size`` and ``max_prefill_tokens`` (override the mapping),
``schedule_conservativeness`` (1.0), ``enable_mixed_chunk`` (false), ``ignore_eos`` (true: every request
generates its whole output list, as in vllm_driver; false: an output token equal to the model's EOS id, 2, ends
the request with "stop", and admission then reserves only ``new_token_ratio`` of each running request's
remaining tokens instead of all of them, which is what lets decode run out of KV and retract). vllm_driver's optional keys are accepted only
at vLLM's defaults (``scheduler_reserve_full_isl`` true, ``watermark`` 0), which have no SGLang counterpart.

Output, one line per step::

    {"step": k, "idle": false, "schedule_called": true, "mode": "extend" | "decode" | "mixed" | null,
     "scheduled": [[rid, tokens], ...],       # the batch's requests in its order: extend_lens, or 1 to decode
     "admitted": [[rid, hit_tokens], ...],    # requests taken from the waiting queue: their prefix hit
     "preempted": [rid, ...],                 # retracted by retract_decode, in its order (back to waiting)
     "finished": [[rid, "length" | "abort" | "stop"], ...],
     "events": [["stored", [hashes], parent_or_null, [token ids], block_size] | ["removed", [hashes]]
                | ["cleared"]],
     "free_tokens": int, "free_blocks": int,  # the allocator's available_size(), and that over block_size
     "evictable_tokens": int,                 # unlocked tokens in the tree (SGLang evicts them on demand)
     "num_waiting": int, "num_running": int}  # the waiting queue; every other unfinished request it holds

Block hashes are SGLang's own (the tree publishes 64-bit ints); ``PYTHONHASHSEED`` does not change them.
"""

from __future__ import annotations

import json
import os
import sys
from array import array
from typing import Any

import sglang_stubs  # the sibling modules: run as a script, this folder is first on sys.path
from driver_common import VOCAB_SIZE, EventRecorder, WorkloadError, check_workload, driver_main, expect

SGLANG_VERSION = "0.5.23"
POLICIES = ("fcfs", "lpm", "lof")

REQUIRED_CONFIG = {
    "block_size": int, "num_gpu_blocks": int, "max_num_seqs": int, "max_num_batched_tokens": int,
    "enable_chunked_prefill": bool, "enable_prefix_caching": bool, "policy": str, "async_scheduling": bool,
    "max_model_len": int, "long_prefill_token_threshold": int,
}
OPTIONAL_CONFIG: dict[str, tuple[type | tuple[type, ...], Any]] = {
    "chunked_prefill_size": (int, None),
    "max_prefill_tokens": (int, None),
    "schedule_conservativeness": ((int, float), 1.0),
    "enable_mixed_chunk": (bool, False),
    "ignore_eos": (bool, True),
    "scheduler_reserve_full_isl": (bool, True),  # vLLM's: accepted at its default only
    "watermark": ((int, float), 0.0),  # vLLM's: accepted at its default only
}
FINISH_REASONS = {"FINISH_LENGTH": "length", "FINISH_ABORT": "abort", "FINISH_MATCHED_TOKEN": "stop",
                  "FINISH_MATCHED_STR": "stop"}

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 1 << 20, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "rope_theta": 10000.0,
}


def _setup_environment() -> None:
    for name in [name for name in os.environ if name.startswith("SGLANG_")]:
        del os.environ[name]
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


# ------------------------------------------------------------------ the workload


def _check_workload(workload: Any) -> dict[str, Any]:
    checked = check_workload(workload, REQUIRED_CONFIG, OPTIONAL_CONFIG)
    cfg = checked["config"]
    if cfg["policy"] not in POLICIES:
        raise WorkloadError(f"config['policy'] must be one of {POLICIES}, got {cfg['policy']!r}")
    if not cfg["enable_prefix_caching"] and cfg["policy"] != "fcfs":
        raise WorkloadError("without prefix caching SGLang schedules fcfs whatever the policy: ask for fcfs")
    if cfg["async_scheduling"]:
        raise WorkloadError("async_scheduling (SGLang's overlap loop) is not covered by this driver")
    if cfg["long_prefill_token_threshold"] != 0:
        raise WorkloadError("SGLang has no long_prefill_token_threshold: it must be 0")
    if cfg["scheduler_reserve_full_isl"] is not True or float(cfg["watermark"]) != 0.0:
        raise WorkloadError("scheduler_reserve_full_isl and watermark are vLLM settings: only their defaults")
    if cfg["chunked_prefill_size"] is None:
        cfg["chunked_prefill_size"] = cfg["max_num_batched_tokens"] if cfg["enable_chunked_prefill"] else -1
    if cfg["max_prefill_tokens"] is None:
        cfg["max_prefill_tokens"] = cfg["max_num_batched_tokens"]
    cfg["schedule_conservativeness"] = float(cfg["schedule_conservativeness"])
    for req in checked["requests"]:
        if req.get("priority", 0) != 0:
            raise WorkloadError(f"request {req['id']}: priorities are not covered (priority scheduling is off)")
    return checked


# ------------------------------------------------------------------ SGLang's objects


RETRACTED: list[str] = []  # SGLang rids, in the order retract_decode returned them (observation only)


def _observe_retractions() -> None:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    original = ScheduleBatch.retract_decode
    if getattr(original, "_kvemu_observed", False):
        return

    def retract_decode(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        RETRACTED.extend(req.rid for req in result[0])
        return result

    retract_decode._kvemu_observed = True  # type: ignore[attr-defined]
    ScheduleBatch.retract_decode = retract_decode


def _expect(what: str, got: Any, want: Any) -> None:
    expect("SGLang", what, got, want)


def build_scheduler(cfg: dict[str, Any], model_dir: str, events_dir: str) -> Any:
    """SGLang's Scheduler as ``run_scheduler_process`` builds it (one rank, no overlap), every setting checked."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import SpawnRanks, get_memory, get_schedule, publish, spawn_world_rank
    from sglang.srt.server_args import PortArgs, ServerArgs

    server_args = ServerArgs(
        model_path=model_dir, skip_tokenizer_init=True, device="cpu", load_format="dummy", dtype="float32",
        context_length=cfg["max_model_len"], random_seed=0,
        page_size=cfg["block_size"], max_total_tokens=cfg["num_gpu_blocks"] * cfg["block_size"],
        max_running_requests=cfg["max_num_seqs"], chunked_prefill_size=cfg["chunked_prefill_size"],
        max_prefill_tokens=cfg["max_prefill_tokens"], schedule_policy=cfg["policy"],
        schedule_conservativeness=cfg["schedule_conservativeness"], enable_mixed_chunk=cfg["enable_mixed_chunk"],
        disable_radix_cache=not cfg["enable_prefix_caching"], radix_eviction_policy="lru",
        enable_priority_scheduling=False, retraction_policy="length", prefill_max_requests=None,
        prefill_decode_interval=0, disable_overlap_schedule=True, disable_cuda_graph=True,
        attention_backend="torch_native", sampling_backend="pytorch",
        kv_events_config=json.dumps({"publisher": "zmq", "endpoint": f"ipc://{events_dir}/kv-events"}),
    )
    port_args = PortArgs.init_new(server_args)
    publish(server_args, role="scheduler",
            ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=0, pp_rank=0), dp_rank=None,
                             gpu_id=0))
    scheduler = Scheduler(server_args, port_args)

    events = scheduler.kv_events_publisher
    _expect("kv_events_publisher.enable_kv_cache_events", events.enable_kv_cache_events, True)
    events.kv_event_publisher.shutdown()
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    events.kv_event_publisher = EventRecorder((BlockStored, BlockRemoved, AllBlocksCleared))

    schedule = get_schedule()
    # prefix caching off is the same tree class with its ``disable`` flag set (it matches nothing, stores nothing)
    _expect("the tree cache", type(scheduler.tree_cache).__name__, "UnifiedRadixCache")
    _expect("tree_cache.disable", scheduler.tree_cache.disable, not cfg["enable_prefix_caching"])
    _expect("max_total_num_tokens", scheduler.max_total_num_tokens, cfg["num_gpu_blocks"] * cfg["block_size"])
    _expect("page_size", scheduler.page_size, cfg["block_size"])
    _expect("max_running_requests", scheduler.max_running_requests, cfg["max_num_seqs"])
    _expect("max_prefill_tokens", scheduler.max_prefill_tokens, cfg["max_prefill_tokens"])
    chunk = cfg["chunked_prefill_size"] if cfg["chunked_prefill_size"] > 0 else None
    _expect("chunked_prefill_size", scheduler.chunked_prefill_size, chunk)
    _expect("is_mixed_chunk", scheduler.is_mixed_chunk, bool(chunk and cfg["enable_mixed_chunk"]))
    _expect("policy", scheduler.policy.policy.value, cfg["policy"])
    _expect("schedule_conservativeness", schedule.schedule_conservativeness, cfg["schedule_conservativeness"])
    _expect("enable_priority_scheduling", scheduler.enable_priority_scheduling, False)
    _expect("retraction_policy", schedule.retraction_policy, "length")
    _expect("prefill_max_requests", schedule.prefill_max_requests, None)
    _expect("prefill_decode_interval", scheduler.prefill_decode_interval, 0)
    _expect("radix_eviction_policy", get_memory().radix_eviction_policy, "lru")
    _expect("enable_overlap", scheduler.enable_overlap, False)
    _expect("context_len", scheduler.model_config.context_len, cfg["max_model_len"])
    _expect("the free tokens of a new pool", scheduler.token_to_kv_pool_allocator.available_size(),
            cfg["num_gpu_blocks"] * cfg["block_size"])
    ratio = scheduler.new_token_ratio_tracker
    _expect("init_new_token_ratio", ratio.init, min(0.7 * cfg["schedule_conservativeness"], 1.0))
    _expect("min_new_token_ratio", ratio.min, min(ratio.init * 0.14, 1.0))
    return scheduler


# ------------------------------------------------------------------ the run


class Run:
    """One workload through ``event_loop_normal``'s turns, with the fake model."""

    def __init__(self, workload: dict[str, Any], model_dir: str, events_dir: str) -> None:
        self.cfg = workload["config"]
        self.max_steps = workload["max_steps"]
        self.scheduler = build_scheduler(self.cfg, model_dir, events_dir)
        self.requests = workload["requests"]
        # SGLang aborts every rid that STARTS WITH the aborted one: give it ids that are not prefixes of each other
        self.inner = {req["id"]: f"kvemu-{index}." for index, req in enumerate(self.requests)}
        self.outer = {inner: rid for rid, inner in self.inner.items()}
        self.specs = {self.inner[req["id"]]: req for req in self.requests}
        self.reported: set[str] = set()

    def _tokenized(self, spec: dict[str, Any]) -> Any:
        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=len(spec["output"]), ignore_eos=self.cfg["ignore_eos"],
                                temperature=0.0)
        params.normalize(None)
        params.verify(VOCAB_SIZE)
        return TokenizedGenerateReqInput(
            rid=self.inner[spec["id"]], input_text=None, input_ids=array("q", spec["prompt"]), input_embeds=None,
            mm_inputs=None, token_type_ids=None, sampling_params=params, return_logprob=False,
            logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False)

    def _plan_samples(self, batch: Any) -> None:
        NEXT_TOKENS = sglang_stubs.NEXT_TOKENS
        NEXT_TOKENS.clear()
        for req in batch.reqs:
            output = self.specs[req.rid]["output"]
            index = len(req.output_ids)
            if index >= len(output):
                raise RuntimeError(f"request {self.outer[req.rid]} samples generated token #{index}, past its "
                                   f"output list of {len(output)}")
            NEXT_TOKENS.append(output[index])

    def _held(self) -> set[str]:
        """The rids the scheduler holds: waiting, running, in chunked prefill, or in the last (extend) batch,
        which ``event_loop_normal`` merges into the running batch at the next turn."""
        s = self.scheduler
        held = [*s.waiting_queue, *s.running_batch.reqs]
        if s.chunked_req is not None:
            held.append(s.chunked_req)
        if s.last_batch is not None:
            held.extend(s.last_batch.reqs)
        return {req.rid for req in held if not req.finished()}

    def run(self) -> list[dict[str, Any]]:
        s = self.scheduler
        arrivals: dict[int, list[dict[str, Any]]] = {}
        aborts: dict[int, list[str]] = {}
        for req in self.requests:
            arrivals.setdefault(req.get("arrive_step", 0), []).append(req)
            if req.get("abort_step") is not None:
                aborts.setdefault(req["abort_step"], []).append(req["id"])
        last_event = max([*arrivals, *aborts], default=-1)
        known: dict[str, Any] = {}  # SGLang rid -> its Req, once it is in the scheduler
        records: list[dict[str, Any]] = []
        for step in range(self.max_steps):
            if step > last_event and not self._held():
                break
            finished: list[list[str]] = []
            if step in arrivals:
                s.process_input_requests([self._tokenized(spec) for spec in arrivals[step]])
                for req in s.waiting_queue:
                    known.setdefault(req.rid, req)
                for spec in arrivals[step]:
                    if self.inner[spec["id"]] not in known:
                        raise RuntimeError(f"SGLang did not queue request {spec['id']}")
            for rid in aborts.get(step, ()):
                from sglang.srt.managers.io_struct import AbortReq

                s.process_input_requests([AbortReq(rid=self.inner[rid])])
            held = self._held()
            for inner in known:  # aborted while waiting: SGLang dropped it from its queue
                if step in aborts and inner not in self.reported and inner not in held:
                    self.reported.add(inner)
                    finished.append([self.outer[inner], "abort"])
            waiting = {req.rid for req in s.waiting_queue}
            retracted_before = len(RETRACTED)
            record: dict[str, Any] = {"step": step, "idle": True, "schedule_called": True, "mode": None,
                                      "scheduled": [], "admitted": [], "preempted": []}
            batch = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
            if hasattr(batch, "batch_to_run"):  # 0.5.23 returns a plan: the batch and the new running batch
                s.running_batch = batch.running_batch
                batch = batch.batch_to_run
            record["preempted"] = [self.outer[rid] for rid in RETRACTED[retracted_before:]]
            if batch is not None:
                record["idle"] = False
                mode = batch.forward_mode
                record["mode"] = "mixed" if mode.is_mixed() else "extend" if mode.is_extend() else "decode"
                for index, req in enumerate(batch.reqs):
                    if mode.is_extend():
                        record["scheduled"].append([self.outer[req.rid], int(batch.extend_lens[index])])
                        if req.rid in waiting:
                            record["admitted"].append([self.outer[req.rid], int(batch.prefix_lens[index])])
                    else:
                        record["scheduled"].append([self.outer[req.rid], 1])
                self._plan_samples(batch)
                result = s.run_batch(batch)
                s.process_batch_result(batch, result)
            else:
                s._sched_idled = True
                s.on_idle()
            s.last_batch = batch
            for inner, req in known.items():
                if inner not in self.reported and req.finished():
                    self.reported.add(inner)
                    reason = FINISH_REASONS.get(type(req.finished_reason).__name__)
                    if reason is None:
                        raise RuntimeError(f"unexpected finish reason {req.finished_reason!r}")
                    finished.append([self.outer[inner], reason])
            s.kv_events_publisher.publish_kv_events()
            record["finished"] = finished
            record["events"] = s.kv_events_publisher.kv_event_publisher.take()
            free = s.token_to_kv_pool_allocator.available_size()
            record["free_tokens"] = free
            record["free_blocks"] = free // self.cfg["block_size"]
            record["evictable_tokens"] = s.tree_cache.evictable_size()
            record["num_waiting"] = len(s.waiting_queue)
            record["num_running"] = len(self._held()) - record["num_waiting"]
            records.append(record)
        return records


# ------------------------------------------------------------------ the process


def _start(model_dir: str) -> None:
    sglang_stubs.install_import_stubs()
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"this driver pins SGLang {SGLANG_VERSION}; the interpreter has {sglang.__version__}")
    sglang_stubs.install_model_free_runner()
    _observe_retractions()
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(TINY_LLAMA, f)


def run_isolated(workload: dict[str, Any], work: str, index: int) -> list[dict[str, Any]]:
    """One workload's records, from a child forked after the imports: SGLang builds its parallel runtime once per
    process (a second ``Scheduler`` raises "init_parallel_runtime() ran twice"), so each workload gets a fresh
    process that shares the ~15 s of imports. A ``WorkloadError`` in the child is raised again here."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, send the outcome as one JSON document, leave without cleanup
        os.close(read_end)
        code = 0
        try:
            events_dir = os.path.join(work, f"events-{index}")
            os.mkdir(events_dir)
            outcome: dict[str, Any] = {"records": Run(workload, work, events_dir).run()}
        except WorkloadError as exc:
            outcome = {"refused": str(exc)}
        except BaseException:  # noqa: BLE001  (reported to the parent, which fails)
            import traceback

            outcome = {"crashed": traceback.format_exc()}
            code = 1
        with os.fdopen(write_end, "w", encoding="utf-8") as pipe:
            json.dump(outcome, pipe)
        sys.stderr.flush()
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, encoding="utf-8") as pipe:
        raw = pipe.read()
    _, status = os.waitpid(pid, 0)
    try:
        outcome = json.loads(raw)
    except ValueError:
        raise RuntimeError(f"the workload's process died (wait status {status}) without an answer") from None
    if "refused" in outcome:
        raise WorkloadError(outcome["refused"])
    if "crashed" in outcome:
        raise RuntimeError(f"the workload's process failed:\n{outcome['crashed']}")
    return outcome["records"]


def main(argv: list[str]) -> int:
    _setup_environment()
    return driver_main(argv, "sglang_driver", _check_workload, _start, run_isolated)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
