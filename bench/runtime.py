"""The emulator end to end: virtual-time replay speed and live routing throughput.

Prints, one per line:
  virtual simulated requests: N per s         (16 workers, the first 2,000 Mooncake requests)
  virtual scenario time: N s
  live completed requests: N per s            (2 workers × 2 DP ranks, speedup 0, 128-token prompts, 16 tokens)
  live routing overhead p50: N us             (request in → dispatch out)
  live routing overhead p99: N us
Percentiles are ``harness.report.stats.percentile``. Exits 1 when a virtual or live request did not complete.
Run: python -m bench.runtime [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvemu.hooks import HookEvent

from harness.run.runner import run_scenario
from harness.scenario import parse_scenario
from harness.report.stats import percentile
from bench import verdict

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def virtual(requests: int) -> tuple[float, float, int]:
    """(simulated requests per wall second, scenario seconds, completed)."""
    text = f"""
name: bench-virtual
cluster: {{workers: 16, dp_size: 1}}
router: {{policy: kv}}
workload: {{kind: trace, trace: {TRACE}, trace_block_size: 512}}
run: {{mode: virtual, seed: 0, max_requests: {requests}}}
"""
    scenario = parse_scenario(text)
    t0 = time.perf_counter()
    out = run_scenario(scenario)
    wall = time.perf_counter() - t0
    records = out.data.records
    done = sum(1 for r in records if r.failure is None and r.completion_ns is not None)
    span = max((r.completion_ns or 0) for r in records) / 1e9
    return len(records) / wall, span, done


def live_scenario(*, workers: int, dp_size: int, rate: float, seconds: float) -> str:
    """The live benchmark workload: no engine delay, 128-token prompts, 16 output tokens, constant rate."""
    return f"""
name: bench-live
cluster:
  workers: {workers}
  dp_size: {dp_size}
  engine: {{speedup_ratio: 0, decode_speedup_ratio: 0, block_size: 16, num_gpu_blocks: 65536, max_num_seqs: 1024}}
router: {{policy: kv}}
workload:
  kind: synthetic
  arrival: constant
  rate_rps: {rate}
  turns: 1
  isl: {{kind: constant, mean: 128}}
  osl: {{kind: constant, mean: 16}}
  system_prefix_tokens: 0
  num_prefix_groups: 1
run: {{mode: live, seed: 0, duration_s: {seconds}, drain_timeout_s: 60}}
"""


def live(seconds: float, rate: float) -> tuple[float, list[float], int, int]:
    """(completed per second, routing overheads in µs, completed, failed) for a live 2×2 cluster."""
    text = live_scenario(workers=2, dp_size=2, rate=rate, seconds=seconds)
    scenario = parse_scenario(text)
    arrived: dict[str, int] = {}
    overheads: list[float] = []

    def observe(ev: HookEvent) -> None:
        if ev.kind == "request_arrived":
            arrived[ev.request_id] = time.perf_counter_ns()  # type: ignore[index]
        elif ev.kind == "routed" and ev.request_id in arrived:
            overheads.append((time.perf_counter_ns() - arrived.pop(ev.request_id)) / 1000)

    t0 = time.perf_counter()
    out = run_scenario(scenario, observers=[observe])
    wall = time.perf_counter() - t0
    records = out.data.records
    done = [r for r in records if r.failure is None and r.completion_ns is not None]
    first = min(r.arrival_ns for r in records)
    last = max(r.completion_ns for r in done)  # type: ignore[type-var]
    del wall
    return len(done) / ((last - first) / 1e9), sorted(overheads), len(done), len(records) - len(done)


def main(argv: list[str] | None = None) -> int:
    """Print the figures; 0 when every request completed, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m bench.runtime", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    problems = []
    if TRACE.is_file():
        requests = 200 if args.quick else 2000
        rate, span, done = virtual(requests)
        print(f"virtual simulated requests: {rate:.0f} per s", flush=True)
        print(f"virtual scenario time: {span:.0f} s", flush=True)
        print(f"virtual completed: {done} requests", flush=True)
        if done != requests:
            problems.append(f"virtual: {done} of {requests} requests completed")
    else:
        print(f"# virtual: skipped (no trace at {TRACE})", file=sys.stderr, flush=True)
    rps, overheads, done, failed = live(2.0 if args.quick else 5.0, 500 if args.quick else 2500)
    print(f"live completed requests: {rps:.0f} per s", flush=True)
    print(f"live completed: {done} requests, failed: {failed}", flush=True)
    print(f"live routing overhead p50: {percentile(overheads, 50):.0f} us", flush=True)
    print(f"live routing overhead p99: {percentile(overheads, 99):.0f} us", flush=True)
    if failed:
        problems.append(f"live: {failed} of {done + failed} requests failed")
    return verdict("runtime", problems)


if __name__ == "__main__":
    sys.exit(main())
