"""The answer a run prints when it ends: its requests, latencies, throughput, prefix reuse, routing regret and what
the virtual clock bought, as a short plain-text table on standard output, the report's path last (``kvemu run``,
``up``, ``loadgen``, ``bench-router``). Every figure is read from the run's ``Summary``; nothing is computed anew."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.report.summary_types import Summary

__all__ = ["first_screen", "render_first_screen", "run_title"]


def _ms(value: Any) -> str:
    if value is None:
        return "—"
    return f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"


def _requests(s: Summary, compact: bool) -> str:
    k = s.kvemu
    text = f"{s.completed_requests:,}/{s.num_requests:,}" + ("" if compact else " completed")
    failed, unfinished = k.failed_requests, k.unfinished_requests
    if compact:
        return text + (f" ({failed:,} failed)" if failed else "") + (f" ({unfinished:,} open)" if unfinished else "")
    if failed:
        reasons = ", ".join(f"{why} {n:,}" for why, n in k.failed_requests_by_reason.items())
        text += f", {failed:,} failed" + (f" ({reasons})" if reasons else "")
    if unfinished:
        text += f", {unfinished:,} unfinished"
    return text


def _latency(p50_ms: float | None, p99_ms: float | None, compact: bool) -> str:
    p50, p99 = _ms(p50_ms), _ms(p99_ms)
    return f"{p50} / {p99}" if compact else f"p50 {p50:>7}   p99 {p99:>7}"


def _throughput(s: Summary, compact: bool) -> str:
    out, rps = s.output_throughput_tok_s, s.request_throughput_rps
    if out is None or rps is None:
        return "—"
    return f"{out:,.1f} tok/s" if compact else f"{out:,.1f} output tok/s, {rps:,.2f} req/s"


def _reuse(s: Summary, compact: bool) -> str:
    ratio, prompt = s.prefix_cache_reused_ratio, s.total_input_tokens
    if s.kvemu.hook_counts.get("engine_truth_matched") == 0:
        return "—" if compact else "unknown: no engine said what it found cached (loadgen --http: give --fleet)"
    if ratio is None:
        return "—"
    if compact:
        return f"{100 * ratio:.1f}%"
    return f"{round(ratio * prompt):,} of {prompt:,} prompt tokens cached ({100 * ratio:.1f}%)"


def _regret(s: Summary, compact: bool) -> str | None:
    regret = s.kvemu.routing.regret
    if regret is None or regret.regret_ratio is None:
        return None
    lost, novel = regret.lost_blocks, regret.novel_blocks
    if compact:
        return f"{100 * regret.regret_ratio:.1f}%"
    return (f"{100 * regret.regret_ratio:.1f}% ({lost:,} of the {lost + novel:,} prompt blocks computed anew were "
            "cached on another rank)")


def _clock(s: Summary, compact: bool) -> tuple[str, str | None]:
    """(label, text): a virtual run's scenario time against its wall time; a live run's duration."""
    scenario_ms, wall_ms = s.duration_ms, s.wall_time_ms
    if s.kvemu.mode != "virtual":
        return "duration", None if scenario_ms is None else f"{scenario_ms / 1000:,.1f} s" + (
            "" if compact else " (live clock)")
    if scenario_ms is None:
        return "virtual clock", None
    if not wall_ms:
        return "virtual clock", f"{scenario_ms / 1000:,.1f} s of cluster time"
    of = "" if compact else " of cluster time"
    return "virtual clock", (f"{scenario_ms / 1000:,.1f} s{of} in {wall_ms / 1000:,.1f} s "
                             f"({scenario_ms / wall_ms:,.0f}x)")


def _rows(s: Summary | None, compact: bool) -> list[tuple[str, str | None]]:
    """Each figure's (label, text; None: the run has no such figure); ``compact``: a column beside others."""
    if s is None:  # a run that wrote no summary (a router that never started)
        return [("requests", "no report")]
    ms = "p50 / p99 (ms)" if compact else "(ms)"
    return [
        ("requests", _requests(s, compact)),
        (f"TTFT {ms}", _latency(s.median_ttft_ms, s.p99_ttft_ms, compact)),
        (f"ITL {ms}", _latency(s.median_itl_ms, s.p99_itl_ms, compact)),
        (f"E2E {ms}", _latency(s.median_e2e_latency_ms, s.p99_e2e_latency_ms, compact)),
        ("output throughput" if compact else "throughput", _throughput(s, compact)),
        ("prefix reuse", _reuse(s, compact)),
        ("routing regret", _regret(s, compact)),
        _clock(s, compact),
    ]


def render_first_screen(title: str, runs: Sequence[tuple[str, Summary | None]], report: str | Path | None) -> str:
    """The table a command prints when it ends: ``title`` (what ran), then per figure one row, a column per run
    (``runs``: a label and its summary, None: it wrote none; one run: no column header), then the report's path (None: none was
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


def run_title(command: str, summary: Summary) -> str:
    """``kvemu run: quickstart (virtual time, seed 7)``, marked PARTIAL (and why) when the run was cut short."""
    k = summary.kvemu
    title = f"{command}: {k.scenario} ({k.mode} time, seed {k.seed})"
    if summary.partial:
        title += f" PARTIAL ({k.stop_reason or 'interrupted'})"
    return title


def first_screen(command: str, summary: Summary, report: str | Path | None) -> str:
    """``render_first_screen`` of one run of ``command`` (``kvemu run``, ``kvemu up``, ``kvemu loadgen``)."""
    return render_first_screen(run_title(command, summary), [("", summary)], report)
