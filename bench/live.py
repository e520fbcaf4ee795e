"""kvemu as processes (kvemu up): 4 worker processes × 2 DP ranks, no engine delay, 128-token prompts,
16 output tokens. Prints completed requests per second end to end and the router's routing overhead
(request in → rank chosen) across processes. Loopback only; bounded in requests and time.
Run: python -m bench.live [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.runtime import live_scenario

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rate", type=float, default=3000.0, help="offered requests per second")
    args = parser.parse_args()
    seconds = 2.0 if args.quick else 6.0
    with tempfile.TemporaryDirectory() as tmp:
        scenario = Path(tmp) / "live.yaml"
        scenario.write_text(live_scenario(workers=4, dp_size=2, rate=args.rate, seconds=seconds))
        out = Path(tmp) / "out"
        subprocess.run([sys.executable, "-m", "harness.cli", "up", str(scenario), "-o", str(out)], check=True,
                       timeout=300, stdout=subprocess.DEVNULL)
        summary = json.loads((out / "summary.json").read_text())
        records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    done = [r for r in records if r["failure"] is None and r["completion_ns"] is not None]
    span_s = (max(r["completion_ns"] for r in done) - min(r["arrival_ns"] for r in records)) / 1e9
    overheads = sorted((r["routed_ns"] - r["arrival_ns"]) / 1000 for r in records if r["routed_ns"] is not None)
    pct = lambda q: overheads[min(len(overheads) - 1, int(q / 100 * len(overheads)))]  # noqa: E731
    print(f"live offered rate: {args.rate:.0f} per s")
    print(f"live completed requests: {len(done) / span_s:.0f} per s")
    print(f"live completed: {len(done)} of {summary['num_requests']} requests")
    print(f"live routing overhead p50: {pct(50):.0f} us")
    print(f"live routing overhead p99: {pct(99):.0f} us")
    print(f"live mean ttft: {summary['mean_ttft_ms']} ms")


if __name__ == "__main__":
    main()
