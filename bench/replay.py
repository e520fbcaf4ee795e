"""Fidelity, speed and memory of kvemu's virtual replay of the Mooncake trace, against Dynamo's offline replay.

Runs ``examples/mooncake-3600s.yaml`` (16 workers, dp_size 1, Dynamo mocker default engine arguments,
``trace_block_size`` 512) in kvemu's virtual mode with ``router.policy`` round_robin and kv, and, where
``ai-dynamo-runtime`` is installed, the same trace through Dynamo's offline replay
(``dynamo.replay.api.run_trace_replay`` where the wheel ships it, else ``dynamo._core.run_mocker_trace_replay``;
``num_workers=16, trace_block_size=512``, default engine arguments, ``replay_mode="offline"``,
``router_mode`` "round_robin" and "kv_router").

Each run (one side, one policy) is a child process of its own (``python -m bench.replay --child SIDE ...``,
which writes its summary, wall and CPU seconds and peak RSS to a JSON file), so that no run's time or memory is
charged to another. Every figure is printed on stdout as ``figure name: value unit``:

* ``kvemu round_robin mean ttft: 241.6 ms`` / ``reference round_robin mean ttft: ...`` for mean, p50 and
  p99 TTFT, mean E2E, mean ITL, the prefix-cache reuse ratio, the wall time, the peak RSS and the CPU
  time of each run (``kvemu round_robin peak rss: 123.4 MB``; CPU time counts every thread of the child,
  so on a busy machine it shows whether a side was slow or starved; it has no target);
* ``round_robin mean ttft ratio vs reference: 1.00x`` (kvemu / reference) per figure and policy;
* ``kvemu kv improvement over round_robin mean ttft: -20.3 %`` (and the reference's), per figure;
* ``round_robin wall time ratio vs reference: N.NNx``, ``round_robin peak rss ratio vs reference: N.NNx``
  and ``round_robin cpu time ratio vs reference: N.NNx`` (kvemu / reference: lower is faster, or smaller,
  for kvemu);
* ``kvemu round_robin goodput requests: 677 requests`` and ``... goodput throughput: ... req/s``: every run
  has the SLA ``BENCH_SLA`` (TTFT ≤ 300 ms, mean ITL ≤ 8 ms) on both sides (``run.sla``; the reference's
  ``sla_ttft_ms``/``sla_itl_ms``);
* without ``--policy``, a closed-loop run too, ``closed loop 64 round_robin``: the trace's rows with at most 64
  in flight (``workload.concurrency``; the reference's ``replay_concurrency``), held to the same targets but
  for wall time and memory;
* ``fidelity targets met: N of M`` (round robin within 5 % of the reference for mean/p50/p99 TTFT, mean
  E2E, mean ITL and reuse, and its goodput count within 2 %; KV routing's improvement over round robin within ±20 % of the reference's, same
  direction, for the same figures; per policy, kvemu's wall time no slower and its peak RSS no larger than
  the reference's), each target listed on stderr.

Wall time is measured inside the child around the whole call on both sides (trace loading included;
kvemu writes no report files here). Peak RSS is the child's own high-water mark (``VmHWM`` of
``/proc/self/status``; ``ru_maxrss`` where there is none), read after its run, in MB of 2^20 bytes; it
covers the interpreter and the imports each side needs. ``--quick`` replays the first 1,000 requests on
both sides (``run.max_requests`` for kvemu, the first 1,000 rows copied to a temporary file for the
reference, outside its timing). The trace path comes from the scenario; ``--trace PATH`` overrides it
(``--set workload.trace=PATH``). ``--arrival-speedup R`` divides every arrival time and think time by ``R``
on both sides (``workload.arrival_speedup_ratio``; the reference's ``arrival_speedup_ratio``): heavier load
on the same requests.

``--scale N`` (1 to 16, default 1) measures how the wall time grows with the trace: besides the runs above, each
policy is replayed again on the trace N times over (``scale_rows``: copy ``k`` of every row shifted by ``k`` ×
(the trace's span + 1 s), its hash ids by ``k`` × (the largest hash id + 1), its session ids made distinct per
copy), taken after ``--quick``/``--max-requests`` (a quick scaled run stays quick) and written to a temporary
file before any run, which both sides replay (``--set workload.trace=PATH``; the reference's trace path). Its
figures are named ``POLICY scale N``: ``kvemu kv scale 4 wall time: ... s``, ``kv scale 4 wall time ratio vs
reference: N.NNx`` (and the rest of the per-run figures, none of them a target), and ``kvemu kv scale 4
growth: G.GGx`` (``reference kv scale 4 growth: ...`` likewise): the scaled run's wall time over the unscaled
run's, same side and policy, this invocation. kvemu's growth is one more target per policy: at most N.

``--suite engines`` replays the other engines of the reference side by side instead, each figure held to
2 % of the reference's: ``disagg 4p12d kv`` (``examples/disagg-4p12d.yaml``: 4 prefill and 12 decode
workers, KV routing, a 25 GB/s link of 131,072 bytes a token; against the mean of three reference runs, whose
KV routing breaks ties at random), then round robin on 16 workers: ``trtllm`` (``backend: trtllm``, its
default block size 32), ``host offload`` (round robin and KV routing, the latter against the mean of three
reference runs: ``HOST_OFFLOAD``, a GPU pool small enough that the host tier matters) and ``interpolated`` (``timing_model: interpolated`` on a profile this bench writes: the
polynomial's prefill and a decode grid over active KV tokens and mean context, saved as ``.npz``, which the
reference loads through its ``dynamo_profile`` provider). Their figures are named after the engine
(``kvemu trtllm round_robin mean ttft: ...``, ``trtllm round_robin mean ttft ratio vs reference: 1.00x``).

Percentiles on both sides are the rounded-rank definition of Dynamo's replay report
(``harness.report.stats.percentile``), so p50/p99 compare like for like. The exit status is 0 when every run
completed all its requests, 1 when one did not (or produced no TTFT) or its child process failed (the
run is named and the child's stderr shown), 2 without a trace; a missed fidelity target is reported, not
an error (the wall-time and memory ones depend on the machine).

Run: python -m bench.replay [--quick] [--trace PATH] [--max-requests N] [--policy round_robin|kv ...]
     [--scale N] [--suite engines [--variant TEXT ...]]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import reference
from bench import verdict
from bench.replay_inputs import MAX_SCALE, ROOT, SCENARIO, existing_trace, scaled_trace, short_prompts
from bench.replay_inputs import write_bench_profile
from bench.replay_runs import Run, Variant, child, mean_run, spawn

os.environ.setdefault("DYN_LOG", "warn")  # the reference logs every KV routing decision at INFO

QUICK_REQUESTS = 1000
SIDES = ("kvemu", "reference")

FIGURES: list[tuple[str, str, str, float]] = [
    # (label, summary key, unit, scale applied to the summary value)
    ("mean ttft", "mean_ttft_ms", "ms", 1.0),
    ("p50 ttft", "median_ttft_ms", "ms", 1.0),
    ("p99 ttft", "p99_ttft_ms", "ms", 1.0),
    ("mean e2e", "mean_e2e_latency_ms", "ms", 1.0),
    ("mean itl", "mean_itl_ms", "ms", 1.0),
    ("prefix-cache reuse ratio", "prefix_cache_reused_ratio", "", 1.0),
    ("goodput requests", "goodput_completed_requests", "requests", 1.0),
    ("goodput throughput", "goodput_request_throughput_rps", "req/s", 1.0),
]
ROUND_ROBIN_TARGETS = ("mean ttft", "p50 ttft", "p99 ttft", "mean e2e", "mean itl", "prefix-cache reuse ratio",
                       "goodput requests")
"""Round robin: kvemu within 5 % of the reference (goodput counts within 2 %)."""
GOODPUT_TOLERANCE = 0.02
KV_TARGETS = ("mean ttft", "p50 ttft", "p99 ttft", "mean e2e", "mean itl", "prefix-cache reuse ratio")
"""KV routing: the improvement over round robin has the reference's sign and is within ±20 % of its size."""
COSTS: list[tuple[str, str, str, int, str | None]] = [
    # (label, Run attribute, unit, digits, the target: kvemu's ... the reference's; None: no target)
    ("wall time", "wall_s", "s", 2, "no slower than"),
    ("peak rss", "peak_rss_mb", "MB", 1, "no larger than"),
    ("cpu time", "cpu_s", "s", 2, None),  # all threads of the child: tells a busy machine from a slow run
]


def engine_suite(directory: Path) -> list[Variant]:
    """``--suite engines``: the reference's other engines, round robin on 16 workers, within 2 %."""
    profile = directory / "profile.npz"
    write_bench_profile(profile)
    link = {"kv_transfer_bandwidth": 25.0, "kv_transfer_bytes_per_token": 131072}
    return [Variant("disagg 4p12d kv", "kv", {}, 0.02,
                    pools={"prefill": {"workers": 4, "engine": link}, "decode": {"workers": 12}}, reference_runs=3),
            Variant("trtllm round_robin", "round_robin", {"backend": "trtllm", "block_size": 32}, 0.02),
            Variant("interpolated round_robin", "round_robin",
                    {"timing_model": {"type": "interpolated", "path": str(profile)}}, 0.02),
            Variant("host offload round_robin", "round_robin", HOST_OFFLOAD, 0.02),
            Variant("host offload kv", "kv", HOST_OFFLOAD, 0.02, reference_runs=3),
            # the reference's SGLang replay errs or never ends once prompts of more than ~8k tokens are in; the
            # scenario sets block_size 64, SGLang's page is 1 token
            Variant("sglang round_robin", "round_robin", {"backend": "sglang", "block_size": 1}, 0.02,
                    max_input_tokens=8000)]


CLOSED_LOOP = "closed loop 64 round_robin"
CLOSED_LOOP_CONCURRENCY = 64
"""The default suite's closed-loop run: the trace's rows replayed with at most 64 in flight (4 per worker)."""

HOST_OFFLOAD: dict[str, Any] = {"num_gpu_blocks": 4096, "kv_cache_bytes_per_token": 131072,
                                "native_host_offload": {"num_host_blocks": 32768}}
"""``--suite engines``' host offload: a GPU pool of 4,096 blocks (a quarter of the default, so prompts are evicted
and come back from the host), 8 MiB blocks (131,072 bytes a token) over 32 GB/s links, 32,768 host blocks."""


def emit(name: str, value: float | None, unit: str, digits: int = 1) -> None:
    text = "n/a" if value is None else f"{value:.{digits}f}"
    print(f"{name}: {text} {unit}".rstrip(), flush=True)


def note(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def digits_for(unit: str) -> int:
    return 2 if unit == "ms" else 4


# ------------------------------------------------------------------------------------------ output


def value(summary: dict[str, Any], key: str, scale: float) -> float | None:
    v = summary.get(key)
    return None if v is None else float(v) * scale


def improvement(base: float | None, other: float | None) -> float | None:
    """KV vs round robin in % of round robin's figure (negative: KV's is lower)."""
    if base is None or other is None or base == 0:
        return None
    return 100.0 * (other - base) / abs(base)


def kv_improvement(runs: dict[str, Run], key: str, scale: float) -> float | None:
    """KV routing's improvement over round robin on one side (both policies must have run)."""
    return improvement(value(runs["round_robin"].summary, key, scale), value(runs["kv"].summary, key, scale))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"replay the first {QUICK_REQUESTS:,} requests only")
    ap.add_argument("--max-requests", type=int, help="replay the first N requests only (both sides)")
    ap.add_argument("--trace", type=Path, help="the Mooncake trace (default: the example's workload.trace)")
    ap.add_argument("--policy", action="append", choices=("round_robin", "kv"),
                    help="policies to run (default: both; the default suite only)")
    ap.add_argument("--suite", choices=("default", "engines"), default="default",
                    help="default: the vLLM engine, round robin and KV routing; engines: disaggregated, TRT-LLM, "
                         "host offload, SGLang, interpolated timing")
    ap.add_argument("--variant", action="append", metavar="TEXT",
                    help="--suite engines: run only the variants whose name contains TEXT (repeatable)")
    ap.add_argument("--arrival-speedup", type=float, default=1.0, metavar="R",
                    help="divide arrival and think times by R on both sides (heavier load)")
    ap.add_argument("--scale", type=int, default=1, metavar="N",
                    help=f"also replay the trace N times over (1..{MAX_SCALE}; copies shifted in time and given new "
                         "hash and session ids; after --quick/--max-requests) on both sides, per policy, and print "
                         "the scaled runs' wall time, peak RSS and growth over the unscaled runs (default suite only)")
    ap.add_argument("--no-reference", action="store_true", help="skip Dynamo's replay even when installed")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)  # one run, in a child process
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)  # where that child writes its result
    ap.add_argument("--engine-json", default="{}", help=argparse.SUPPRESS)  # that child's engine knobs and pools
    args = ap.parse_args(argv)
    if not args.arrival_speedup > 0:
        ap.error("--arrival-speedup must be > 0")
    if not 1 <= args.scale <= MAX_SCALE:
        ap.error(f"--scale must be between 1 and {MAX_SCALE}")
    if args.scale > 1 and args.suite != "default":
        ap.error("--scale needs the default suite")
    if args.child:
        if args.child_out is None or args.trace is None or len(args.policy or ()) != 1:
            ap.error("--child needs --child-out, --trace and one --policy")
        spec = json.loads(args.engine_json)
        child(args.child, args.policy[0], args.trace, args.max_requests, args.child_out, spec.get("engine"),
              args.arrival_speedup, spec.get("pools"), spec.get("concurrency"))
        return 0

    limit = args.max_requests if args.max_requests is not None else (QUICK_REQUESTS if args.quick else None)
    trace = existing_trace("bench.replay", args.trace)
    if trace is None:
        return 2
    note(f"scenario {SCENARIO.relative_to(ROOT)}, trace {trace}"
         + (f", first {limit:,} requests" if limit else ", all requests")
         + (f", arrivals {args.arrival_speedup:g}x faster" if args.arrival_speedup != 1 else "")
         + (f", and {args.scale} times over" if args.scale > 1 else ""))
    ref_entry = None if args.no_reference else reference.replay_entry()
    if ref_entry is None:
        print("reference: not installed", flush=True)
    else:
        note(f"reference: {ref_entry[0]} (ai-dynamo-runtime), one child process per run")

    runs: dict[str, dict[str, Run]] = {side: {} for side in SIDES}  # side -> variant name -> run
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvemu-bench-replay-") as tmp:
        if args.suite == "engines":
            variants = [v for v in engine_suite(Path(tmp))
                        if not args.variant or any(text in v.name for text in args.variant)]
        else:
            variants = [Variant(p, p, {}) for p in (args.policy or ["round_robin", "kv"])]
            if not args.policy:
                variants.append(Variant(CLOSED_LOOP, "round_robin", {}, concurrency=CLOSED_LOOP_CONCURRENCY))
            if args.scale > 1:
                variants += [Variant(f"{p} scale {args.scale}", p, {}, scale=args.scale)
                             for p in (args.policy or ["round_robin", "kv"])]
        inputs = {"kvemu": (trace, limit)}  # side -> (trace, max_requests)
        if ref_entry is not None:
            inputs["reference"] = (reference.trace_head(trace, limit, tmp) if limit else trace, None)
        # written once, before any run (outside every timing); both sides replay the same file
        scaled = scaled_trace(trace, args.scale, limit, tmp) if args.scale > 1 else None
        for variant in variants:
            sides = inputs
            if variant.max_input_tokens is not None:
                short = short_prompts(trace, variant.max_input_tokens, limit, tmp)
                sides = {side: (short, None) for side in inputs}
            if variant.scale > 1:
                assert scaled is not None
                sides = {side: (scaled, None) for side in inputs}
            for side, (side_trace, max_requests) in sides.items():
                results: list[Run] = []
                for i in range(variant.reference_runs if side == "reference" else 1):
                    note(f"{side} {variant.name} ..." + (f" (run {i + 1} of {variant.reference_runs})"
                                                         if side == "reference" and variant.reference_runs > 1 else ""))
                    result = spawn(side, variant, side_trace, max_requests, tmp, args.arrival_speedup)
                    if isinstance(result, str):
                        note(f"{side} {variant.name} failed")
                        problems.append(result)
                        break
                    results.append(result)
                else:
                    runs[side][variant.name] = mean_run(results)
    ours, ref = runs["kvemu"], runs["reference"]

    # side by side
    for variant in variants:
        name = variant.name
        for side in SIDES:
            if name not in runs[side]:
                continue
            run = runs[side][name]
            for label, key, unit, scale in FIGURES:
                emit(f"{side} {name} {label}", value(run.summary, key, scale), unit, digits_for(unit))
            emit(f"{side} {name} requests completed", run.summary.get("completed_requests"), "", 0)
            for label, attr, unit, digits, _ in COSTS:
                emit(f"{side} {name} {label}", getattr(run, attr), unit, digits)

    # kvemu / reference
    targets: list[tuple[str, bool]] = []
    for variant in variants:
        name = variant.name
        if name not in ours or name not in ref:
            continue
        # KV routing's ties are random in the reference: one run is not its figure (the mean of several is)
        held = (variant.policy == "round_robin" or variant.reference_runs > 1) and variant.scale == 1
        tol = variant.tolerance
        for label, key, _unit, scale in FIGURES:
            a, b = value(ours[name].summary, key, scale), value(ref[name].summary, key, scale)
            if a is None or b is None or b == 0:
                continue
            print(f"{name} {label} ratio vs reference: {a / b:.2f}x", flush=True)
            if held and label in ROUND_ROBIN_TARGETS:
                within = min(tol, GOODPUT_TOLERANCE) if label.startswith("goodput") else tol
                targets.append((f"{name} {label} within {100 * within:g} % of the reference ({a / b - 1:+.1%})",
                                abs(a / b - 1) <= within))
        for label, attr, _, _, target in COSTS:
            ratio = getattr(ours[name], attr) / getattr(ref[name], attr)
            print(f"{name} {label} ratio vs reference: {ratio:.2f}x", flush=True)
            if target is not None and args.suite == "default" and variant.concurrency is None and variant.scale == 1:
                targets.append((f"{name} {label} {target} the reference ({ratio:.2f}x)", ratio <= 1.0))

    # KV routing vs round robin, on each side
    both = {"round_robin", "kv"}
    for side in SIDES:
        if both <= set(runs[side]):
            for label, key, _unit, scale in FIGURES:
                emit(f"{side} kv improvement over round_robin {label}", kv_improvement(runs[side], key, scale), "%")
    if both <= set(ours) and both <= set(ref):
        for label, key, _unit, scale in FIGURES:
            if label not in KV_TARGETS:
                continue
            ok_, rf = kv_improvement(ours, key, scale), kv_improvement(ref, key, scale)
            if ok_ is None or rf is None:
                continue
            same = (ok_ > 0) == (rf > 0) and rf != 0 and abs(ok_ / rf - 1) <= 0.20
            targets.append((f"kv improvement over round_robin {label}: kvemu {ok_:+.1f} % vs reference "
                            f"{rf:+.1f} % (same sign, within ±20 %)", same))
    # --scale N: each side's scaled wall time over its unscaled one, same policy, same invocation
    for variant in variants:
        if variant.scale == 1:
            continue
        for side in SIDES:
            scaled_run, base = runs[side].get(variant.name), runs[side].get(variant.policy)
            if scaled_run is None or base is None or base.wall_s <= 0:
                continue
            growth = scaled_run.wall_s / base.wall_s
            print(f"{side} {variant.name} growth: {growth:.2f}x", flush=True)
            if side == "kvemu":
                targets.append((f"{variant.name} kvemu growth no more than {variant.scale}x "
                                f"(wall time {growth:.2f}x the unscaled run's)", growth <= variant.scale))
    if targets:
        for text, ok in targets:
            note(f"{'met   ' if ok else 'MISSED'} {text}")
        print(f"fidelity targets met: {sum(ok for _, ok in targets)} of {len(targets)}", flush=True)

    problems += [problem for side in SIDES for name, run in runs[side].items()
                 if (problem := incomplete(f"{side} {name}", run.summary))]
    return verdict("replay", problems)


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
