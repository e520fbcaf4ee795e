"""``kvemu front``: an OpenAI front door in a process of its own, in front of router processes.

With ``router.replicas``, ``kvemu up --http`` and ``kvemu serve`` run one router process per replica and this
front door before them, as a load balancer sits before Dynamo's frontends or SGLang's gateway replicas. Each
request goes to the replica ``router.replica_front`` picks, through one link per router
(``harness.procs.replica_backend``: how tokens stream back and what happens when a router is lost); the app is
``harness.procs.frontdoor.replicas_front_door``.
"""

from __future__ import annotations

import signal

import anyio

from kvemu.clock import WallClock
from kvemu.http.server import HttpServer
from kvemu.runtime.loop import run_live

from harness.procs.frontdoor import replicas_front_door
from harness.procs.protocol import HttpOptions, log_start
from harness.procs.replica_backend import LOST_AFTER_S, PING_S, ReplicaCollector, RouterLink, RouterProcesses
from harness.scenario import Scenario

__all__ = ["RouterLink", "RouterProcesses", "ReplicaCollector", "front_main", "PING_S", "LOST_AFTER_S"]
# (``RouterLink``, ``RouterProcesses``, ``ReplicaCollector``, ``PING_S`` and ``LOST_AFTER_S`` live in
# ``harness.procs.replica_backend``, shared with ``harness.procs.frontdoor``)


async def _serve_front(scenario: Scenario, routers: list[str], http: HttpOptions, grace_s: float) -> None:
    clock = WallClock()
    links = [RouterLink(i, endpoint, clock) for i, endpoint in enumerate(routers)]
    app, backend = replicas_front_door(scenario, links, clock, tokenizer=http.tokenizer, model=http.model,
                                       limits=http.admission)
    server = HttpServer(app, http.listen, http.server)
    async with anyio.create_task_group() as tg:
        await tg.start(backend.serve)
        await tg.start(server.serve)
        log_start("front", http=server.url, routers=routers, replica_front=scenario.router.replica_front)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        # drain: open requests get up to grace_s to end (their routers answer them), then the rest fail here and
        # their routers are told to free them (a supervisor stops the routers after this process)
        with anyio.move_on_after(grace_s):
            while any(link.open for link in links):
                await anyio.sleep(0.01)
        backend.shut("front_door_shutdown")
        await anyio.sleep(0.05)  # let the streams write their ends and the cancels leave
        tg.cancel_scope.cancel()


def front_main(scenario: Scenario, routers: list[str], http: HttpOptions, grace_s: float = 10.0) -> int:
    """``kvemu front``: serve until SIGTERM/SIGINT."""
    if len(routers) != scenario.router.replicas:
        raise ValueError(f"{len(routers)} routers for router.replicas {scenario.router.replicas}")
    run_live(lambda: _serve_front(scenario, routers, http, grace_s))
    return 0
