"""kvemu as processes (kvemu up): 4 worker processes × 2 DP ranks, no engine delay, 128-token prompts,
16 output tokens. Prints completed requests per second end to end and the router's routing overhead
(request in → rank chosen) across processes. Loopback only; bounded in requests and time. Percentiles are
``harness.report.stats.percentile``; exits 1 when a request did not complete (or the cluster failed).
Run: python -m bench.live [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import verdict
from bench.runtime import live_scenario
from harness.report.stats import percentile
from harness.procs.up import cli_command, cli_env


def main(argv: list[str] | None = None) -> int:
    """Run the cluster and print the figures; 0 when every request completed, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m bench.live", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rate", type=float, default=3000.0, help="offered requests per second")
    args = parser.parse_args(argv)
    seconds = 2.0 if args.quick else 6.0
    with tempfile.TemporaryDirectory() as tmp:
        scenario = Path(tmp) / "live.yaml"
        scenario.write_text(live_scenario(workers=4, dp_size=2, rate=args.rate, seconds=seconds))
        out = Path(tmp) / "out"
        subprocess.run(cli_command("up", str(scenario), "-o", str(out)), env=cli_env(), check=True,
                       timeout=300, stdout=subprocess.DEVNULL)
        summary = json.loads((out / "summary.json").read_text())
        records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    done = [r for r in records if r["failure"] is None and r["completion_ns"] is not None]
    span_s = (max(r["completion_ns"] for r in done) - min(r["arrival_ns"] for r in records)) / 1e9
    overheads = sorted((r["routed_ns"] - r["arrival_ns"]) / 1000 for r in records if r["routed_ns"] is not None)
    print(f"live offered rate: {args.rate:.0f} per s")
    print(f"live completed requests: {len(done) / span_s:.0f} per s")
    print(f"live completed: {len(done)} of {summary['num_requests']} requests")
    print(f"live routing overhead p50: {percentile(overheads, 50):.0f} us")
    print(f"live routing overhead p99: {percentile(overheads, 99):.0f} us")
    print(f"live mean ttft: {summary['mean_ttft_ms']} ms")
    problems = []
    if len(done) != summary["num_requests"]:
        problems.append(f"{len(done)} of {summary['num_requests']} requests completed")
    return verdict("live", problems)


if __name__ == "__main__":
    sys.exit(main())
