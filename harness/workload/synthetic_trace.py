"""A deterministic trace in the Mooncake conversation trace's format, shaped like the real one.

For a machine without the one-hour production trace (a fresh clone, a user trying kvemu): every row has
``timestamp`` (ms, whole seconds as in the original), ``input_length``, ``output_length`` and ``hash_ids``
(one id per 512-token block). Like the real trace's opening minutes, about 3.4 rows arrive a second, every
prompt starts with one shared system-prompt block, prompts run from a few blocks to a few hundred (median
about 14, mean about 24), outputs average about 350 tokens, and about a third of the rows continue an
earlier conversation: they repeat most of its prompt (its leading blocks) and add new blocks, one to a few
minutes later. The same ``seed`` always gives the same bytes.
"""

from __future__ import annotations

import json
import math
import random
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

__all__ = ["synthetic_rows", "iter_synthetic_rows", "write_synthetic_trace", "MAX_SYNTHETIC_ROWS", "TRACE_BLOCK_SIZE"]

TRACE_BLOCK_SIZE = 512
ROWS_PER_S = 3.4
FOLLOW_UP_SHARE = 0.33
MAX_BLOCKS = 256  # the real trace's longest prompt is 247 blocks
MAX_SYNTHETIC_ROWS = 1_000_000
"""Most rows ``kvemu trace synth`` writes (the real trace has 12,031; a million take about a minute)."""


class SyntheticRow(TypedDict):
    """One Mooncake-format trace row."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


def synthetic_rows(rows: int, *, seed: int = 0) -> list[SyntheticRow]:
    """``rows`` trace rows in arrival order, a function of ``seed`` alone."""
    return list(iter_synthetic_rows(rows, seed=seed))


def iter_synthetic_rows(rows: int, *, seed: int = 0) -> Iterator[SyntheticRow]:
    """``synthetic_rows`` one at a time (memory stays flat however many rows)."""
    rng = random.Random(seed)
    next_id = 1  # id 0 is the system prompt every row starts with
    t_s = 0.0
    recent: deque[SyntheticRow] = deque(maxlen=400)  # the rows a follow-up may continue
    for _ in range(rows):
        now_ms = int(t_s) * 1000  # the first row at 0, as in the real trace
        t_s += rng.expovariate(ROWS_PER_S)
        earlier = [r for r in recent if 45_000 <= now_ms - int(r["timestamp"]) <= 300_000]
        if earlier and rng.random() < FOLLOW_UP_SHARE / 0.9:  # ~10 % of rows find no conversation to continue
            parent: list[int] = rng.choice(earlier)["hash_ids"]
            kept = max(2, math.ceil(len(parent) * rng.uniform(0.6, 1.0)))
            fresh = 1 + int(rng.expovariate(1 / 4))
            prefix = parent[:kept]
        else:
            fresh = min(MAX_BLOCKS - 1, max(1, round(rng.lognormvariate(math.log(13), 1.0))))
            prefix = [0]
        fresh = min(fresh, MAX_BLOCKS - len(prefix))
        hash_ids = prefix + list(range(next_id, next_id + fresh))
        next_id += fresh
        input_length = (len(hash_ids) - 1) * TRACE_BLOCK_SIZE + rng.randint(1, TRACE_BLOCK_SIZE)
        output_length = rng.randint(1, 12) if rng.random() < 0.05 else min(2000, max(1, round(rng.gauss(350, 140))))
        row: SyntheticRow = {"timestamp": now_ms, "input_length": input_length, "output_length": output_length,
                             "hash_ids": hash_ids}
        recent.append(row)
        yield row


def write_synthetic_trace(path: Path, rows: int = 3000, *, seed: int = 0) -> Path:
    """Write ``synthetic_rows(rows, seed=seed)`` as JSON lines to ``path``, row by row; returns ``path``."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in iter_synthetic_rows(rows, seed=seed))
    return path
