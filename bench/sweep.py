"""What running a sweep's points in parallel buys on this machine, and what a Dask cluster costs per point.

Workload: the built-in quickstart (4 workers x 2 DP ranks, synthetic sessions) with ``run.duration_s`` 240
(about 2-3 s of wall time a run here; ``--quick``: 30), at 8 seeds (7..14): 8 runs of the same size. The same
8 ``PointSpec``s run three ways:

* serially, in this process, one ``harness.sweep.spec.run_point`` after another (kvemu already imported);
* on a local pool of 2 processes (``harness.sweep.executors.open_executor(None, 2)``): its start (the fork server
  importing kvemu), the runs and its shutdown;
* where ``distributed`` is installed, on a Dask scheduler and 2 single-threaded workers started as processes on
  127.0.0.1 (their start not timed; the client's connection and its check that kvemu imports on every worker
  are).

Prints, one per line (``figure name: value unit``): ``serial wall``, ``local pool wall``, ``local pool wall
ratio vs serial`` (target: at most 0.6x on 2 cores), ``local pool target met``; with Dask, ``dask wall``,
``dask per-point overhead`` = (dask wall - local pool wall) / 8, what a point costs on Dask beyond the local
pool, and ``dask empty task round trip`` (median of 20 sequential ``operator.add`` tasks: the scheduler's
own latency). Every executor must give the same figures for every run (exit 1 otherwise, or when a run
fails); a missed target is reported, not an error (the machine may be busy).

Run: python -m bench.sweep [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import operator
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Executor
from pathlib import Path
from harness.sweep.executors import open_executor, result_of
from harness.sweep.spec import Figure, PointResult, PointSpec, parse_sweep, plan_runs, run_point
from bench import verdict

POINTS = 8
JOBS = 2
TARGET_RATIO = 0.6


def points(duration_s: float) -> list[PointSpec]:
    """8 runs of the quickstart: seeds 7..14."""
    return plan_runs(parse_sweep(f"set: {{run.duration_s: {duration_s:g}}}\naxes: {{cluster.workers: [4]}}\n"
                                 f"seeds: {POINTS}\n"))


def figures(results: list[PointResult]) -> list[tuple[int, int, str, dict[str, Figure]]]:
    """What must not depend on the executor: each run's status and figures, in run order."""
    return [(r.point, r.seed, r.status, r.figures) for r in sorted(results, key=lambda r: r.seed)]


def on(executor: Executor, runs: list[PointSpec]) -> list[PointResult]:
    return [result_of(f, run) for f, run in [(executor.submit(run_point, run), run) for run in runs]]


@contextlib.contextmanager
def local_dask_cluster(workdir: Path, workers: int = 2, timeout_s: float = 90.0) -> Iterator[str]:
    """A Dask scheduler and ``workers`` single-threaded workers as processes on 127.0.0.1; yields its address.

    Each process runs in a session of its own (a worker's nanny and its worker process with it) and is stopped
    as a group on exit, SIGKILL after 20 s.
    """
    import distributed

    info = workdir / "scheduler.json"
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> None:
        procs.append(subprocess.Popen([sys.executable, "-m", *args], cwd=workdir, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))

    try:
        start("distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
              "--scheduler-file", str(info))
        deadline = time.monotonic() + timeout_s
        while not info.exists() and procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the scheduler writes the file once it listens
        if not info.exists():
            raise RuntimeError("the Dask scheduler did not start")
        address = json.loads(info.read_text())["address"]
        for _ in range(workers):
            start("distributed.cli.dask_worker", address, "--host", "127.0.0.1", "--nthreads", "1", "--nworkers",
                  "1", "--no-dashboard")
        with distributed.Client(address, timeout="30s") as client:
            client.wait_for_workers(workers, timeout=timeout_s)
        yield address
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)


def dask_figures(runs: list[PointSpec], pool_wall: float) -> tuple[list[PointResult], dict[str, float]]:
    """The runs on a local Dask cluster of ``JOBS`` workers, and its figures."""
    import distributed

    with tempfile.TemporaryDirectory(prefix="kvemu-dask-") as workdir, \
            local_dask_cluster(Path(workdir), JOBS) as address:
        started = time.perf_counter()
        with open_executor(address) as executor:
            results = on(executor, runs)
        wall = time.perf_counter() - started
        with distributed.Client(address) as client:
            trips = []
            for k in range(20):
                t0 = time.perf_counter()
                client.submit(operator.add, k, 1, pure=False).result()
                trips.append(time.perf_counter() - t0)
    return results, {"wall": wall, "overhead": (wall - pool_wall) / len(runs), "trip": statistics.median(trips)}


def main(argv: list[str] | None = None) -> int:
    """Print the figures; 0 when every run succeeded with the same figures on every executor, else 1."""
    parser = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="runs of 30 s of scenario time instead of 240")
    args = parser.parse_args(argv)
    runs = points(30 if args.quick else 240)
    problems = []
    print(f"points: {len(runs)} (quickstart, run.duration_s {30 if args.quick else 240}, seeds "
          f"{runs[0].seed}..{runs[-1].seed})", flush=True)

    started = time.perf_counter()
    serial = [run_point(run) for run in runs]
    serial_wall = time.perf_counter() - started
    print(f"serial wall: {serial_wall:.2f} s", flush=True)

    started = time.perf_counter()
    with open_executor(None, JOBS) as executor:
        pooled = on(executor, runs)
    pool_wall = time.perf_counter() - started
    ratio = pool_wall / serial_wall
    print(f"local pool wall: {pool_wall:.2f} s", flush=True)
    print(f"local pool wall ratio vs serial: {ratio:.2f}x", flush=True)
    print(f"local pool target met: {'yes' if ratio <= TARGET_RATIO else 'no'} (<= {TARGET_RATIO}x on {JOBS} "
          f"processes; {os.cpu_count()} CPUs here)", flush=True)
    if any(r.status != "ok" for r in serial):
        problems.append("a serial run failed: " + "; ".join(str(r.error) for r in serial if r.error))
    if figures(pooled) != figures(serial):
        problems.append("the local pool's figures differ from the serial runs'")

    if importlib.util.find_spec("distributed") is None:
        print("# dask: skipped (pip install 'kvemu[dask]')", file=sys.stderr, flush=True)
    else:
        results, dask = dask_figures(runs, pool_wall)
        print(f"dask wall: {dask['wall']:.2f} s", flush=True)
        print(f"dask per-point overhead: {dask['overhead'] * 1000:.0f} ms", flush=True)
        print(f"dask empty task round trip: {dask['trip'] * 1000:.1f} ms", flush=True)
        if figures(results) != figures(serial):
            problems.append("Dask's figures differ from the serial runs'")
    return verdict("sweep", problems)


if __name__ == "__main__":
    sys.exit(main())
