"""Step-by-step comparison of two engines' records (kvemu's and the oracle's) on one workload.

Block hashes differ between engines unless kvemu hashes the vLLM way, so events are compared by what each block
holds: a stored block is named by its whole token prefix (the chain of its parents' tokens and its own), which both
engines agree on whatever their hash function. A removal is named by the block it removes.
"""

from __future__ import annotations

from typing import Any

Record = dict[str, Any]
FIELDS = ("scheduled", "admitted", "preempted", "finished", "events", "free_blocks", "num_waiting", "num_running")


class Blocks:
    """Names blocks by content: one name per token prefix, shared by both sides of a comparison."""

    def __init__(self) -> None:
        self._names: dict[tuple[int, tuple[int, ...]], int] = {}

    def name(self, parent: int, tokens: list[int]) -> int:
        return self._names.setdefault((parent, tuple(tokens)), len(self._names) + 1)


def canonical(records: list[Record], blocks: Blocks) -> list[Record]:
    """``records`` with every event's hashes replaced by content names (0: no parent)."""
    by_hash: dict[Any, int] = {}
    out = []
    for rec in records:
        events = []
        for ev in rec.get("events", []):
            if ev[0] == "stored":
                _, hashes, parent, tokens, bs = ev
                prev = by_hash.get(parent, -1) if parent is not None else 0
                names = []
                for i, h in enumerate(hashes):
                    prev = blocks.name(prev, tokens[i * bs:(i + 1) * bs])
                    by_hash[h] = prev
                    names.append(prev)
                events.append(["stored", names])
            elif ev[0] == "removed":
                events.append(["removed", [by_hash.get(h, -1) for h in ev[1]]])
            else:
                events.append(list(ev))
        out.append({**rec, "events": events})
    return out


def _trimmed(records: list[Record]) -> list[Record]:
    """Without the trailing steps that decide nothing (vLLM's engine loop runs one more ``schedule()`` to report
    the last finished requests)."""
    n = len(records)
    while n and not any(records[n - 1].get(f) for f in ("scheduled", "preempted", "finished", "events")):
        n -= 1
    return records[:n]


def differences(ours: list[Record], theirs: list[Record], fields: tuple[str, ...] = FIELDS,
                limit: int = 5) -> list[str]:
    """The first ``limit`` differences, step by step and field by field (empty: the two agree throughout)."""
    blocks = Blocks()
    a, b = canonical(_trimmed(ours), blocks), canonical(_trimmed(theirs), blocks)
    found: list[str] = []
    for step in range(max(len(a), len(b))):
        if step >= len(a) or step >= len(b):
            found.append(f"step {step}: only {'the oracle' if step >= len(a) else 'kvemu'} has it "
                         f"({len(a)} steps vs the oracle's {len(b)})")
            break
        for field in fields:
            x, y = a[step].get(field), b[step].get(field)
            if field == "finished":
                x, y = sorted(x or []), sorted(y or [])
            if x != y:
                found.append(f"step {step} {field}: kvemu {x!r} vs the oracle {y!r}")
        if len(found) >= limit:
            break
    return found[:limit]
