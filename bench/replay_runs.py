"""One run of ``bench.replay``: a side (kvemu or the reference) replaying one variant, in a child process of its
own (``python -m bench.replay --child SIDE ...``) so that no run's time or memory is charged to another."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import reference
from bench.replay_inputs import ROOT, SCENARIO

__all__ = ["BENCH_SLA", "DISAGG_SCENARIO", "Run", "Variant", "child", "mean_run", "peak_rss_mb", "run_kvemu",
           "run_reference", "spawn"]

DISAGG_SCENARIO = ROOT / "examples" / "disagg-4p12d.yaml"
BENCH_SLA = {"ttft_ms": 300.0, "itl_ms": 8.0}
"""Every run's SLA (``run.sla``; the reference's ``sla_ttft_ms``/``sla_itl_ms``): inside the trace's TTFT and ITL
distributions, so goodput counts the requests on both sides of each target."""


@dataclass(frozen=True)
class Variant:
    """One configuration both sides replay: its name in the figures, the router policy, engine knobs."""

    name: str
    policy: str
    engine: dict[str, Any]
    tolerance: float = 0.05
    pools: dict[str, Any] | None = None
    """A disaggregated cluster: ``{"prefill": {...}, "decode": {...}}`` pool sections (``engine`` is unused)."""
    reference_runs: int = 1
    """The reference's runs averaged (its KV routing breaks ties at random: one run is not its figure)."""
    max_input_tokens: int | None = None
    """Both sides replay only the trace's rows with at most this many input tokens (where the reference fails)."""
    concurrency: int | None = None
    """Closed loop: at most this many requests in flight (``workload.concurrency``; the reference's
    ``replay_concurrency``)."""
    scale: int = 1
    """``--scale N``: both sides replay the trace N times over (``scale_rows``), not the trace itself."""


@dataclass(frozen=True)
class Run:
    """What one run's child process reported."""

    summary: dict[str, Any]
    wall_s: float
    peak_rss_mb: float
    cpu_s: float


def mean_run(runs: list[Run]) -> Run:
    """The mean of several runs of one side (every numeric summary figure, the wall and CPU time; the peak RSS
    is the largest)."""
    if len(runs) == 1:
        return runs[0]
    summary = dict(runs[0].summary)
    for key, v in summary.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and all(
                isinstance(r.summary.get(key), (int, float)) for r in runs):
            summary[key] = sum(r.summary[key] for r in runs) / len(runs)
    n = len(runs)
    return Run(summary, sum(r.wall_s for r in runs) / n, max(r.peak_rss_mb for r in runs), sum(r.cpu_s for r in runs) / n)


# ------------------------------------------------------------------------- the runs (in the child)


def run_kvemu(policy: str, trace: Path | None, max_requests: int | None, engine: dict[str, Any] | None = None,
              speedup: float = 1.0, pools: dict[str, Any] | None = None,
              concurrency: int | None = None) -> tuple[dict[str, Any], float, float]:
    """kvemu's virtual replay of the example with ``router.policy=policy``: (summary, wall s, CPU s)."""
    from harness.report.summary import summarize
    from harness.run.runner import run_scenario
    from harness.scenario import load_scenario

    overrides = [f"router.policy={policy}", "run.mode=virtual", f"workload.arrival_speedup_ratio={speedup!r}",
                 f"workload.concurrency={json.dumps(concurrency)}", *(f"run.sla.{k}={v!r}" for k, v in BENCH_SLA.items())]
    overrides += [f"cluster.engine.{k}={json.dumps(v)}" for k, v in (engine or {}).items()]
    if pools:  # the disaggregated example, its pools as given
        overrides = [o for o in overrides if not o.startswith("cluster.engine.")]
        overrides += [f"cluster.{pool}={json.dumps(spec)}" for pool, spec in pools.items()]
    if trace is not None:
        overrides.append(f"workload.trace={trace}")
    if max_requests is not None:
        overrides.append(f"run.max_requests={max_requests}")
    scenario = load_scenario(DISAGG_SCENARIO if pools else SCENARIO, overrides)
    t0, c0 = time.perf_counter(), time.process_time()
    outcome = run_scenario(scenario, None)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return summarize(outcome.data).to_builtins(), wall, cpu  # (compared key by key with the reference's dict)


def run_reference(replay: Callable[..., Any], policy: str, trace: Path, engine: dict[str, Any] | None = None,
                  speedup: float = 1.0, pools: dict[str, Any] | None = None,
                  concurrency: int | None = None) -> tuple[dict[str, Any], float, float]:
    """The reference's offline replay of ``trace`` on 16 workers: (summary, wall s, CPU s of all its threads)."""
    options: dict[str, Any] = {"arrival_speedup_ratio": speedup, "replay_concurrency": concurrency,
                               **{f"sla_{k}": v for k, v in BENCH_SLA.items()}}
    t0, c0 = time.perf_counter(), time.process_time()
    if pools:
        summary = reference.run_reference_disagg(replay, trace, policy, prefill=pools["prefill"], decode=pools["decode"],
                                                 **options)
    else:
        summary = reference.run_reference(replay, trace, policy, engine=engine, **options)
    return summary, time.perf_counter() - t0, time.process_time() - c0


def peak_rss_mb() -> float:
    """This process's peak resident set size, in MB (2^20 bytes).

    ``VmHWM`` where /proc has it: unlike ``ru_maxrss``, which Linux carries over ``exec`` from the process
    that forked it, it counts this process only.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 1024


def child(side: str, policy: str, trace: Path, max_requests: int | None, out: Path,
          engine: dict[str, Any] | None = None, speedup: float = 1.0, pools: dict[str, Any] | None = None,
          concurrency: int | None = None) -> None:
    """One run in this process; its summary, wall and CPU seconds and peak RSS go to ``out`` as JSON."""
    if side == "kvemu":
        summary, wall, cpu = run_kvemu(policy, trace, max_requests, engine, speedup, pools, concurrency)
    else:
        entry = reference.replay_entry()
        if entry is None:
            raise SystemExit("bench.replay: the reference (ai-dynamo-runtime) cannot be imported")
        summary, wall, cpu = run_reference(entry[1], policy, trace, engine, speedup, pools, concurrency)
    out.write_text(json.dumps({"summary": summary, "wall_s": wall, "peak_rss_mb": peak_rss_mb(),
                               "cpu_s": cpu}))


# ------------------------------------------------------------------------ the runs (in the parent)


def spawn(side: str, variant: Variant, trace: Path, max_requests: int | None, directory: Path | str,
          speedup: float = 1.0) -> Run | str:
    """``side``'s replay of ``variant`` in a child process: what it reported, or why it failed.

    The child's stdout and stderr are passed on to stderr (stdout carries only the figures).
    """
    policy = variant.policy
    out = Path(directory) / f"{side}-{variant.name.replace(' ', '-')}.json"
    cmd = [sys.executable, "-m", "bench.replay", "--child", side, "--child-out", str(out), "--policy", policy,
           "--trace", str(trace), "--engine-json", json.dumps({"engine": variant.engine, "pools": variant.pools,
                                                    "concurrency": variant.concurrency}),
           "--arrival-speedup", repr(speedup)]
    if max_requests is not None:
        cmd += ["--max-requests", str(max_requests)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode == 0 and out.is_file():
        sys.stderr.write(proc.stdout + proc.stderr)
        sys.stderr.flush()
        data = json.loads(out.read_text())
        return Run(data["summary"], float(data["wall_s"]), float(data["peak_rss_mb"]), float(data["cpu_s"]))
    rc = proc.returncode
    status = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}" if rc else "no result written"
    output = textwrap.indent((proc.stderr + proc.stdout).strip() or "(nothing)", "    ")
    return f"{side} {variant.name}: its child process failed ({status}); its stderr and stdout:\n{output}"
