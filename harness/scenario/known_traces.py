"""Traces kvemu's examples name but do not ship, where each comes from, and how to stand in for one that is
missing (``kvemu trace synth``): what a missing-trace error tells a user."""

from __future__ import annotations

from pathlib import Path

__all__ = ["MOONCAKE_CONVERSATION_URL", "MOONCAKE_CONVERSATION_ROWS", "missing_trace_hint"]

MOONCAKE_CONVERSATION_URL = ("https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/"
                             "conversation_trace.jsonl")
"""The Mooncake project's public conversation trace (FAST'25; Apache-2.0): the one-hour trace of the examples."""
MOONCAKE_CONVERSATION_ROWS = 12_031
"""Its rows (about 3,540 s of arrivals); a stand-in of as many rows spans as long."""
_MOONCAKE_NAMES = frozenset({"mooncake_conversation_trace.jsonl", "conversation_trace.jsonl"})
_SYNTHESIZABLE = frozenset({"auto", "mooncake"})
"""Formats a generated Mooncake-format trace can stand in for."""
_STAND_IN = "mooncake-standin.jsonl"


def missing_trace_hint(path: Path, fmt: str = "auto") -> str:
    """What to do about a trace file that is not at ``path`` (read as ``fmt``): where the real one comes from when
    kvemu knows it, and the commands that generate a stand-in and run on it; "" when no stand-in fits."""
    if fmt not in _SYNTHESIZABLE:
        return ""
    use = f"kvemu trace synth {_STAND_IN} --rows {{rows}}, then add --set workload.trace={_STAND_IN} to the command"
    if path.name in _MOONCAKE_NAMES:
        return (f". It is the Mooncake conversation trace (FAST'25, Apache-2.0), which kvemu does not ship: download "
                f"it there (curl -L --create-dirs -o {path} {MOONCAKE_CONVERSATION_URL}), or run on a generated "
                "stand-in of the same shape (Mooncake rows with shared hash_ids prefixes, arrivals and lengths like "
                "the real trace's, not its figures): " + use.format(rows=MOONCAKE_CONVERSATION_ROWS))
    return ". To try the scenario on a generated Mooncake-format trace instead: " + use.format(rows=3000)
