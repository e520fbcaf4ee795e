"""A bounded flood of long streams against an OpenAI server on 127.0.0.1 (tests and the measurements of #43).

Raw asyncio sockets, not an HTTP client library: a few hundred streams must cost the client little CPU on a
2-core machine. Each stream reads and discards what arrives (a client that reads)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

__all__ = ["Flood", "flood", "rss_kb"]


def rss_kb(pid: int) -> int:
    """The resident set of process ``pid`` (kB, from /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@dataclass
class Flood:
    statuses: dict[int, int] = field(default_factory=dict)
    retry_after: set[str] = field(default_factory=set)
    metrics_s: list[float] = field(default_factory=list)
    """How long each ``GET /metrics`` took during the flood (inf: no answer in time)."""
    short_ttft_s: list[float] = field(default_factory=list)
    """Each short request's time to its first streamed token (inf: none in time)."""
    short_outcome: list[str] = field(default_factory=list)
    """Each short request's outcome: its HTTP status, or ``timeout`` / the error's type."""
    rss_kb: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    """The first error body of each status."""


async def _request(host: str, port: int, method: str, path: str, body: bytes = b"") -> tuple[asyncio.StreamReader,
                                                                                             asyncio.StreamWriter]:
    r, w = await asyncio.open_connection(host, port)
    w.write(f"{method} {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
    await w.drain()
    return r, w


async def _head(r: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status = int((await r.readline()).split()[1])
    headers = {}
    while (line := await r.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers


def _body(max_tokens: int, prompt: str) -> bytes:
    return json.dumps({"model": "kvemu", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True}).encode()


async def flood(url: str, pid: int, *, streams: int, max_tokens: int, seconds: float, probes: int = 5,
                probe_timeout_s: float = 10.0) -> Flood:
    """``streams`` streams of ``max_tokens`` started at once; for ``seconds`` meanwhile, ``probes`` rounds of a
    ``/metrics`` scrape and a 4-token streamed request, and the server's RSS sampled; then every stream is
    closed."""
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    out = Flood()
    writers: list[asyncio.StreamWriter] = []

    async def stream(i: int) -> None:
        try:
            r, w = await _request(host, port, "POST", "/v1/completions", _body(max_tokens, f"long {i}"))
        except OSError:
            out.statuses[-1] = out.statuses.get(-1, 0) + 1
            return
        writers.append(w)
        try:
            status, headers = await _head(r)
        except (OSError, ValueError, IndexError):
            status, headers = -1, {}
        out.statuses[status] = out.statuses.get(status, 0) + 1
        if "retry-after" in headers:
            out.retry_after.add(headers["retry-after"])
        if status != 200 and status not in out.errors:
            out.errors[status] = ""
            out.errors[status] = (await r.read(300)).decode("utf-8", "replace")
            return
        try:
            while await r.read(1 << 16):
                pass
        except OSError:
            pass

    async def probe(k: int) -> None:
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(probe_timeout_s):
                r, w = await _request(host, port, "GET", "/metrics")
                await _head(r)
                await r.read()
                w.close()
            out.metrics_s.append(time.monotonic() - t0)
        except (TimeoutError, OSError):
            out.metrics_s.append(float("inf"))
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(probe_timeout_s):
                r, w = await _request(host, port, "POST", "/v1/completions", _body(4, f"short {k}"))
                status, _ = await _head(r)
                out.short_outcome.append(str(status))
                if status == 200:
                    while b"data:" not in (await r.readline()):
                        pass
                w.close()
            out.short_ttft_s.append(time.monotonic() - t0 if status == 200 else float("inf"))
        except (TimeoutError, OSError, ValueError, IndexError) as exc:
            if len(out.short_outcome) < len(out.short_ttft_s) + 1:
                out.short_outcome.append("timeout" if isinstance(exc, TimeoutError) else type(exc).__name__)
            else:
                out.short_outcome[-1] += " then " + ("timeout" if isinstance(exc, TimeoutError) else type(exc).__name__)
            out.short_ttft_s.append(float("inf"))

    tasks = [asyncio.ensure_future(stream(i)) for i in range(streams)]
    t_end = time.monotonic() + seconds
    step = seconds / (probes + 1)
    for k in range(probes):
        await asyncio.sleep(step)
        out.rss_kb.append(rss_kb(pid))
        await probe(k)
        out.rss_kb.append(rss_kb(pid))
    while time.monotonic() < t_end:
        await asyncio.sleep(min(0.5, t_end - time.monotonic()))
        out.rss_kb.append(rss_kb(pid))
    for w in writers:
        w.close()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return out
