"""The OpenAI front door and a worker's own HTTP server under load, from a client in another process.

``kvemu serve`` runs 2 worker processes x 2 DP ranks (zero-length engine passes, ``speedup_ratio: 0``) with
the front door on the router process and an HTTP server on every worker. This process drives it with a
small in-repo HTTP/1.1 client (keep-alive connections, no framework): streamed ``/v1/completions`` with
128-token prompts and 16 output tokens (``ignore_eos``), first through the front door, then straight to
one worker. Throughput comes from 64 connections in a closed loop; the HTTP layer's overhead from a light
phase (2 connections, so that no request waits behind others): the client's time from sending to
``data: [DONE]`` minus the time the server itself accounts for the request (``nvext.timing.total_time_ms``:
router or worker arrival to the last token), i.e. parsing, tokenizing, SSE and the sockets.
Loopback only; bounded in requests and time. Run: python -m bench.http [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from bench import verdict
from harness.report.stats import percentile
from harness.procs.up import cli_command, cli_env
from kvemu.runtime.loop import new_live_loop

SCENARIO = """
name: bench-http
cluster:
  workers: 2
  dp_size: 2
  engine: {block_size: 16, num_gpu_blocks: 65536, max_num_seqs: 1024, max_num_batched_tokens: 65536,
           speedup_ratio: 0, decode_speedup_ratio: 0}
router: {policy: kv}
run: {mode: live, seed: 1}
"""
_WORDS = [a + b + c for a in "bcdfghklmnprstvz" for b in "aeiou" for c in "bcdfgklmnprstxz"]


def prompts(n: int, seed: int = 7) -> list[str]:
    """``n`` distinct prompts of exactly 128 tokens for the built-in tokenizer (one 3-letter word each)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(128)) for _ in range(n)]


class Result:
    __slots__ = ("e2e_ns", "server_ms", "ok")

    def __init__(self, e2e_ns: int, server_ms: float | None, ok: bool) -> None:
        self.e2e_ns = e2e_ns
        self.server_ms = server_ms
        self.ok = ok


async def _connection(host: str, port: int, bodies: list[bytes], results: list[Result], budget: list[int],
                      stop_at: float) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while budget[0] > 0 and time.perf_counter() < stop_at:
            budget[0] -= 1
            body = bodies[budget[0] % len(bodies)]
            t0 = time.perf_counter_ns()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            head = await reader.readuntil(b"\r\n\r\n")
            ok = head.startswith(b"HTTP/1.1 200")
            if b"chunked" in head:  # SSE: the whole body at once (JSON never holds a raw CR LF, so the
                data = await reader.readuntil(b"\r\n0\r\n\r\n")  # terminator cannot occur earlier)
            else:
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                data = await reader.readexactly(length)
            e2e = time.perf_counter_ns() - t0
            server_ms = None
            at = data.rfind(b'"timing":')
            if at >= 0:
                server_ms = float(data[data.index(b'"total_time_ms":', at) + 16:].split(b",", 1)[0])
            results.append(Result(e2e, server_ms, ok and b"data: [DONE]\n\n\r\n0\r\n" in data[-40:]))
    finally:
        writer.close()


async def drive(url: str, *, requests: int, seconds: float, connections: int) -> tuple[list[Result], float]:
    """Send up to ``requests`` streamed completions over ``connections`` connections for at most ``seconds``."""
    parts = urlsplit(url)
    bodies = [json.dumps({"model": "kvemu", "prompt": p, "max_tokens": 16, "stream": True, "ignore_eos": True,
                          "stream_options": {"include_usage": True}, "nvext": {"extra_fields": ["timing"]}}).encode()
              for p in prompts(2000)]
    results: list[Result] = []
    budget = [requests]
    warm: list[Result] = []
    await _connection(parts.hostname, parts.port, bodies[:1], warm, [20], time.perf_counter() + 30)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    await asyncio.gather(*(_connection(parts.hostname, parts.port, bodies, results, budget, t0 + seconds)  # type: ignore[arg-type]
                           for _ in range(connections)))
    return results, time.perf_counter() - t0


def report(name: str, load: tuple[list[Result], float], light: tuple[list[Result], float]) -> bool:
    """Throughput from the loaded phase; the HTTP layer's overhead from the light one (no queueing in it)."""
    results, wall_s = load
    ok = [r for r in results if r.ok and r.server_ms is not None]
    quiet = [r for r in light[0] if r.ok and r.server_ms is not None]
    overhead = sorted(max(0.0, r.e2e_ns / 1e6 - r.server_ms) for r in quiet)  # type: ignore[operator]
    print(f"{name} streamed completions: {len(ok) / wall_s:.0f} per s")
    print(f"{name} overhead p50: {percentile(overhead, 50):.2f} ms")
    print(f"{name} overhead p99: {percentile(overhead, 99):.2f} ms")
    print(f"{name} completed: {len(ok) + len(quiet)} of {len(results) + len(light[0])} requests")
    return len(ok) == len(results) and len(quiet) == len(light[0])


def main(argv: list[str] | None = None) -> int:
    """Start the cluster, drive both servers, print the figures; 1 when a request failed."""
    parser = argparse.ArgumentParser(prog="python -m bench.http", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--http-server", choices=["uvicorn", "granian"], default="uvicorn")
    args = parser.parse_args(argv)
    requests, seconds = (1500, 3.0) if args.quick else (30000, 10.0)
    with tempfile.TemporaryDirectory() as tmp:
        scenario = Path(tmp) / "http.yaml"
        scenario.write_text(SCENARIO)
        proc = subprocess.Popen(cli_command("serve", str(scenario), "--http", "127.0.0.1:0", "--worker-http",
                                            "--http-server", args.http_server),
                                env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                return verdict("http", ["kvemu serve did not start"])
            info = json.loads(line)
            loop = new_live_loop()
            good = True
            for name, url in (("http front door", info["http"]), ("http worker", info["worker_http"][0])):
                load = loop.run_until_complete(drive(url, requests=requests, seconds=seconds,
                                                     connections=args.connections))
                light = loop.run_until_complete(drive(url, requests=requests // 10, seconds=seconds / 3,
                                                      connections=2))
                good = report(name, load, light) and good
            loop.close()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    return verdict("http", [] if good else ["a request did not complete"])


if __name__ == "__main__":
    sys.exit(main())
