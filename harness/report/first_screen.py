"""The answer a run prints when it ends: its requests, latencies, throughput, prefix reuse, routing regret and what
the virtual clock bought, as a short plain-text table on standard output, the report's path last (``kvemu run``,
``up``, ``loadgen``, ``bench-router``). Every figure is read from summary.json's dict; nothing is computed anew."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["first_screen", "render_first_screen", "run_title"]


def _ms(value: Any) -> str:
    if value is None:
        return "—"
    return f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"


def _requests(s: dict[str, Any], compact: bool) -> str:
    k = s.get("kvemu") or {}
    text = f"{s.get('completed_requests', 0):,}/{s.get('num_requests', 0):,}" + ("" if compact else " completed")
    failed, unfinished = k.get("failed_requests") or 0, k.get("unfinished_requests") or 0
    if compact:
        return text + (f" ({failed:,} failed)" if failed else "") + (f" ({unfinished:,} open)" if unfinished else "")
    if failed:
        reasons = ", ".join(f"{why} {n:,}" for why, n in (k.get("failed_requests_by_reason") or {}).items())
        text += f", {failed:,} failed" + (f" ({reasons})" if reasons else "")
    if unfinished:
        text += f", {unfinished:,} unfinished"
    return text


def _latency(s: dict[str, Any], name: str, compact: bool) -> str:
    p50, p99 = _ms(s.get(f"median_{name}_ms")), _ms(s.get(f"p99_{name}_ms"))
    return f"{p50} / {p99}" if compact else f"p50 {p50:>7}   p99 {p99:>7}"


def _throughput(s: dict[str, Any], compact: bool) -> str:
    out, rps = s.get("output_throughput_tok_s"), s.get("request_throughput_rps")
    if out is None or rps is None:
        return "—"
    return f"{out:,.1f} tok/s" if compact else f"{out:,.1f} output tok/s, {rps:,.2f} req/s"


def _reuse(s: dict[str, Any], compact: bool) -> str:
    ratio, prompt = s.get("prefix_cache_reused_ratio"), s.get("total_input_tokens") or 0
    if ((s.get("kvemu") or {}).get("hook_counts") or {}).get("engine_truth_matched") == 0:
        return "—" if compact else "unknown: no engine said what it found cached (loadgen --http: give --fleet)"
    if ratio is None:
        return "—"
    if compact:
        return f"{100 * ratio:.1f}%"
    return f"{round(ratio * prompt):,} of {prompt:,} prompt tokens cached ({100 * ratio:.1f}%)"


def _regret(s: dict[str, Any], compact: bool) -> str | None:
    regret = ((s.get("kvemu") or {}).get("routing") or {}).get("regret")
    if not regret or regret.get("regret_ratio") is None:
        return None
    lost, novel = regret.get("lost_blocks", 0), regret.get("novel_blocks", 0)
    if compact:
        return f"{100 * regret['regret_ratio']:.1f}%"
    return (f"{100 * regret['regret_ratio']:.1f}% ({lost:,} of the {lost + novel:,} prompt blocks computed anew were "
            "cached on another rank)")


def _clock(s: dict[str, Any], compact: bool) -> tuple[str, str | None]:
    """(label, text): a virtual run's scenario time against its wall time; a live run's duration."""
    scenario_ms, wall_ms = s.get("duration_ms"), s.get("wall_time_ms")
    if (s.get("kvemu") or {}).get("mode") != "virtual":
        return "duration", None if scenario_ms is None else f"{scenario_ms / 1000:,.1f} s" + (
            "" if compact else " (live clock)")
    if scenario_ms is None:
        return "virtual clock", None
    if not wall_ms:
        return "virtual clock", f"{scenario_ms / 1000:,.1f} s of cluster time"
    of = "" if compact else " of cluster time"
    return "virtual clock", (f"{scenario_ms / 1000:,.1f} s{of} in {wall_ms / 1000:,.1f} s "
                             f"({scenario_ms / wall_ms:,.0f}x)")


def _rows(s: dict[str, Any], compact: bool) -> list[tuple[str, str | None]]:
    """Each figure's (label, text; None: the run has no such figure); ``compact``: a column beside others."""
    if not s:  # a run that wrote no summary (a router that never started)
        return [("requests", "no report")]
    ms = "p50 / p99 (ms)" if compact else "(ms)"
    return [
        ("requests", _requests(s, compact)),
        (f"TTFT {ms}", _latency(s, "ttft", compact)),
        (f"ITL {ms}", _latency(s, "itl", compact)),
        (f"E2E {ms}", _latency(s, "e2e_latency", compact)),
        ("output throughput" if compact else "throughput", _throughput(s, compact)),
        ("prefix reuse", _reuse(s, compact)),
        ("routing regret", _regret(s, compact)),
        _clock(s, compact),
    ]


def render_first_screen(title: str, runs: Sequence[tuple[str, dict[str, Any]]], report: str | Path | None) -> str:
    """The table a command prints when it ends: ``title`` (what ran), then per figure one row, a column per run
    (``runs``: a label and its summary dict; one run: no column header), then the report's path (None: none was
    written). A figure no run has (routing regret without engine truth) is left out."""
    per_run = [dict(_rows(summary, compact=len(runs) > 1)) for _, summary in runs]
    names = list(dict.fromkeys(name for rows in per_run for name in rows))
    body = [[name, *(rows.get(name) or "—" for rows in per_run)] for name in names
            if any(rows.get(name) is not None for rows in per_run)]
    if len(runs) > 1:
        body.insert(0, ["", *(label for label, _ in runs)])
    widths = [max(len(row[i]) for row in body) for i in range(len(body[0]))]
    lines = [title] + [("  " + "   ".join(c.ljust(w) for c, w in zip(row, widths))).rstrip() for row in body]
    lines.append(f"  {'report'.ljust(widths[0])}   {report if report is not None else 'none written'}")
    return "\n".join(lines) + "\n"


def run_title(command: str, summary: dict[str, Any]) -> str:
    """``kvemu run: quickstart (virtual time, seed 7)``, marked PARTIAL (and why) when the run was cut short."""
    k = summary.get("kvemu") or {}
    title = f"{command}: {k.get('scenario', '?')} ({k.get('mode', '?')} time, seed {k.get('seed', '?')})"
    if summary.get("partial"):
        title += f" PARTIAL ({k.get('stop_reason') or 'interrupted'})"
    return title


def first_screen(command: str, summary: dict[str, Any], report: str | Path | None) -> str:
    """``render_first_screen`` of one run of ``command`` (``kvemu run``, ``kvemu up``, ``kvemu loadgen``)."""
    return render_first_screen(run_title(command, summary), [("", summary)], report)
