"""Where a sweep's runs execute: a local process pool, a Dask cluster or a Ray cluster, behind one API.

``open_executor(address, jobs)`` yields a ``concurrent.futures.Executor``: ``submit(fn, *args)`` returns a
``concurrent.futures.Future``, so ``as_completed`` and ``wait`` work the same on all three. ``fn`` and its
arguments must be picklable and importable where they run (``harness.sweep.spec.run_point`` and a ``PointSpec``
are; the ``PointResult`` it returns comes back pickled, and ``result_of`` checks it against its bounds).
``abort_executor`` stops one early: pending work is cancelled, running local work killed.

Dask and Ray are imported only when asked for (``pip install 'kvemu[dask]'`` / ``'kvemu[ray]'``).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from typing import Any

import msgspec

from kvemu.errors import KvemuError

from harness.sweep.spec import PointResult, PointSpec

__all__ = ["MAX_JOBS", "ExecutorError", "open_executor", "abort_executor", "executor_kind", "result_of", "LocalPool",
           "RayExecutor", "LOCAL_START_METHOD", "LOCAL_PRELOAD"]

LOCAL_START_METHOD = "forkserver"
"""How local workers start: forked from a small server process that imported ``LOCAL_PRELOAD`` once. Not
plain fork: the caller may hold threads (a Dask client's, a progress bar's) that a fork would copy mid-lock."""
LOCAL_PRELOAD = ("harness.sweep.spec", "harness.run.runner", "harness.report.summary")
"""Imported once by the fork server, so each worker starts with kvemu loaded instead of importing it."""
DASK_WORKER_TIMEOUT_S = 60.0
"""How long to wait for a Dask cluster's first worker."""


class ExecutorError(KvemuError, RuntimeError):
    """An executor cannot be opened: an unknown address, a missing package, an unreachable cluster."""


def executor_kind(address: str | None) -> str:
    """``local``, ``dask`` (``tcp://``, ``tls://``) or ``ray`` (``ray://``, ``auto``) for an ``--address``."""
    if address is None or address == "":
        return "local"
    if address == "auto" or address.startswith("ray://"):
        return "ray"
    if address.startswith(("tcp://", "tls://")):
        return "dask"
    raise ExecutorError(f"--address {address!r}: expected tcp://HOST:PORT (a Dask scheduler), ray://HOST:PORT or "
                        "auto (a Ray cluster), or no --address for a local process pool")


MAX_JOBS = 1024
"""Most local worker processes ``--jobs`` may ask for (sweep, plan): past it a machine only thrashes."""


@contextlib.contextmanager
def open_executor(address: str | None = None, jobs: int | None = None) -> Iterator[Executor]:
    """An executor for ``address`` (see ``executor_kind``), shut down on exit; aborted if the block raises.

    ``jobs`` sizes the local pool (default: the CPU count) and is ignored by Dask and Ray, whose clusters
    decide. The local pool's workers import the caller's ``__main__`` module as any forkserver pool does: a
    script that opens one needs an ``if __name__ == "__main__":`` guard. Raises ``ExecutorError`` (naming ``pip install 'kvemu[dask]'`` or ``'kvemu[ray]'`` when the
    package is missing) before yielding.
    """
    kind = executor_kind(address)
    if kind == "local":
        executor: Executor = LocalPool(jobs)
        closer: Callable[[], None] = lambda: executor.shutdown(wait=True, cancel_futures=True)  # noqa: E731
    elif kind == "dask":
        executor, closer = _dask(address or "")
    else:
        executor, closer = _ray(address or "auto")
    try:
        yield executor
    except BaseException:
        abort_executor(executor)
        raise
    finally:
        closer()


def abort_executor(executor: Executor) -> None:
    """Stop ``executor`` now: cancel what has not started, kill what runs locally (remote tasks are cancelled)."""
    abort = getattr(executor, "abort", None)
    if callable(abort):
        abort()
        return
    try:
        executor.shutdown(wait=False, cancel_futures=True)
    except TypeError:  # Dask's ClientExecutor takes no cancel_futures: wait=False cancels
        executor.shutdown(wait=False)


def result_of(future: Future[PointResult], run: PointSpec) -> PointResult:
    """The run's result, checked against its bounds; a failed one when the executor lost it (a killed worker, a
    broken pool) or handed back something else (not a ``PointResult``, or one past a bound: the field named)."""
    try:
        result = future.result()
        if not isinstance(result, PointResult):
            raise TypeError(f"the executor handed back a {type(result).__name__}, not a PointResult")
        return result.checked()
    except msgspec.ValidationError as exc:
        return PointResult.failed(run, f"the run's result is out of bounds: {exc}")
    except Exception as exc:  # noqa: BLE001 - the executor's failure is this run's
        return PointResult.failed(run, f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------------- local


def _ignore_sigint() -> None:
    """Pool workers leave Ctrl-C to the parent, which stops the sweep and kills them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class LocalPool(ProcessPoolExecutor):
    """A process pool on this machine (``LOCAL_START_METHOD``) whose ``abort`` kills its workers."""

    def __init__(self, jobs: int | None = None) -> None:
        jobs = jobs or os.cpu_count() or 1
        if jobs < 1:
            raise ExecutorError(f"--jobs must be >= 1, got {jobs}")
        context = multiprocessing.get_context(LOCAL_START_METHOD)
        if LOCAL_START_METHOD == "forkserver":
            context.set_forkserver_preload(list(LOCAL_PRELOAD))
        super().__init__(max_workers=jobs, mp_context=context, initializer=_ignore_sigint)
        self.jobs = jobs

    def abort(self) -> None:
        """Cancel queued runs and kill the workers (a run in progress is lost; the sweep reruns it on resume)."""
        processes = list((getattr(self, "_processes", None) or {}).values())
        self.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                process.kill()


# ---------------------------------------------------------------------------------- dask


def _require(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ExecutorError(f"{module} is not installed ({exc}): pip install 'kvemu[{extra}]'") from None


def _dask(address: str) -> tuple[Executor, Callable[[], None]]:
    distributed = _require("distributed", "dask")
    try:
        client = distributed.Client(address, timeout="10s")
    except (OSError, TimeoutError) as exc:
        raise ExecutorError(f"cannot reach the Dask scheduler at {address}: {exc}") from None
    try:
        client.wait_for_workers(1, timeout=DASK_WORKER_TIMEOUT_S)
        errors = client.run(_worker_has_kvemu, on_error="return")
    except (OSError, TimeoutError) as exc:
        client.close()
        raise ExecutorError(f"the Dask cluster at {address} has no worker ({exc})") from None
    missing = {worker: str(err) for worker, err in errors.items() if err is not None}
    if missing:
        client.close()
        worker, err = next(iter(missing.items()))
        raise ExecutorError(f"kvemu is not importable on {len(missing)} Dask worker(s) (e.g. {worker}: {err}); "
                            "install it there (pip install kvemu) or upload a wheel with client.upload_file")
    executor = client.get_executor(pure=False)

    def close() -> None:
        executor.shutdown(wait=True)
        client.close()

    return executor, close


def _worker_has_kvemu() -> str | None:
    """On a Dask worker: None if the point runner imports there, else why not."""
    try:
        importlib.import_module("harness.sweep.spec")
    except Exception as exc:  # noqa: BLE001 - any import failure is the answer
        return f"{type(exc).__name__}: {exc}"
    return None


# ---------------------------------------------------------------------------------- ray


class RayExecutor(Executor):
    """``submit`` runs ``fn`` as a Ray task (``ray.remote(fn).remote(...)``) and returns its ``ObjectRef.future()``."""

    def __init__(self, ray: Any) -> None:
        self._ray = ray
        self._remote: dict[Callable[..., Any], Any] = {}
        self._refs: dict[Future[Any], Any] = {}
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self._shutdown:
            raise RuntimeError("cannot submit to a RayExecutor after shutdown")
        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = self._ray.remote(num_cpus=1)(fn)
        ref = remote.remote(*args, **kwargs)
        future: Future[Any] = ref.future()
        self._refs[future] = ref
        future.add_done_callback(lambda f: self._refs.pop(f, None))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shutdown = True
        if cancel_futures:
            self.abort()
        elif wait and self._refs:
            self._ray.wait(list(self._refs.values()), num_returns=len(self._refs))

    def abort(self) -> None:
        """Cancel every task not finished (running ones are interrupted)."""
        self._shutdown = True
        for ref in list(self._refs.values()):
            with contextlib.suppress(Exception):
                self._ray.cancel(ref, force=True)
        self._refs.clear()


def _ray(address: str) -> tuple[Executor, Callable[[], None]]:
    ray = _require("ray", "ray")
    started = False
    if not ray.is_initialized():
        import logging

        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        except ConnectionError as exc:
            raise ExecutorError(f"cannot reach the Ray cluster at {address}: {exc}") from None
        started = True
    executor = RayExecutor(ray)

    def close() -> None:
        executor.shutdown(wait=True)
        if started:
            ray.shutdown()

    return executor, close
