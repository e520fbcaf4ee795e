"""``kvemu compare OUTDIR_A OUTDIR_B``: two runs' summary.json side by side, with B-vs-A deltas, then what differs
between their resolved scenarios (scenario.yaml).

Only the numeric top-level keys are compared (the reference's replay metrics: throughputs, latency
statistics, cache reuse...). A key missing from one side, or null there, shows as "—"; so does a
relative delta whose base (A) is zero.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.report.what_ran import SCENARIO_FILE, read_scenario_document, scenario_differences

__all__ = ["SummaryError", "load_summary", "compare", "main"]

DASH = "—"


class SummaryError(Exception):
    """A run directory without a readable summary.json."""


def load_summary(path: Path) -> dict[str, Any]:
    """Read ``path/summary.json`` (or ``path`` itself when it is a file)."""
    path = Path(path)
    file = path if path.is_file() else path / "summary.json"
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise SummaryError(f"no summary.json in {path} (is it the output directory of a `kvemu run`?)") from None
    except OSError as exc:
        raise SummaryError(f"cannot read {file}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SummaryError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SummaryError(f"{file} is not a summary (expected a JSON object)")
    return data


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def _fmt(value: float | int | None) -> str:
    if value is None:
        return DASH
    if isinstance(value, int):
        return str(value)
    return f"{value:.6g}"


def _delta(a: float | int | None, b: float | int | None) -> tuple[str, str]:
    if a is None or b is None:
        return DASH, DASH
    diff = b - a
    absolute = f"{diff:+d}" if isinstance(diff, int) else f"{diff:+.6g}"
    relative = f"{100 * diff / abs(a):+.1f}%" if a else DASH
    return absolute, relative


def compare(a: Path, b: Path) -> str:
    """A text table of the numeric top-level keys of two runs' summaries: A, B, B − A and (B − A) / |A|; then the
    keys whose values differ between the two runs' scenario.yaml."""
    sa, sb = load_summary(Path(a)), load_summary(Path(b))
    keys = sorted(k for k in set(sa) | set(sb) if _number(sa.get(k)) is not None or _number(sb.get(k)) is not None)
    rows = [("metric", "A", "B", "delta", "delta %")]
    for key in keys:
        va, vb = _number(sa.get(key)), _number(sb.get(key))
        rows.append((key, _fmt(va), _fmt(vb), *_delta(va, vb)))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for name, run in (("A", sa), ("B", sb)):
        meta = kvemu if isinstance(kvemu := run.get("kvemu"), dict) else {}
        where = a if name == "A" else b
        details = ", ".join(f"{k} {meta[k]}" for k in ("scenario", "mode", "seed") if k in meta)
        partial = "  [PARTIAL RUN]" if run.get("partial") or meta.get("partial") else ""
        lines.append(f"{name}: {where}" + (f" ({details})" if details else "") + partial)
    lines.append("")
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join([*lines, "", *_scenario_lines(Path(a), Path(b))]) + "\n"


def _scenario_lines(a: Path, b: Path) -> list[str]:
    """What differs between the two runs' resolved scenarios (their scenario.yaml): key, A's value, B's value."""
    docs = {name: read_scenario_document(where if where.is_dir() else where.parent) for name, where in
            (("A", a), ("B", b))}
    missing = [name for name, doc in docs.items() if doc is None]
    if missing:
        return [f"Scenarios: not compared; {' and '.join(missing)} {'has' if len(missing) == 1 else 'have'} no "
                f"{SCENARIO_FILE} (a report of an earlier kvemu)"]
    differences = scenario_differences(docs["A"] or {}, docs["B"] or {})
    if not differences:
        return [f"Scenarios: the same ({SCENARIO_FILE})"]
    rows = [("scenario key", "A", "B"), *differences]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    out = [f"Scenarios: {len(differences)} {'key differs' if len(differences) == 1 else 'keys differ'} "
           f"({SCENARIO_FILE})", ""]
    for i, row in enumerate(rows):
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``kvemu compare OUTDIR_A OUTDIR_B``: print the table; exit 2 when a summary is missing or unreadable."""
    parser = argparse.ArgumentParser(prog="kvemu compare",
                                     description="Compare two runs' summary.json (deltas are B vs A).")
    parser.add_argument("outdir_a", type=Path, help="output directory of run A (baseline)")
    parser.add_argument("outdir_b", type=Path, help="output directory of run B")
    args = parser.parse_args(argv)
    try:
        text = compare(args.outdir_a, args.outdir_b)
    except SummaryError as exc:
        print(f"kvemu compare: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
