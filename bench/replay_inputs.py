"""What ``bench.replay`` replays, besides the example scenarios: the trace (found, cut to short prompts, or scaled
N times over into a file) and the GPU profile of its interpolated engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["MAX_SCALE", "ROOT", "SCALE_GAP_MS", "SCENARIO", "existing_trace", "scale_rows", "scaled_trace",
           "scenario_trace", "short_prompts", "write_bench_profile"]

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "examples" / "mooncake-3600s.yaml"


def short_prompts(trace: Path, max_input_tokens: int, rows: int | None, directory: Path | str) -> Path:
    """The trace's rows with at most ``max_input_tokens`` input tokens (the first ``rows`` of them), in a file."""
    out = Path(directory) / f"input-le-{max_input_tokens}.jsonl"
    kept = 0
    with trace.open() as src, out.open("w") as dst:
        for line in src:
            if rows is not None and kept >= rows:
                break
            if line.strip() and json.loads(line).get("input_length", 0) <= max_input_tokens:
                dst.write(line)
                kept += 1
    return out


MAX_SCALE = 16
SCALE_GAP_MS = 1000
"""``--scale``: each copy of the trace starts this long after the previous one's last timestamp."""


def scale_rows(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The trace's rows ``n`` times over: copy ``k`` (0 .. n-1) is every row, in order, its ``timestamp``
    shifted by ``k`` × (the rows' span + ``SCALE_GAP_MS``), each hash id by ``k`` × (the largest hash id + 1),
    and its ``session_id`` (if any) made distinct per copy (an integer shifted by ``k`` × (the largest + 1), a
    string suffixed ``@k``); copy 0 is the rows unchanged. Rows without a ``timestamp`` (a session's later
    turns, timed by their ``delay``) keep none. Copies never overlap, so sorted rows stay sorted."""
    if n < 1:
        raise ValueError(f"scale must be >= 1, not {n}")
    stamps = [row["timestamp"] for row in rows if row.get("timestamp") is not None]
    span = max(stamps) - min(stamps) if stamps else 0
    hash_stride = max((h for row in rows for h in row.get("hash_ids") or ()), default=-1) + 1
    int_sids = [row["session_id"] for row in rows if isinstance(row.get("session_id"), int)]
    sid_stride = max(int_sids, default=-1) + 1
    out = []
    for k in range(n):
        shift = k * (span + SCALE_GAP_MS)
        for row in rows:
            if k:
                row = dict(row)
                if row.get("timestamp") is not None:
                    row["timestamp"] = row["timestamp"] + shift
                if row.get("hash_ids") is not None:
                    row["hash_ids"] = [h + k * hash_stride for h in row["hash_ids"]]
                sid = row.get("session_id")
                if isinstance(sid, int):
                    row["session_id"] = sid + k * sid_stride
                elif sid is not None:
                    row["session_id"] = f"{sid}@{k}"
            out.append(row)
    return out


def scaled_trace(trace: Path, n: int, rows: int | None, directory: Path | str) -> Path:
    """The first ``rows`` rows of ``trace`` (all if ``None``), ``scale_rows``'d ``n`` times over, in a file."""
    records = []
    with trace.open() as src:
        for line in src:
            if rows is not None and len(records) >= rows:
                break
            if line.strip():
                records.append(json.loads(line))
    out = Path(directory) / f"scale-{n}.jsonl"
    with out.open("w") as dst:
        for record in scale_rows(records, n):
            dst.write(json.dumps(record, separators=(",", ":")) + "\n")
    return out


def write_bench_profile(path: Path) -> None:
    """A GPU profile for the interpolated engine: the polynomial's prefill at 24 prompt sizes, and a decode
    grid whose time grows with the batch's mean context as well as its KV tokens (so both axes matter)."""
    from workers.profile import ProfileData, save_profile
    from workers.timing import PolynomialTiming

    poly = PolynomialTiming()
    isl = [1, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 7168, 8192, 10240, 12288, 16384,
           20480, 24576, 32768, 49152, 65536, 131072]
    active = [0, 4096, 16384, 65536, 131072, 262144, 524288, 786432, 1048576, 2097152]
    context = [1, 1024, 4096, 8192, 16384, 32768, 65536, 131072]
    total = 16384 * 64
    save_profile(ProfileData(
        prefill_isl=isl, prefill_ttft_ms=[poly.prefill_ms(n) for n in isl],
        decode_active_kv_tokens=active, decode_context_length=context,
        decode_itl=[[poly.decode_ms(a, total) * (1.0 + 0.05 * c / 32768) for c in context] for a in active]), path)


def scenario_trace(trace: Path | None) -> Path:
    """The trace the example replays (``--trace`` if given), resolved; it may not exist (checked by callers,
    before loading the scenario, which would refuse a missing file)."""
    if trace is not None:
        return trace.resolve()
    import yaml

    declared = yaml.safe_load(SCENARIO.read_text())["workload"]["trace"]
    return (SCENARIO.parent / declared).resolve()


def existing_trace(prog: str, trace: Path | None) -> Path | None:
    """``scenario_trace(trace)`` if it is a file; else ``None`` after telling the user where to get it."""
    path = scenario_trace(trace)
    if path.is_file():
        return path
    print(f"{prog}: trace not found: {path} (get conversation_trace.jsonl from the Mooncake repository, "
          "FAST25-release/traces/, and pass --trace PATH)", file=sys.stderr)
    return None
