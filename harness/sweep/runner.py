"""Drive a sweep: submit its unfinished runs to an executor, record each as it finishes, write the outputs.

Ctrl-C or SIGTERM (raised here as ``KeyboardInterrupt``) stops submitting, aborts the executor, keeps every run
that finished and still writes sweep.csv, sweep.json and sweep.md (whole: a second signal meanwhile is only
said); running the same sweep again resumes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, as_completed
from harness.run.interrupts import held_signals
from harness.sweep.executors import abort_executor, result_of
from harness.sweep.spec import PointResult, PointSpec, run_point
from harness.sweep.report import write_sweep_report
from harness.sweep.results import SweepStore, SweepTiming

__all__ = ["SweepOutcome", "run_sweep", "OnResult"]

OnResult = Callable[[PointResult, int, int], None]
"""``on_result(result, runs finished so far, runs to do)``, called in the driver as each run finishes."""


class SweepOutcome:
    """What a sweep did: runs done now and reused, statuses, whether (and why) it stopped early."""

    def __init__(self, ran: int, reused: int, counts: dict[str, int], interrupted: str | None,
                 wall_time_s: float) -> None:
        self.ran = ran
        self.reused = reused
        self.counts = counts
        self.interrupted = interrupted
        """``SIGINT`` or ``SIGTERM`` if the sweep was stopped, else None."""
        self.wall_time_s = wall_time_s

    @property
    def failed(self) -> int:
        """Runs that failed or stopped early."""
        return self.counts.get("failed", 0) + self.counts.get("partial", 0)


def run_sweep(store: SweepStore, executor: Executor | None, *, on_result: OnResult | None = None,
              executor_name: str = "", report: bool = True,
              runner: Callable[[PointSpec], PointResult] = run_point, stopped: str | None = None) -> SweepOutcome:
    """Run ``store``'s unfinished runs on ``executor`` (None only when there is nothing to run, or when
    ``stopped``: the signal that stopped the sweep before it started), recording each result as it arrives, then
    write sweep.csv, sweep.json and (``report``) sweep.md."""
    todo = store.todo()
    started = time.perf_counter()
    interrupted: str | None = stopped
    futures: dict[Future[PointResult], PointSpec] = {}
    done: set[Future[PointResult]] = set()
    try:
        if todo and stopped is None:
            assert executor is not None, "runs to do need an executor"
            for run in todo:
                futures[executor.submit(runner, run)] = run
            for future in as_completed(futures):
                _finish(store, future, futures[future], done, on_result, len(todo))
    except KeyboardInterrupt as exc:
        interrupted = getattr(exc, "reason", "SIGINT")
    # the outputs are written whole: a signal meanwhile (a second Ctrl-C) is said, not obeyed
    with held_signals([], say="the sweep's outputs are being written; kvemu stops once they are"):
        if interrupted:  # (the plots take a second or two: say why nothing seems to happen)
            print(f"kvemu sweep: {interrupted}: writing sweep.csv, sweep.json and sweep.md in {store.outdir}",
                  file=sys.stderr, flush=True)
        if interrupted and executor is not None:
            abort_executor(executor)
        for future, run in futures.items():  # keep what finished meanwhile
            if future not in done and future.done() and not future.cancelled() and future.exception() is None:
                _finish(store, future, run, done, on_result, len(todo))
        return _write(store, executor_name, started, len(done), interrupted, report)


def _write(store: SweepStore, executor_name: str, started: float, ran: int, interrupted: str | None,
           report: bool) -> SweepOutcome:
    """Write the sweep's outputs (sweep.md with ``report``); what it did."""
    wall = time.perf_counter() - started
    counts = dict(sorted(store.counts().items()))
    store.write(SweepTiming(executor=executor_name, wall_time_s=round(wall, 6), runs_ran=ran,
                            runs_reused=store.reused, interrupted=interrupted))
    store.close()
    if report:
        note = None
        if interrupted and not counts.get("ok"):
            note = (f"Interrupted ({interrupted}) before any run finished: nothing to report yet; run the same "
                    f"sweep again to resume ({counts.get('pending', 0)} runs to do).")
        elif interrupted:
            note = (f"Interrupted ({interrupted}): {counts.get('pending', 0)} runs did not finish; run the same "
                    "sweep again to resume.")
        write_sweep_report(store.sweep, store.ordered(), store.outdir, note)
    return SweepOutcome(ran, store.reused, counts, interrupted, wall)


def _finish(store: SweepStore, future: Future[PointResult], run: PointSpec, done: set[Future[PointResult]],
            on_result: OnResult | None, total: int) -> None:
    result = result_of(future, run)
    store.record(result)
    done.add(future)
    if on_result is not None:
        on_result(result, len(done), total)
