"""A small deterministic corpus of agent plays as an Agentic Mooncake v2 trace (``examples/agentic-lanes.yaml``).

Each play is one agent run: a main conversation of several turns, each turn's prompt extending the last one's
(the previous prompt, the reply, a tool result), separated by think and tool times (sequence edges with a
delay). Some turns fan out sub-agents: conversations of their own, spawned when the turn is sent, starting
from the play's system prompt; blocking ones are joined by the main conversation's next turn. Every play starts
with the same system-prompt blocks. The same ``seed`` always gives the same bytes.

    python -m harness.workload.agentic_corpus examples/traces/agentic-lanes-corpus.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from harness.workload.traces.agentic_v2 import SCHEMA

__all__ = ["corpus_rows", "write_corpus", "main"]

BLOCK_SIZE = 64
SYSTEM_BLOCKS = 16


def corpus_rows(plays: int = 8, seed: int = 31) -> list[dict[str, Any]]:
    """The header and the request rows of ``plays`` agent runs."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = [{"schema": SCHEMA, "version": 2, "block_size": BLOCK_SIZE, "hash_id_scope": "local",
                                   "source": {"format": "kvemu-synthetic", "digest": f"agentic-corpus:{plays}:{seed}"}}]
    next_id = [SYSTEM_BLOCKS]

    def fresh(n: int) -> list[int]:
        ids = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return ids

    def row(rid: str, play: str, session: str, ids: list[int], deps: list[tuple[str, str, str, float]],
            osl: int) -> dict[str, Any]:
        r: dict[str, Any] = {"request_id": rid, "play_id": play, "session_id": session, "model": "agent",
                             "input_length": len(ids) * BLOCK_SIZE - rng.randrange(BLOCK_SIZE), "output_length": osl,
                             "hash_ids": ids, "not_before_ms": 0}
        if deps:
            r["dependencies"] = [{"request_id": d, "trigger": t, "relation": rel, "delay_ms": ms}
                                 for d, t, rel, ms in deps]
        return r

    system = list(range(SYSTEM_BLOCKS))
    for p in range(plays):
        play = f"play-{p}"
        main = f"{play}:main"
        prompt = system + fresh(rng.randint(4, 12))
        joins: list[str] = []
        prev: str | None = None
        for t in range(rng.randint(4, 7)):
            rid = f"{play}:main:t{t}"
            deps: list[tuple[str, str, str, float]] = []
            if prev is not None:
                deps.append((prev, "completion", "sequence", round(rng.uniform(1_000, 15_000), 3)))  # think + tool
            deps += [(j, "completion", "join", 0.0) for j in joins]
            joins = []
            rows.append(row(rid, play, main, prompt, deps, rng.randint(40, 400)))
            if t and rng.random() < 0.5:  # sub-agents, spawned when the turn is sent
                for a in range(rng.randint(1, 3)):
                    session = f"{play}:agent:t{t}:{a}"
                    sub = system + fresh(rng.randint(2, 6))
                    sprev = rid
                    for k in range(rng.randint(1, 3)):
                        srid = f"{session}:t{k}"
                        dep = ((sprev, "dispatch", "spawn", round(rng.uniform(200, 2_000), 3)) if k == 0 else
                               (sprev, "completion", "sequence", round(rng.uniform(500, 5_000), 3)))
                        rows.append(row(srid, play, session, sub, [dep], rng.randint(20, 200)))
                        sub = sub + fresh(rng.randint(1, 4))
                        sprev = srid
                    if rng.random() < 0.7:  # blocking: the next main turn waits for it
                        joins.append(sprev)
            prompt = prompt + fresh(rng.randint(2, 8))  # the reply and the tool result
            prev = rid
        # a last turn joins what is still blocking
        if joins and prev is not None:
            rows.append(row(f"{play}:main:final", play, main, prompt,
                            [(prev, "completion", "sequence", 500.0)] + [(j, "completion", "join", 0.0) for j in joins],
                            rng.randint(40, 200)))
    return rows


def write_corpus(path: Path, plays: int = 8, seed: int = 31) -> int:
    """Write the corpus as JSON Lines; returns the number of requests."""
    rows = corpus_rows(plays, seed)
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
    return len(rows) - 1


def main(argv: list[str]) -> None:
    """``python -m harness.workload.agentic_corpus [PATH]``: write the example corpus (by default where
    ``examples/agentic-lanes.yaml`` reads it)."""
    out = Path(argv[0] if argv else "examples/traces/agentic-lanes-corpus.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{out}: {write_corpus(out)} requests")


if __name__ == "__main__":
    main(sys.argv[1:])
