"""The built-in quickstart as a newcomer meets it: ``kvemu run`` in a fresh process, from start to exit.

Each round runs ``python -m harness.cli run --quiet`` (the built-in quickstart: 4 workers x 2 DP ranks, synthetic
sessions, virtual time) in a new process with the bytecode cache warm, as an installed kvemu has it, and times the
process from start to exit, with ``--plots background`` (what a person at a terminal waits for) and with ``--plots
wait`` (what a script waits for). Background rounds also time until the last plot is on disk, and wait for it
before the next round, so that no round shares the CPUs with the previous one's renderer.

Prints (best of the rounds, wall seconds; ``figure name: value unit``):
  quickstart end to end: S s                   (--plots background: the process's start to its exit)
  quickstart end to end, plots awaited: S s    (--plots wait)
  quickstart plots on disk: S s                (--plots background: the process's start to its last plot)
  quickstart build: compiled|pure              (the runs' own, from their summary.json)

Run: python -m bench.quickstart [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_PLOTS_TIMEOUT_S = 60.0


def _plots(outdir: Path) -> list[Path]:
    from harness.report.plots import PLOTS

    return [outdir / name for name in PLOTS]


def _one_run(outdir: Path, plots: str) -> tuple[float, float]:
    """Wall seconds to the process's exit, and to its last plot on disk."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as an installed kvemu runs
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "harness.cli", "run", "--quiet", "-o", str(outdir), "--plots", plots],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=outdir.parent)
    ended = time.perf_counter() - start
    deadline = time.monotonic() + _PLOTS_TIMEOUT_S
    while not all(p.exists() for p in _plots(outdir)):
        if time.monotonic() > deadline:
            raise SystemExit(f"bench.quickstart: the plots of {outdir} never appeared")
        time.sleep(0.005)
    return ended, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round of each (CI)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each mode (default 5)")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else max(1, args.rounds)
    with tempfile.TemporaryDirectory(prefix="kvemu-bench-quickstart-") as tmp:
        _one_run(Path(tmp) / "warm-up", "wait")  # writes the bytecode cache
        background: list[tuple[float, float]] = []
        waited: list[float] = []
        for i in range(rounds):
            background.append(_one_run(Path(tmp) / f"b{i}", "background"))
            waited.append(_one_run(Path(tmp) / f"w{i}", "wait")[0])
        build = json.loads((Path(tmp) / "w0" / "summary.json").read_text())["kvemu"]["build"]
    print(f"quickstart end to end: {min(b[0] for b in background):.2f} s")
    print(f"quickstart end to end, plots awaited: {min(waited):.2f} s")
    print(f"quickstart plots on disk: {min(b[1] for b in background):.2f} s")
    print(f"quickstart build: {build}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
