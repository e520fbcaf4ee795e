"""``kvemu bench-router``'s report: one row per router, from each run's summary (engine-side truth included).

``routers.json`` holds every figure, ``routers.md`` the table, ``routers.png`` bars of prefix reuse, TTFT
and load imbalance. Load imbalance is the largest rank's share of prompt tokens over the mean rank's (1.00:
perfectly even), from the engines' own per-rank counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from msgspec import UnsetType

from harness.report.summary_types import Summary

__all__ = ["router_row", "write_router_report", "COLUMNS"]

COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("prompt", "prompts", "{}"),
    ("completed", "completed", "{:d}"),
    ("failed", "failed", "{:d}"),
    ("prefix_reuse", "prefix reuse (engine)", "{:.3f}"),
    ("p50_ttft_ms", "TTFT p50 ms", "{:.1f}"),
    ("p99_ttft_ms", "TTFT p99 ms", "{:.1f}"),
    ("p50_itl_ms", "ITL p50 ms", "{:.2f}"),
    ("p99_itl_ms", "ITL p99 ms", "{:.2f}"),
    ("p50_e2e_ms", "E2E p50 ms", "{:.0f}"),
    ("p99_e2e_ms", "E2E p99 ms", "{:.0f}"),
    ("goodput_rps", "goodput req/s", "{:.3f}"),
    ("load_imbalance", "load imbalance", "{:.2f}"),
    ("wall_s", "wall s", "{:.0f}"),
)


def router_row(label: str, summary: Summary | None, wall_s: float, failures: dict[str, int] | None = None,
               error: str | None = None) -> dict[str, Any]:
    """One router's figures from its run's summary (None: it wrote none; ``partial``, set by the caller: the signal
    that stopped its run part way, else None)."""
    if summary is None:
        return {"router": label, "completed": 0, "failed": 0, "failures": failures or {}, "prefix_reuse": None,
                "p50_ttft_ms": None, "p99_ttft_ms": None, "p50_itl_ms": None, "p99_itl_ms": None,
                "p50_e2e_ms": None, "p99_e2e_ms": None, "goodput_rps": None, "load_imbalance": None,
                "engine_truth_matched": None, "wall_s": wall_s, "error": error, "partial": None}
    kv = summary.kvemu
    loads = [r.input_tokens for r in kv.per_rank]
    mean = sum(loads) / len(loads) if loads else 0
    goodput = summary.goodput_request_throughput_rps
    return {
        "router": label,
        "completed": summary.completed_requests,
        "failed": kv.failed_requests,
        "failures": failures if failures is not None else kv.failed_requests_by_reason,
        "prefix_reuse": summary.prefix_cache_reused_ratio,
        "p50_ttft_ms": summary.median_ttft_ms, "p99_ttft_ms": summary.p99_ttft_ms,
        "p50_itl_ms": summary.median_itl_ms, "p99_itl_ms": summary.p99_itl_ms,
        "p50_e2e_ms": summary.median_e2e_latency_ms, "p99_e2e_ms": summary.p99_e2e_latency_ms,
        "goodput_rps": None if isinstance(goodput, UnsetType) else goodput,
        "load_imbalance": max(loads) / mean if mean else None,
        "engine_truth_matched": kv.hook_counts.get("engine_truth_matched"),
        "wall_s": wall_s,
        "error": error,
        "partial": None,
    }


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    return fmt.format(int(value)) if fmt == "{:d}" else fmt.format(value)


def write_router_report(rows: list[dict[str, Any]], outdir: Path, about: dict[str, Any]) -> str:
    """Write routers.json, routers.md and routers.png in ``outdir``; returns the markdown table."""
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "routers.json").write_text(json.dumps({"about": about, "routers": rows}, indent=2, sort_keys=True) + "\n")
    head = "| router | " + " | ".join(name for _, name, _ in COLUMNS) + " |"
    rule = "|---|" + "---:|" * len(COLUMNS)
    lines = [head, rule]
    for row in rows:
        cells = [_cell(row.get(key), fmt) for key, _, fmt in COLUMNS]
        mark = f" (PARTIAL: {row['partial']})" if row.get("partial") else ""
        lines.append(f"| {row['router']}{mark} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    notes = [f"# Routers on {about.get('scenario')}", "",
             f"{about.get('requests')} requests, {_pools(about.get('pools') or {})}; each router in front of a "
             f"fresh kvemu fleet, the same workload replayed through it.", "",
             f"Engine time compressed {about.get('compress'):g}x (arrivals and engine passes); every latency is "
             "scaled back to uncompressed time. Prefix reuse is what the engines found cached (not what a router "
             "predicted); load imbalance is the busiest rank's prompt tokens over the mean rank's.", "", table, ""]
    stopped = about.get("interrupted")
    if stopped:
        later = about.get("not_run") or []
        notes[2:2] = [f"**PARTIAL**: interrupted ({stopped['signal']}) during {stopped['router']}"
                      + (f"; not run: {', '.join(later)}" if later else "") + ".", ""]
    for row in rows:
        if row.get("partial") and not row.get("error"):
            notes.append(f"- {row['router']}: PARTIAL ({row['partial']}): stopped part way; its figures cover the "
                         "requests that finished before")
        if row.get("failures") or row.get("error"):
            notes.append(f"- {row['router']}: " + (f"error: {row['error']}; " if row.get("error") else "")
                         + ", ".join(f"{k}: {v}" for k, v in sorted((row.get("failures") or {}).items())))
        notes += [f"- {row['router']}: {caveat}" for caveat in row.get("caveats") or ()]
    (outdir / "routers.md").write_text("\n".join(notes) + "\n")
    _plot(rows, outdir / "routers.png")
    return table


def _pools(pools: dict[str, Any]) -> str:
    """``16 workers x 1 rank``, or ``4 prefill workers x 1 rank + 12 decode workers x 1 rank``."""
    return " + ".join(f"{p['workers']} {'' if name == 'aggregated' else name + ' '}workers x {p['dp_size']} "
                      f"rank{'s' if p['dp_size'] != 1 else ''}" for name, p in pools.items())


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("prefix_reuse", "prefix reuse (engine-found)"), ("p50_ttft_ms", "TTFT p50 (ms)"),
              ("p99_ttft_ms", "TTFT p99 (ms)"), ("load_imbalance", "load imbalance (max/mean rank)"))
    labels = [r["router"] for r in rows]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (key, title) in zip(axes, panels):
        values = [r.get(key) or 0 for r in rows]
        ax.bar(range(len(rows)), values, color="#4c72b0")
        ax.set_xticks(range(len(rows)), labels, rotation=35, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
