"""Fidelity and speed of kvemu's virtual replay of the Mooncake trace, against Dynamo's offline replay.

Runs ``examples/mooncake-3600s.yaml`` (16 workers, dp_size 1, Dynamo mocker default engine arguments,
``trace_block_size`` 512) in kvemu's virtual mode with ``router.policy`` round_robin and kv, and, where
``ai-dynamo-runtime`` is installed, the same trace through Dynamo's offline replay in the same process
(``dynamo.replay.api.run_trace_replay`` where the wheel ships it, else ``dynamo._core.run_mocker_trace_replay``;
``num_workers=16, trace_block_size=512``, default engine arguments, ``replay_mode="offline"``,
``router_mode`` "round_robin" and "kv_router").

Every figure is printed on stdout as ``figure name: value unit``:

* ``kvemu round_robin mean ttft: 241.6 ms`` / ``reference round_robin mean ttft: ...`` for mean, p50 and
  p99 TTFT, mean E2E, mean ITL, the prefix-cache reuse ratio and the wall time of each run;
* ``round_robin mean ttft ratio vs reference: 1.00x`` (kvemu / reference) per figure and policy;
* ``kvemu kv improvement over round_robin mean ttft: -20.3 %`` (and the reference's), per figure;
* ``round_robin wall time ratio vs reference: N.NNx`` (kvemu / reference: lower is faster for kvemu);
* ``fidelity targets met: N of M`` (round robin within 5 % of the reference for mean/p50 TTFT, mean E2E,
  mean ITL and reuse; KV routing's improvement over round robin within ±20 % of the reference's, same
  direction; kvemu's wall time no slower than the reference's), each target listed on stderr.

Wall time is measured around the whole call on both sides (trace loading included; kvemu writes no
report files here). ``--quick`` replays the first 1,000 requests on both sides (``run.max_requests``
for kvemu, the first 1,000 rows copied to a temporary file for the reference). The trace path comes
from the scenario; ``--trace PATH`` overrides it (``--set workload.trace=PATH``).

Percentiles on both sides are the rounded-rank definition of Dynamo's replay report
(``harness.stats.percentile``), so p50/p99 compare like for like. The exit status is 0 when every run
completed all its requests, 1 when one did not (or produced no TTFT), 2 without a trace; a missed
fidelity target is reported, not an error (the wall-time one depends on the machine).

Run: python -m bench.replay [--quick] [--trace PATH] [--max-requests N] [--policy round_robin|kv ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import reference

os.environ.setdefault("DYN_LOG", "warn")  # the reference logs every KV routing decision at INFO

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "examples" / "mooncake-3600s.yaml"
QUICK_REQUESTS = 1000

FIGURES: list[tuple[str, str, str, float]] = [
    # (label, summary key, unit, scale applied to the summary value)
    ("mean ttft", "mean_ttft_ms", "ms", 1.0),
    ("p50 ttft", "median_ttft_ms", "ms", 1.0),
    ("p99 ttft", "p99_ttft_ms", "ms", 1.0),
    ("mean e2e", "mean_e2e_latency_ms", "ms", 1.0),
    ("mean itl", "mean_itl_ms", "ms", 1.0),
    ("prefix-cache reuse ratio", "prefix_cache_reused_ratio", "", 1.0),
]
ROUND_ROBIN_TARGETS = ("mean ttft", "p50 ttft", "mean e2e", "mean itl", "prefix-cache reuse ratio")
"""Round robin: kvemu within 5 % of the reference."""
KV_TARGETS = ("mean ttft", "p50 ttft", "mean e2e", "mean itl", "prefix-cache reuse ratio")
"""KV routing: the improvement over round robin has the reference's sign and is within ±20 % of its size."""


def emit(name: str, value: float | None, unit: str, digits: int = 1) -> None:
    text = "n/a" if value is None else f"{value:.{digits}f}"
    print(f"{name}: {text} {unit}".rstrip(), flush=True)


def note(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def digits_for(unit: str) -> int:
    return 2 if unit == "ms" else 4


# --------------------------------------------------------------------------------------- the runs


def run_kvemu(policy: str, trace: Path | None, max_requests: int | None) -> tuple[dict[str, Any], float]:
    """kvemu's virtual replay of the example with ``router.policy=policy``: (summary, wall seconds)."""
    from harness.report import summarize
    from harness.runner import run_scenario
    from harness.scenario import load_scenario

    overrides = [f"router.policy={policy}", "run.mode=virtual"]
    if trace is not None:
        overrides.append(f"workload.trace={trace}")
    if max_requests is not None:
        overrides.append(f"run.max_requests={max_requests}")
    scenario = load_scenario(SCENARIO, overrides)
    t0 = time.perf_counter()
    outcome = run_scenario(scenario, None)
    wall = time.perf_counter() - t0
    return summarize(outcome.data), wall


def run_reference(replay: Callable[..., Any], policy: str, trace: Path) -> tuple[dict[str, Any], float]:
    """The reference's offline replay of ``trace`` on 16 workers: (summary, wall seconds)."""
    t0 = time.perf_counter()
    summary = reference.run_reference(replay, trace, policy)
    return summary, time.perf_counter() - t0


def scenario_trace(trace: Path | None) -> Path:
    """The trace the example replays (after ``--trace``), resolved."""
    from harness.scenario import load_scenario, resolve

    scenario = load_scenario(SCENARIO, [f"workload.trace={trace}"] if trace is not None else [])
    return resolve(scenario, scenario.workload.trace).resolve()  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------ output


def value(summary: dict[str, Any], key: str, scale: float) -> float | None:
    v = summary.get(key)
    return None if v is None else float(v) * scale


def improvement(base: float | None, other: float | None) -> float | None:
    """KV vs round robin in % of round robin's figure (negative: KV's is lower)."""
    if base is None or other is None or base == 0:
        return None
    return 100.0 * (other - base) / abs(base)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"replay the first {QUICK_REQUESTS:,} requests only")
    ap.add_argument("--max-requests", type=int, help="replay the first N requests only (both sides)")
    ap.add_argument("--trace", type=Path, help="the Mooncake trace (default: the example's workload.trace)")
    ap.add_argument("--policy", action="append", choices=("round_robin", "kv"),
                    help="policies to run (default: both)")
    ap.add_argument("--no-reference", action="store_true", help="skip Dynamo's replay even when installed")
    args = ap.parse_args(argv)
    limit = args.max_requests if args.max_requests is not None else (QUICK_REQUESTS if args.quick else None)
    policies = args.policy or ["round_robin", "kv"]
    trace = scenario_trace(args.trace)
    if not trace.is_file():
        print(f"bench.replay: trace not found: {trace} (get conversation_trace.jsonl from the Mooncake repository, "
              "FAST25-release/traces/, and pass --trace PATH)", file=sys.stderr)
        return 2
    note(f"scenario {SCENARIO.relative_to(ROOT)}, trace {trace}"
         + (f", first {limit:,} requests" if limit else ", all requests"))
    ref_entry = None if args.no_reference else reference.replay_entry()
    if ref_entry is None:
        print("reference: not installed", flush=True)
    else:
        note(f"reference: {ref_entry[0]} (ai-dynamo-runtime), same process")

    ours: dict[str, tuple[dict[str, Any], float]] = {}
    ref: dict[str, tuple[dict[str, Any], float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvemu-bench-replay-") as tmp:
        ref_trace = reference.trace_head(trace, limit, tmp) if limit else trace
        for policy in policies:
            if ref_entry is not None:
                note(f"reference {policy} ...")
                ref[policy] = run_reference(ref_entry[1], policy, ref_trace)
            note(f"kvemu {policy} ...")
            ours[policy] = run_kvemu(policy, args.trace, limit)

    # side by side
    for policy in policies:
        for side, runs in (("kvemu", ours), ("reference", ref)):
            if policy not in runs:
                continue
            summary, wall = runs[policy]
            for label, key, unit, scale in FIGURES:
                emit(f"{side} {policy} {label}", value(summary, key, scale), unit, digits_for(unit))
            emit(f"{side} {policy} requests completed", summary.get("completed_requests"), "", 0)
            emit(f"{side} {policy} wall time", wall, "s", 2)

    # kvemu / reference
    targets: list[tuple[str, bool]] = []
    for policy in policies:
        if policy not in ref:
            continue
        for label, key, unit, scale in FIGURES:
            a, b = value(ours[policy][0], key, scale), value(ref[policy][0], key, scale)
            if a is None or b is None or b == 0:
                continue
            print(f"{policy} {label} ratio vs reference: {a / b:.2f}x", flush=True)
            if policy == "round_robin" and label in ROUND_ROBIN_TARGETS:
                targets.append((f"round_robin {label} within 5 % of the reference ({a / b - 1:+.1%})",
                                abs(a / b - 1) <= 0.05))
        ratio = ours[policy][1] / ref[policy][1]
        print(f"{policy} wall time ratio vs reference: {ratio:.2f}x", flush=True)
        targets.append((f"{policy} wall time no slower than the reference ({ratio:.2f}x)", ratio <= 1.0))

    # KV routing vs round robin, on each side
    if {"round_robin", "kv"} <= set(policies):
        for side, runs in (("kvemu", ours), ("reference", ref)):
            if not {"round_robin", "kv"} <= set(runs):
                continue
            for label, key, unit, scale in FIGURES:
                imp = improvement(value(runs["round_robin"][0], key, scale), value(runs["kv"][0], key, scale))
                emit(f"{side} kv improvement over round_robin {label}", imp, "%")
        if ref:
            for label, key, unit, scale in FIGURES:
                if label not in KV_TARGETS:
                    continue
                ok_ = improvement(value(ours["round_robin"][0], key, scale), value(ours["kv"][0], key, scale))
                rf = improvement(value(ref["round_robin"][0], key, scale), value(ref["kv"][0], key, scale))
                if ok_ is None or rf is None:
                    continue
                same = (ok_ > 0) == (rf > 0) and rf != 0 and abs(ok_ / rf - 1) <= 0.20
                targets.append((f"kv improvement over round_robin {label}: kvemu {ok_:+.1f} % vs reference "
                                f"{rf:+.1f} % (same sign, within ±20 %)", same))
    if targets:
        for text, ok in targets:
            note(f"{'met   ' if ok else 'MISSED'} {text}")
        print(f"fidelity targets met: {sum(ok for _, ok in targets)} of {len(targets)}", flush=True)

    problems = [problem for side, runs in (("kvemu", ours), ("reference", ref)) for policy, (summary, _) in runs.items()
                if (problem := incomplete(f"{side} {policy}", summary))]
    for p in problems:
        print(f"bench.replay: FAILED: {p}", file=sys.stderr, flush=True)
    return 1 if problems else 0


def incomplete(run: str, summary: dict[str, Any]) -> str | None:
    """Why a run's summary shows a broken replay (not every request completed, no TTFT), or None."""
    total, done = summary.get("num_requests"), summary.get("completed_requests")
    if not done or done != total:
        return f"{run}: {done} of {total} requests completed"
    if summary.get("mean_ttft_ms") is None:
        return f"{run}: no TTFT in the summary"
    return None


if __name__ == "__main__":
    sys.exit(main())
