"""Oracle workloads: requests with shared prefixes, KV pressure, chunked prefill, aborts, priorities and max-token ends.

A workload is plain JSON (the oracle runs in another interpreter): ``config`` (vLLM's scheduling settings) and
``requests`` (prompt and output token ids, the step each arrives at, an optional abort step and a priority).
Every request fits the pool on its own, so no workload can lock an engine that schedules correctly.
"""

from __future__ import annotations

import random
from typing import Any

VOCAB = 32_000
"""Token ids stay below the oracle model's vocabulary size."""


def generate(seed: int, *, pressure: bool | None = None, priority: bool | None = None,
             chunked: bool | None = None, n_requests: int | None = None) -> dict[str, Any]:
    """One workload drawn from ``seed`` (a ``None`` knob is drawn too)."""
    rng = random.Random(seed)
    bs = 16
    pressure = rng.random() < 0.6 if pressure is None else pressure
    priority = rng.random() < 0.25 if priority is None else priority
    chunked = rng.random() < 0.85 if chunked is None else chunked
    n = n_requests or rng.randint(4, 40)
    max_seqs = rng.randint(2, 16)
    blocks = rng.randint(24, 64) if pressure else rng.randint(160, 400)
    max_model_len = min(2048, (blocks - 1) * bs)
    budget = rng.choice([32, 64, 96, 128, 256, 512])
    if not chunked:
        budget = max(budget, max_model_len)  # vLLM requires it without chunked prefill
    budget = max(budget, max_seqs)
    cap = min(max_model_len, (blocks - 1) * bs // 2)  # every request fits the pool alone, with room to spare
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(bs * rng.randint(1, 6))] for _ in range(rng.randint(1, 4))]
    requests = []
    step = 0
    for i in range(n):
        step += rng.choice([0, 0, 0, 1, 1, 2, 3, 5, 8])
        prefix = rng.choice(prefixes) if rng.random() < 0.7 else []
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 3 * bs))]
        prompt = (prefix + tail)[: max(1, cap - 2)]
        out_len = rng.randint(1, max(1, min(48, cap - len(prompt))))
        req: dict[str, Any] = {
            "id": f"r{i}",
            "prompt": prompt,
            "output": [rng.randrange(1, VOCAB) for _ in range(out_len)],
            "arrive_step": step,
            "priority": rng.randint(0, 2) if priority else 0,
            "abort_step": step + rng.randint(0, 12) if rng.random() < 0.1 else None,
        }
        requests.append(req)
    config = {
        "block_size": bs,
        "num_gpu_blocks": blocks,
        "max_num_seqs": max_seqs,
        "max_num_batched_tokens": budget,
        "enable_chunked_prefill": chunked,
        "enable_prefix_caching": rng.random() < 0.9,
        "policy": "priority" if priority else "fcfs",
        "async_scheduling": False,
        "max_model_len": max_model_len,
        "long_prefill_token_threshold": 0,
    }
    return {"config": config, "requests": requests, "max_steps": 20_000}


def generate_sglang(seed: int, *, pressure: bool | None = None, aborts: bool = True,
                    n_requests: int | None = None) -> dict[str, Any]:
    """One SGLang oracle workload drawn from ``seed``: 1-token pages, fcfs or lpm, chunked prefill or not, prefix
    caching mostly on, some aborts (unless ``aborts`` is false); ``pressure`` makes the pool small enough that
    admission meets its KV check and decode runs out of pages (retraction).

    ``ignore_eos`` is off, as kvemu models SGLang (admission reserves a share of each running request's remaining
    output, not all of it); no output token is SGLang's EOS id (2), so every request still runs to its length."""
    rng = random.Random(seed)
    pressure = rng.random() < 0.4 if pressure is None else pressure
    n = n_requests or rng.randint(4, 40)
    pool = rng.randint(160, 480) if pressure else rng.randint(2000, 6000)
    chunked = rng.random() < 0.8
    budget = rng.choice([32, 64, 96, 128, 256, 512])
    if not chunked:
        budget = pool  # as vLLM requires without chunking (the budget's boundary is a difference of its own)
    caching = rng.random() < 0.9
    cap = pool // 2  # every request fits the pool alone, with room to spare
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(8, 96))] for _ in range(rng.randint(1, 4))]
    requests = []
    step = 0
    for i in range(n):
        step += rng.choice([0, 0, 0, 1, 1, 2, 3, 5, 8])
        prefix = rng.choice(prefixes) if rng.random() < 0.7 else []
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 48))]
        prompt = (prefix + tail)[: max(1, cap - 2)]
        out_len = rng.randint(1, max(1, min(48, cap - len(prompt))))
        requests.append({
            "id": f"r{i}", "prompt": prompt, "output": [rng.randrange(3, VOCAB) for _ in range(out_len)],
            "arrive_step": step, "priority": 0,
            "abort_step": step + rng.randint(0, 12) if rng.random() < 0.1 and aborts else None,
        })
    config = {
        "block_size": 1, "num_gpu_blocks": pool, "max_num_seqs": rng.randint(2, 16), "max_num_batched_tokens": budget,
        "enable_chunked_prefill": chunked, "enable_prefix_caching": caching,
        "policy": "lpm" if caching and rng.random() < 0.5 else "fcfs", "async_scheduling": False,
        "max_model_len": pool, "long_prefill_token_threshold": 0, "ignore_eos": False,
    }
    return {"config": config, "requests": requests, "max_steps": 20_000}


def generate_retracting(seed: int) -> dict[str, Any]:
    """An SGLang workload drawn from ``seed`` that runs decode out of pages: short prompts with shared prefixes,
    long outputs arriving close together on a small pool (SGLang reserves only ``new_token_ratio`` of a running
    request's remaining output, so they are admitted together and retracted once they outgrow the pool)."""
    rng = random.Random(seed)
    pool = rng.randint(96, 320)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 16))] for _ in range(2)]
    requests = []
    step = 0
    for i in range(rng.randint(4, 24)):
        step += rng.choice([0, 0, 1, 1, 2, 4])
        prompt = (rng.choice(prefixes) if rng.random() < 0.5 else []) + [rng.randrange(3, VOCAB)
                                                                          for _ in range(rng.randint(1, 12))]
        requests.append({
            "id": f"r{i}", "prompt": prompt,
            "output": [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, pool // 16) if rng.random() < 0.5
                                                                else rng.randint(pool // 4, pool // 2 - 16))],
            "arrive_step": step, "priority": 0,
            "abort_step": step + rng.randint(0, 40) if rng.random() < 0.1 else None,
        })
    chunked = rng.random() < 0.8
    config = {
        "block_size": 1, "num_gpu_blocks": pool, "max_num_seqs": rng.randint(3, 16),
        "max_num_batched_tokens": rng.choice([16, 32, 64]) if chunked else pool, "enable_chunked_prefill": chunked,
        "enable_prefix_caching": rng.random() < 0.9, "policy": "fcfs", "async_scheduling": False,
        "max_model_len": pool, "long_prefill_token_threshold": 0, "ignore_eos": False,
    }
    if config["enable_prefix_caching"] and rng.random() < 0.5:
        config["policy"] = "lpm"
    config["schedule_conservativeness"] = rng.choice([1.0, 0.5, 0.3])  # below 1: bolder admissions, more retractions
    return {"config": config, "requests": requests, "max_steps": 20_000}


def from_mooncake(path: str, first: int, count: int, *, seed: int = 0, trace_block_size: int = 32,
                  max_prompt: int = 480, max_output: int = 32, blocks: int = 96) -> dict[str, Any]:
    """``count`` rows of a Mooncake-format trace from row ``first``, shrunk to an oracle-sized pool.

    Each hash id stands for ``trace_block_size`` copies of one token (the trace format's own synthesis, with the
    id folded below the vocabulary), so rows that share hash ids share prefixes; lengths shrink by the ratio of
    block sizes (512 -> ``trace_block_size``), prompts are capped at ``max_prompt`` and outputs at ``max_output``
    tokens, and ``blocks`` of 16 tokens hold a few of them at once (KV pressure); arrivals keep the rows' order and
    spacing, one step per 100 ms."""
    import json

    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= first + count:
                break
            if i >= first:
                rows.append(json.loads(line))
    rng = random.Random(seed)
    scale = trace_block_size / 512
    t0 = rows[0].get("timestamp", 0) if rows else 0
    requests = []
    for i, row in enumerate(rows):
        tokens = [1 + h % (VOCAB - 1) for h in row["hash_ids"] for _ in range(trace_block_size)]
        n_in = max(1, min(len(tokens), max_prompt, round(row["input_length"] * scale)))
        n_out = max(1, min(max_output, round(row["output_length"] * scale)))
        requests.append({
            "id": f"m{first + i}",
            "prompt": tokens[:n_in],
            "output": [rng.randrange(1, VOCAB) for _ in range(n_out)],
            "arrive_step": int((row.get("timestamp", t0) - t0) // 100),
            "priority": 0,
            "abort_step": None,
        })
    config = {"block_size": 16, "num_gpu_blocks": blocks, "max_num_seqs": 16, "max_num_batched_tokens": 256,
              "enable_chunked_prefill": True, "enable_prefix_caching": True, "policy": "fcfs",
              "async_scheduling": False, "max_model_len": max_prompt + max_output,
              "long_prefill_token_threshold": 0}
    return {"config": config, "requests": requests, "max_steps": 20_000}
