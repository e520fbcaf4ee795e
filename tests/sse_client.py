"""A streaming OpenAI client for live tests: how each stream through a kvemu front door ended (its chunks, its
usage, an error event, ``[DONE]``), and its first-token and end times."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


@dataclass
class Streamed:
    """One streamed chat completion as the client saw it."""

    session: str
    status: int | None = None
    chunks: int = 0
    """Chunks that carried choices (tokens)."""
    usage: dict | None = None
    error: str | None = None
    """The message of an SSE error event (or of the connection's failure)."""
    done: bool = False
    """``data: [DONE]`` was read."""
    ttft_s: float | None = None
    e2e_s: float | None = None
    ended_at: float | None = None
    """When it ended (``time.monotonic``)."""
    first_token: threading.Event = field(default_factory=threading.Event)

    @property
    def ended_with_reason(self) -> bool:
        """Ended as a stream must: ``[DONE]`` after its usage, or ``[DONE]`` after an error event naming why."""
        return self.done and (self.usage is not None or bool(self.error))

    @property
    def completed(self) -> bool:
        return self.done and self.usage is not None and self.error is None


def stream_chat(base: str, session: str, max_tokens: int, out: Streamed | None = None,
                timeout_s: float = 120.0) -> Streamed:
    """Stream a chat completion of exactly ``max_tokens`` tokens (``ignore_eos``) in ``session``."""
    s = out or Streamed(session)
    body = json.dumps({"model": "kvemu", "messages": [{"role": "user", "content": "hello " * 40}],
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "x-session-id": session})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            s.status = resp.status
            for raw in resp:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    s.done = True
                elif line.startswith("data: "):
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        s.error = obj["error"].get("message") or "error"
                    if obj.get("usage"):
                        s.usage = obj["usage"]
                    if obj.get("choices"):
                        s.chunks += 1
                        if s.ttft_s is None:
                            s.ttft_s = time.monotonic() - t0
                            s.first_token.set()
    except urllib.error.HTTPError as exc:
        s.status, s.error = exc.code, exc.read().decode(errors="replace")
    except OSError as exc:  # the connection was cut
        s.error = s.error or f"connection: {exc!r}"
    s.ended_at = time.monotonic()
    s.e2e_s = s.ended_at - t0
    s.first_token.set()
    return s


def open_streams(base: str, sessions: list[str], max_tokens: int | list[int]) -> tuple[list[Streamed],
                                                                                      list[threading.Thread]]:
    """Start one streaming request per session, each in a thread of its own."""
    sizes = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(sessions)
    streams = [Streamed(s) for s in sessions]
    threads = [threading.Thread(target=stream_chat, args=(base, s.session, n, s), daemon=True)
               for s, n in zip(streams, sizes)]
    for t in threads:
        t.start()
    return streams, threads
