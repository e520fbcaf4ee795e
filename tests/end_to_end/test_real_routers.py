"""kvemu workers behind real third-party routers, on 127.0.0.1: what the routers ask a worker before routing to
it (``/server_info``, ``/model_info``, ...) and the DP rank they pick, as a worker's own per-rank metrics see it.

Each test skips, saying so, when its router's command is not installed (``pip install sglang-router==0.3.2``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.procs.up import Children

from tests.conftest import reference_unavailable

from tests.kvemu.http.test_worker_server import SCENARIO  # 1 worker x 2 ranks, blocks of 16 tokens

pytestmark = pytest.mark.third_party_routers

TWO_WORKERS = ["--set", "cluster.workers=2", "--set", "cluster.engine.decode_speedup_ratio=10"]
"""Two workers; decoding slow enough that a long answer keeps its rank busy while other requests are routed."""
PREFIX_A = "You plan software releases step by step and write a test for every step of the plan. " * 2
PREFIX_B = "A different conversation entirely: how to grow tomatoes on a small balcony in the north. " * 2


def _command(name: str) -> str:
    """The router's command, from this interpreter's environment or the PATH; skips the test when it is missing."""
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found is None:  # (a failure under KVEMU_REQUIRE_REFERENCE=1, as in CI, where the dev extras have it)
        reference_unavailable(f"{name} is not installed (pip install 'kvemu[routers]'): this test runs the real router")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _per_rank(workers: list[str]) -> dict[tuple[int, int], tuple[float, float]]:
    """Each (worker index, rank)'s requests ended and prompt tokens found cached, from its worker's ``/metrics``."""
    out: dict[tuple[int, int], list[float]] = {}
    for i, url in enumerate(workers):
        for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for s in fam.samples:
                key = (i, int(s.labels.get("engine", -1)))
                if s.name == "vllm:request_success_total":
                    out.setdefault(key, [0.0, 0.0])[0] += s.value
                elif s.name == "vllm:prefix_cache_hits_total":
                    out.setdefault(key, [0.0, 0.0])[1] += s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def test_sglang_router_dp_aware_learns_the_ranks_and_pins_each_prefix_to_one(tmp_path):
    """sglang-router 0.3.2 ``--dp-aware --policy cache_aware`` in front of 2 kvemu workers x 2 ranks: it learns
    each worker's DP size from ``/server_info`` (without it the worker is never registered) and sends
    ``data_parallel_rank``; the worker runs the request on that rank, so a repeated prefix stays on one rank and
    finds its blocks cached there, and a new prefix sent while that rank is busy goes to another rank."""
    router_cmd = _command("sglang-router")
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO)
    kids = Children()
    router_log = tmp_path / "sglang-router.log"
    router = None
    try:
        served = kids.start("serve", ["serve", str(scenario), *TWO_WORKERS, "--http", "127.0.0.1:0", "--worker-http"],
                            timeout_s=60)
        workers = served["worker_http"]
        ids = {w["worker_id"]: i for i, w in enumerate(served["worker_info"])}
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        with router_log.open("w") as log:
            router = subprocess.Popen(
                [router_cmd, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                 "--dp-aware", "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
                 "--prometheus-port", str(_free_port()), "--worker-startup-timeout-secs", "30",
                 "--worker-startup-check-interval", "1"], stdout=log, stderr=subprocess.STDOUT)
        with httpx.Client(base_url=base, timeout=30) as http:
            deadline = time.monotonic() + 40
            registered = None
            while registered != 4:
                assert router.poll() is None, f"sglang-router exited: {router_log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, (
                    f"sglang-router registered {registered} of 4 worker ranks in 40 s (does every worker answer "
                    f"/server_info with dp_size?): {router_log.read_text()[-3000:]}")
                try:
                    registered = http.get("/workers").json()["total"]
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                time.sleep(0.2)

            def post(prompt: str, max_tokens: int = 2) -> tuple[tuple[int, int], int]:
                r = http.post("/v1/completions", timeout=60,
                              json={"model": "kvemu", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                                    "nvext": {"extra_fields": ["worker_id"]}})
                assert r.status_code == 200, r.text
                body = r.json()
                served_by = body["nvext"]["worker_id"]
                return ((ids[served_by["decode_worker_id"]], served_by["decode_dp_rank"]),
                        body["usage"]["prompt_tokens_details"]["cached_tokens"])

            group_a = [post(PREFIX_A + f"Question {i}?") for i in range(2)]
            (x, _), (x2, cached_a) = group_a
            assert x2 == x and cached_a > 0, group_a  # the repeated prefix stayed on its rank and hit its cache

            # a long request keeps rank x busy; a new prefix meanwhile goes to the least loaded rank, another one
            long: list[tuple[tuple[int, int], int]] = []
            busy = threading.Thread(target=lambda: long.append(post(PREFIX_A + "Go on at length.", 20000)))
            busy.start()
            deadline = time.monotonic() + 20
            while not httpx.get(f"{workers[x[0]]}/get_load", timeout=10).json()[x[1]]["num_reqs"]:
                assert time.monotonic() < deadline and busy.is_alive(), "the long request never ran on its rank"
                time.sleep(0.02)
            group_b = [post(PREFIX_B + f"Question {i}?") for i in range(2)]
            still_busy = httpx.get(f"{workers[x[0]]}/get_load", timeout=10).json()[x[1]]["num_reqs"]
            busy.join(120)
            assert not busy.is_alive()
        (y, _), (y2, cached_b) = group_b
        assert still_busy, "the long request ended before the second prefix was routed: nothing was busy"
        assert long[0][0] == x
        assert y != x and y2 == y and cached_b > 0, (x, group_b)

        # the workers' own per-rank view agrees: x ran 3 requests, y 2, the other ranks none
        seen = _per_rank(workers)
        assert {k: v[0] for k, v in seen.items() if v[0]} == {x: 3, y: 2}
        assert seen[x][1] >= cached_a + long[0][1] and seen[y][1] == cached_b
    finally:
        if router is not None:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()
        kids.stop_all()
