"""kvemu's engine cores driven step by step with an oracle workload: the records ``vllm_driver.py`` writes (the vLLM
flavour, ``run_kvemu``) and those ``sglang_driver.py`` writes (the SGLang flavour, ``run_kvemu_sglang``).

A step is one ``schedule()`` of the oracle: requests whose ``arrive_step`` is ``k`` are added (and those whose
``abort_step`` is ``k`` aborted) just before step ``k``, which then runs one forward pass at the end of the last
one (virtual time only orders things here; the oracle compares decisions, never durations). A step with nothing
to schedule is an empty record, as the oracle's idle ``schedule()`` is.
"""

from __future__ import annotations

from typing import Any

from kvemu.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvemu.wire.vllm_hashes import VllmHashes
from workers.config import EngineConfig, SglangConfig, SglangSemantics, VllmConfig, VllmSemantics
from workers.request import Request
from workers.results import StepResult
from workers.sglang.engine import SglangEngineCore
from workers.vllm.engine import VllmEngineCore

Record = dict[str, Any]


def engine_config(config: dict[str, Any], semantics: VllmSemantics = "vllm-0.34") -> EngineConfig:
    """The kvemu engine an oracle workload's vLLM configuration maps to, under ``semantics``.

    vLLM keeps block 0 of its pool as a null block nobody holds: under vllm-0.34 semantics kvemu does too; under
    Dynamo's (whose pool has no null block) the pool is given one block fewer, so both have as many to use."""
    fcfs = config.get("policy", "fcfs") == "fcfs"
    return EngineConfig(
        backend="vllm",
        num_gpu_blocks=config["num_gpu_blocks"] - (semantics == "dynamo"),
        block_size=config["block_size"],
        max_num_seqs=config["max_num_seqs"],
        max_num_batched_tokens=config["max_num_batched_tokens"],
        enable_prefix_caching=config["enable_prefix_caching"],
        enable_chunked_prefill=config["enable_chunked_prefill"],
        preemption_mode="lifo",
        record_token_times=False,
        vllm=VllmConfig(semantics=semantics, scheduling_policy="fcfs" if fcfs else "priority",
                        async_scheduling=bool(config.get("async_scheduling")) and semantics != "dynamo"),
    )


def _events(res_events: Any, vllm_hashes: VllmHashes | None) -> list[list[Any]]:
    if res_events is None:
        return []
    out: list[list[Any]] = []
    events = res_events.batch().events
    for ev in vllm_hashes.events(events) if vllm_hashes is not None else events:
        if isinstance(ev, BlockStored):
            out.append(["stored", list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids), ev.block_size])
        elif isinstance(ev, BlockRemoved):
            out.append(["removed", list(ev.block_hashes)])
        elif isinstance(ev, AllBlocksCleared):
            out.append(["cleared"])
    return out


def _by_step(workload: dict[str, Any]) -> tuple[dict[int, list[dict[str, Any]]], dict[int, list[str]], int]:
    """The workload's requests by the step they arrive at, its aborts by step, and the last arrival's step."""
    by_arrival: dict[int, list[dict[str, Any]]] = {}
    by_abort: dict[int, list[str]] = {}
    for r in workload["requests"]:
        by_arrival.setdefault(r["arrive_step"], []).append(r)
        if r.get("abort_step") is not None:
            by_abort.setdefault(r["abort_step"], []).append(r["id"])
    return by_arrival, by_abort, max(by_arrival, default=-1)


def run_kvemu(workload: dict[str, Any], semantics: VllmSemantics = "vllm-0.34", hashes: str = "kvemu") -> list[Record]:
    """Every step's record of kvemu's vLLM flavour, under ``semantics``, on ``workload`` (the oracle's input); its
    events carry kvemu's block hashes, or (``hashes="vllm-0.34"``) vLLM's, as a worker publishes them."""
    vllm_hashes = VllmHashes() if hashes == "vllm-0.34" else None
    config = workload["config"]
    cfg = engine_config(config, semantics)
    eng = VllmEngineCore(cfg)
    by_arrival, by_abort, last_arrival = _by_step(workload)
    records: list[Record] = []
    now = 0
    lagging: list[list[str]] = []  # async: a last token is read, and its request reported, one step later
    for k in range(workload.get("max_steps", 100_000)):
        finished: list[list[str]] = []
        for r in by_arrival.get(k, ()):
            eng.add_request(Request(request_id=r["id"], token_ids=r["prompt"], max_tokens=len(r["output"]),
                                    arrival_ns=now, priority=r.get("priority", 0),
                                    output_token_ids=r["output"]))
        for rid in by_abort.get(k, ()):
            unread = [rid, "length"] in lagging  # async: its last token is not read yet, so the abort wins
            if eng.abort(rid) is not None or unread:
                finished.append([rid, "abort"])
            if unread:
                lagging.remove([rid, "length"])
        finished += lagging
        lagging = []
        done = eng.num_unfinished == 0 and k > last_arrival and not eng.scheduler.finishing
        if done and not finished:
            break
        start = eng.next_pass_start_ns()
        rec: Record = {"step": k, "scheduled": [], "admitted": [], "preempted": [], "finished": finished,
                       "events": []}
        if start is not None and not done:
            res = eng.step(max(start, now))
            now = res.end_ns
            rec["scheduled"] = [[rid, n] for rid, n in res.scheduled]
            rec["admitted"] = [[rid, hit] for rid, hit in res.admitted_hits]
            rec["preempted"] = list(res.preempted)
            ends = [[r.request_id, "length"] for r in res.completed]
            if cfg.vllm.async_scheduling:
                lagging = ends
            else:
                rec["finished"] += ends
            rec["events"] = _events(res.events, vllm_hashes)
        rec["free_blocks"] = eng.pool.available
        rec["num_waiting"] = eng.num_waiting
        rec["num_running"] = eng.num_running
        records.append(rec)
    return records


# ------------------------------------------------------------------ the SGLang flavour, as sglang_driver.py records it


def sglang_engine_config(config: dict[str, Any], semantics: SglangSemantics = "dynamo") -> EngineConfig:
    """The kvemu SGLang-flavour engine an oracle workload's configuration maps to under ``semantics``
    (sglang_driver.py's mapping: ``block_size`` is the page, the pool holds ``num_gpu_blocks`` pages,
    ``max_num_batched_tokens`` is the prefill budget and, with chunked prefill, the chunk size; without it,
    Dynamo's mocker, which always chunks, gets a chunk as large as the pool)."""
    budget = config["max_num_batched_tokens"]
    pool = config["num_gpu_blocks"] * config["block_size"]
    exact = semantics != "dynamo"
    return EngineConfig(
        backend="sglang",
        num_gpu_blocks=config["num_gpu_blocks"],
        block_size=config["block_size"],
        max_num_seqs=config["max_num_seqs"],
        max_num_batched_tokens=max(budget, pool),
        enable_prefix_caching=config["enable_prefix_caching"],
        enable_chunked_prefill=config["enable_chunked_prefill"] or not exact,
        record_token_times=False,
        sglang=SglangConfig(semantics=semantics, schedule_policy="lpm" if config.get("policy") == "lpm" else "fifo",
                            max_prefill_tokens=budget,
                            chunked_prefill_size=budget if config["enable_chunked_prefill"] else pool,
                            schedule_conservativeness=config.get("schedule_conservativeness", 1.0)),
    )


class _Recorded(SglangEngineCore):
    """The SGLang-flavour core, keeping each planned pass for the records (its chunks, batch and retractions)."""

    last: Any = None

    def _step_result(self, p: Any) -> StepResult:
        self.last = p
        return super()._step_result(p)


def run_kvemu_sglang(workload: dict[str, Any], semantics: SglangSemantics = "dynamo") -> list[Record]:
    """Every step's record of kvemu's SGLang flavour on ``workload``, in sglang_driver.py's shape: ``mode``,
    ``scheduled`` (extend lengths, or 1 to decode), ``admitted`` (requests taken from the waiting queue, with
    their prefix hit; a request's later chunks are not admissions, as SGLang holds it as its chunked request),
    ``preempted`` (retracted), ``finished``, ``free_tokens`` (free and evictable: kvemu's pool does not tell
    them apart the way SGLang's allocator does), ``num_waiting`` and ``num_running`` (a half-prefilled request
    runs, as SGLang's chunked request does, and so does an aborted one that has not left yet). An idle step takes
    a nanosecond (SGLang's scheduler idles through it). ``semantics``: whose decisions kvemu's flavour takes."""
    config = workload["config"]
    eng = _Recorded(sglang_engine_config(config, semantics))
    page = config["block_size"]
    by_arrival, by_abort, last_arrival = _by_step(workload)
    records: list[Record] = []
    chunking: set[str] = set()
    leaving: list[str] = []  # aborted while running, reported when they leave (as SGLang reports them)
    now = 0
    for k in range(workload.get("max_steps", 100_000)):
        finished: list[list[str]] = []
        for r in by_arrival.get(k, ()):
            eng.add_request(Request(request_id=r["id"], token_ids=r["prompt"], max_tokens=len(r["output"]),
                                    arrival_ns=now, output_token_ids=r["output"]))
        for rid in by_abort.get(k, ()):
            if eng.abort(rid) is not None:
                chunking.discard(rid)
                if any(s.rid == rid for s in eng.running):  # (sglang-0.5.23: it leaves after its next decode pass)
                    leaving.append(rid)
                else:
                    finished.append([rid, "abort"])
        if eng.num_unfinished == 0 and k > last_arrival and not leaving:
            break
        rec: Record = {"step": k, "mode": None, "scheduled": [], "admitted": [], "preempted": [],
                       "finished": finished, "events": []}
        start = eng.next_pass_start_ns()
        if start is None:
            now += 1
        else:
            eng.last = None
            res = eng.step(max(start, now))
            now = res.end_ns
            p = eng.last
            if p is not None and p.chunks:
                rec["mode"] = "extend"
                rec["scheduled"] = [[c.seq.rid, c.end - c.prefix] for c in p.chunks]
                rec["admitted"] = [[c.seq.rid, c.prefix] for c in p.chunks if c.seq.rid not in chunking]
                chunking = {c.seq.rid for c in p.chunks if not c.final}
            elif p is not None and p.decode:
                rec["mode"] = "decode"
                rec["scheduled"] = [[s.rid, 1] for s in p.decode]
            rec["preempted"] = list(res.preempted)
            rec["finished"] += [[r.request_id, "length"] for r in res.completed]
            rec["events"] = _events(res.events, None)
            left = [rid for rid in leaving if all(s.rid != rid for s in eng.running)]
            rec["finished"] += [[rid, "abort"] for rid in left]
            leaving = [rid for rid in leaving if rid not in left]
        cache = eng.cache
        rec["free_tokens"] = (cache.capacity - cache.owned - cache.locked) * page
        rec["num_waiting"] = sum(1 for s in eng.waiting if not s.computed) + len(eng.future)
        rec["num_running"] = len(eng.running) + sum(1 for s in eng.waiting if s.computed)
        records.append(rec)
    return records
