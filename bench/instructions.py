"""Instructions per simulated request of a virtual-time replay, counted by callgrind (immune to machine load).

Wall times on a shared 2-core machine swing by ±30 %; the instructions a run executes do not. This runs
``examples/mooncake-3600s.yaml`` in virtual mode (the same overrides as ``bench.profile``) for the first
``--requests`` N and 3N requests, each in its own ``valgrind --tool=callgrind`` child (``PYTHONHASHSEED=0``: string
hashing cannot move the count), and prints the difference of their instruction totals per request: start-up,
imports and the report cost the same in both, so they cancel out. Slow (~50× under valgrind): a few minutes at the default N.

Prints ``instructions per request: I`` (millions, per policy) and the build that ran (``kvemu.build``);
exits 2 without valgrind or the trace, 1 if a run did not complete every request.

Run: python -m bench.instructions [--quick] [--policy kv|round_robin] [--requests N] [--trace PATH]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import verdict
from bench.replay_inputs import ROOT, existing_trace

_CHILD = """
import sys
from pathlib import Path
from bench.profile import load, run
summary, _ = run(load(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])), None)
sys.exit(0 if summary["completed_requests"] == int(sys.argv[3]) else 1)
"""


def instructions(policy: str, trace: Path, requests: int) -> int | None:
    """Total instructions (callgrind's ``Ir``) of one child replaying ``requests`` requests; None if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c", _CHILD,
               policy, str(trace), str(requests)]
        done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0 or not out.is_file():
            print(f"# {policy} {requests}: exit {done.returncode}: {done.stderr[-400:]}", flush=True)
            return None
        return total_instructions(out.read_text(errors="replace"))


def total_instructions(callgrind_out: str) -> int:
    """The ``summary:``/``totals:`` instruction count of a callgrind output file."""
    found = re.search(r"^(?:summary|totals):\s+(\d+)", callgrind_out, re.MULTILINE)
    if found is None:
        raise ValueError("no summary: or totals: line in the callgrind output")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100 and 300 requests (about a minute)")
    ap.add_argument("--policy", choices=("kv", "round_robin"), action="append", help="default: both")
    ap.add_argument("--requests", type=int, default=500, help="N: replays N and 3N requests (default 500)")
    ap.add_argument("--trace", type=Path, default=None, help="the Mooncake trace (default: the example's)")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("bench.instructions: valgrind is not installed (apt install valgrind)", file=sys.stderr)
        return 2
    trace = existing_trace("bench.instructions", args.trace)
    if trace is None:
        return 2
    n = 100 if args.quick else args.requests
    import kvemu

    print(f"# build: {'compiled' if getattr(kvemu, 'compiled', False) else 'pure'}; requests {n} and {3 * n}",
          flush=True)
    problems: list[str] = []
    for policy in args.policy or ["kv", "round_robin"]:
        lo, hi = instructions(policy, trace, n), instructions(policy, trace, 3 * n)
        if lo is None or hi is None:
            problems.append(f"{policy}: a callgrind run failed")
            continue
        print(f"instructions per request {policy}: {(hi - lo) / (2 * n) / 1e6:.3f} M", flush=True)
    return verdict("instructions", problems)


if __name__ == "__main__":
    sys.exit(main())
