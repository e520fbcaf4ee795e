"""Instructions and last-level cache misses per simulated request of a virtual-time replay, counted by callgrind
(immune to machine load), kvemu's and the reference's.

Wall times on a shared 2-core machine swing by ±30 %; the instructions a run executes and the misses of callgrind's
simulated cache do not. This runs ``examples/mooncake-3600s.yaml`` in virtual mode (the same overrides as
``bench.profile``) for the first ``--requests`` N and 3N requests, each in its own ``valgrind --tool=callgrind
--cache-sim=yes`` child (``PYTHONHASHSEED=0``: string hashing cannot move the count; the cache is pinned to
``CACHE``, so the figures do not depend on the machine's), and prints the difference of their totals per request:
start-up, imports and the report cost the same in both, so they cancel out. With the reference installed
(ai-dynamo-runtime), its offline replay of the same first N and 3N rows is counted the same way, its per-request
INFO log off as in ``bench.replay`` (``DYN_LOG=warn``; ``--no-reference`` skips it). Slow (~100× under valgrind with the cache simulated): several minutes at the default N.

Prints ``instructions per request POLICY: I M`` and ``last-level cache misses per request POLICY: M`` (misses of the
simulated last-level cache, instruction and data, reads and writes), the reference's as ``... reference POLICY``
and the ratios ``... ratio vs reference: R x``, and the build that ran. Exits 2 without valgrind or the trace, 1 if a
run did not complete every request.

Run: python -m bench.instructions [--quick] [--policy kv|round_robin] [--requests N] [--trace PATH] [--no-reference]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
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
_REFERENCE_CHILD = """
import sys
from pathlib import Path
from harness import reference
summary = reference.run_reference(reference.replay_entry()[1], Path(sys.argv[2]), sys.argv[1])
sys.exit(0 if summary.get("completed_requests", summary.get("num_requests")) == int(sys.argv[3]) else 1)
"""
CACHE = ["--I1=32768,8,64", "--D1=32768,8,64", "--LL=8388608,16,64"]
"""The simulated caches (size, ways, line bytes): a common x86 server core's L1s and an 8 MiB last level."""
LL_MISSES = ("ILmr", "DLmr", "DLmw")
"""Callgrind's last-level miss events: instruction reads, data reads, data writes."""


@dataclass(frozen=True)
class Counts:
    """One child's totals: instructions executed and last-level cache misses."""

    instructions: int
    ll_misses: int


def counted(policy: str, trace: Path, requests: int, side: str = "kvemu") -> Counts | None:
    """Totals of one child replaying the first ``requests`` rows of ``trace`` (``side`` kvemu or reference)
    under callgrind with the cache simulated; None if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        if side == "reference":
            trace = first_rows(trace, requests, Path(tmp))
        cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", *CACHE, f"--callgrind-out-file={out}",
               sys.executable, "-c", _REFERENCE_CHILD if side == "reference" else _CHILD, policy, str(trace),
               str(requests)]
        done = subprocess.run(cmd, cwd=ROOT, env={"DYN_LOG": "warn", **os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0 or not out.is_file():
            print(f"# {side} {policy} {requests}: exit {done.returncode}: {done.stderr[-400:]}", flush=True)
            return None
        totals = event_totals(out.read_text(errors="replace"))
        return Counts(totals["Ir"], sum(totals.get(e, 0) for e in LL_MISSES))


def first_rows(trace: Path, rows: int, directory: Path) -> Path:
    """The first ``rows`` non-empty rows of ``trace``, in a file of ``directory`` (what ``run.max_requests``
    replays on kvemu's side)."""
    out = directory / "head.jsonl"
    kept = 0
    with trace.open() as src, out.open("w") as dst:
        for line in src:
            if kept >= rows:
                break
            if line.strip():
                dst.write(line)
                kept += 1
    return out


def event_totals(callgrind_out: str) -> dict[str, int]:
    """Each event's total in a callgrind output file, by name (its ``events:`` and ``summary:``/``totals:`` lines)."""
    names = re.search(r"^events:\s+(.+)$", callgrind_out, re.MULTILINE)
    found = re.search(r"^(?:summary|totals):\s+([\d ]+)$", callgrind_out, re.MULTILINE)
    if names is None or found is None:
        raise ValueError("no events: or no summary:/totals: line in the callgrind output")
    values = [int(v) for v in found.group(1).split()]
    return dict(zip(names.group(1).split(), values + [0] * (len(names.group(1).split()) - len(values))))


def total_instructions(callgrind_out: str) -> int:
    """The instruction count (``Ir``) of a callgrind output file."""
    return event_totals(callgrind_out)["Ir"]


def per_request(side: str, policy: str, trace: Path, n: int) -> tuple[float, float] | None:
    """(instructions in millions, last-level misses) per request: the 3N run's totals less the N run's, over 2N."""
    lo, hi = counted(policy, trace, n, side), counted(policy, trace, 3 * n, side)
    if lo is None or hi is None:
        return None
    return (hi.instructions - lo.instructions) / (2 * n) / 1e6, (hi.ll_misses - lo.ll_misses) / (2 * n)


def say(label: str, figures: tuple[float, float]) -> None:
    """Print one side's two figures (instructions in millions, last-level misses) per request."""
    print(f"instructions per request {label}: {figures[0]:.3f} M", flush=True)
    print(f"last-level cache misses per request {label}: {figures[1]:.0f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100 and 300 requests (a few minutes)")
    ap.add_argument("--policy", choices=("kv", "round_robin"), action="append", help="default: both")
    ap.add_argument("--requests", type=int, default=500, help="N: replays N and 3N requests (default 500)")
    ap.add_argument("--trace", type=Path, default=None, help="the Mooncake trace (default: the example's)")
    ap.add_argument("--no-reference", action="store_true", help="count kvemu only")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("bench.instructions: valgrind is not installed (apt install valgrind)", file=sys.stderr)
        return 2
    trace = existing_trace("bench.instructions", args.trace)
    if trace is None:
        return 2
    n = 100 if args.quick else args.requests
    import kvemu

    from harness import reference

    with_reference = not args.no_reference and reference.replay_entry() is not None
    print(f"# build: {'compiled' if getattr(kvemu, 'compiled', False) else 'pure'}; requests {n} and {3 * n}; "
          f"reference: {'counted' if with_reference else 'not counted'}", flush=True)
    problems: list[str] = []
    for policy in args.policy or ["kv", "round_robin"]:
        ours = per_request("kvemu", policy, trace, n)
        if ours is None:
            problems.append(f"{policy}: a callgrind run failed")
            continue
        say(policy, ours)
        if not with_reference:
            continue
        ref = per_request("reference", policy, trace, n)
        if ref is None:
            problems.append(f"reference {policy}: a callgrind run failed")
            continue
        say(f"reference {policy}", ref)
        print(f"instructions per request {policy} ratio vs reference: {ours[0] / ref[0]:.2f}x", flush=True)
        if ref[1] > 0:
            print(f"last-level cache misses per request {policy} ratio vs reference: {ours[1] / ref[1]:.2f}x",
                  flush=True)
    return verdict("instructions", problems)


if __name__ == "__main__":
    sys.exit(main())
