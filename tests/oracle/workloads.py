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
