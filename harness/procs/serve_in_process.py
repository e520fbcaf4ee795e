"""``kvemu serve --in-process``: kvemu's router, its workers and its OpenAI front door in this one process.

The same cluster as ``kvemu run --mode live`` (the router on a ZeroMQ socket, the workers and their KV events
over ZeroMQ, on wall time), with the front door in front. Beside the process stack of ``kvemu serve`` it
spares a small machine one interpreter per worker, so kvemu's router can be compared with others in front of
a one-process ``kvemu fleet`` on equal terms (``kvemu bench-router``). The front door also serves the
engines' truth (``/kvemu/requests``, ``/kvemu/load``), from the records kvemu's router kept.
"""

from __future__ import annotations

import json
import signal
import sys

import anyio
import msgspec

from kvemu.clock import WallClock
from kvemu.hooks import HookEvent, Hooks
from kvemu.runtime.loop import run_live

from harness.run.cluster import Cluster, cluster
from harness.procs.engine_truth import EngineTruth
from harness.procs.protocol import HttpOptions
from harness.procs.worker import LOAD_SAMPLE_S
from harness.scenario import Scenario
from harness.text import counted
from harness.tuning import tune_gc

__all__ = ["serve_in_process"]


async def _sample(truth: EngineTruth, c: Cluster, clock: WallClock) -> None:
    while True:
        now = clock.now_ns()
        for wid, actor in sorted(c.workers.items()):
            truth.sample(now, actor.worker.cores, actor.dead_ranks.__contains__, worker_id=wid)
        await anyio.sleep(LOAD_SAMPLE_S)


async def _serve(scenario: Scenario, http: HttpOptions) -> None:
    from kvemu.http.server import HttpServer

    from harness.procs.frontdoor import front_door

    clock = WallClock()
    hooks = Hooks()
    truth = EngineTruth(-1)

    def ended(ev: HookEvent) -> None:
        if ev.record is not None and ev.record.worker_id is not None:  # it reached an engine
            truth.ended(ev.record, "length" if ev.kind == "completed" else "abort")

    hooks.subscribe(ended, "completed", "failed")
    async with cluster(scenario, clock, hooks, keep_history=False) as c:
        app = front_door(scenario, lambda: c.router, hooks, clock, tokenizer=http.tokenizer, model=http.model,
                         truth=truth, limits=http.admission, front=lambda: c.front)
        server = HttpServer(app, http.listen, http.server)
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)
            tg.start_soon(_sample, truth, c, clock)
            workers = sorted(c.workers)
            print(json.dumps({"event": "serving", "http": server.url, "in_process": True, "workers": len(workers),
                              "worker_ids": workers, "dp_size": scenario.cluster.dp_size}), flush=True)
            print(f"kvemu serve: OpenAI API at {server.url}/v1 ({counted(len(workers), 'worker')} in this process); "
                  "Ctrl-C stops", file=sys.stderr, flush=True)
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            tg.cancel_scope.cancel()


def serve_in_process(scenario: Scenario, http: HttpOptions) -> int:
    """Serve until SIGTERM/SIGINT (on wall time, whatever the scenario's ``run.mode``)."""
    scenario = msgspec.structs.replace(scenario, run=msgspec.structs.replace(scenario.run, mode="live"))
    tune_gc()
    run_live(lambda: _serve(scenario, http))
    return 0
