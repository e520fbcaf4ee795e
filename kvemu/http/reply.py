"""One HTTP request's answer: its generations' progress as the backend reports it, and the response written
from it (SSE chunks as tokens arrive as vLLM streams them, or one JSON body at the end, with usage and nvext)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec

from kvemu.clock import Clock
from kvemu.http.asgi import Send
from kvemu.http.errors import error_body, failure_status
from kvemu.http.protocol import ChatRequest, CompletionRequest, Hints
from kvemu.records import RequestRecord

__all__ = ["CLOSE_HEADERS", "Gen", "JSON_HEADERS", "Reply", "Run", "SSE_DONE", "SSE_HEADERS", "respond", "timing"]

JSON_HEADERS = [(b"content-type", b"application/json")]
CLOSE_HEADERS = [*JSON_HEADERS, (b"connection", b"close")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
SSE_DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.encode


class Run:
    """The generations of one HTTP request: tokens not yet written, records of the ended, who waits."""

    __slots__ = ("pending", "records", "left", "waiter", "gone")

    def __init__(self, k: int) -> None:
        self.pending = [0] * k
        self.records: list[RequestRecord | None] = [None] * k
        self.left = k
        self.waiter: asyncio.Future[None] | None = None
        self.gone = False

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def tokens(self, i: int, n: int) -> None:
        self.pending[i] += n
        self._wake()

    def ended(self, i: int, record: RequestRecord) -> None:
        self.records[i] = record
        self.left -= 1
        self._wake()

    def disconnected(self, _task: object = None) -> None:
        self.gone = True
        self._wake()

    def has_news(self) -> bool:
        return self.gone or any(self.pending) or any(r is not None for r in self.records)

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None


@dataclasses.dataclass(slots=True, eq=False)
class Gen:
    """One generation (one prompt) of a request: its id, prompt, output plan and what was written of it."""

    rid: str
    prompt_len: int
    n_out: int
    budget: int
    texts: list[str]
    written: int = 0
    first_ns: int | None = None
    """When its first token was written to the client (the front end's clock)."""

    @property
    def finish_reason(self) -> str:
        """``length`` when the output ran to its budget, else ``stop``."""
        return "length" if self.n_out >= self.budget else "stop"


async def respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Send a whole response (JSON unless other headers are given); a client that is gone is no error."""
    try:
        await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS if headers is None else headers})
        await send({"type": "http.response.body", "body": body})
    except OSError:  # the client is gone
        pass


class Reply:
    """Writes one request's response: SSE chunks as tokens arrive, or one JSON body at the end."""

    def __init__(self, rid: str, chat: bool, gens: list[Gen], req: CompletionRequest | ChatRequest, hints: Hints,
                 send: Send, arrived_ns: int,
                 *, model: str, created_s: int, clock: Clock, block_size: int,
                 kv_answer: Callable[[str], dict[str, Any] | None] | None = None) -> None:
        self.model = model
        self.kv_answer = kv_answer
        """A finished prefill leg's ``kv_transfer_params`` by request id (its answer carries them, as vLLM's)."""
        self.clock = clock
        self.block_size = block_size
        self.rid = rid
        self.chat = chat
        self.gens = gens
        self.req = req
        self.hints = hints
        self.send = send
        self.arrived_ns = arrived_ns
        self.head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created_s, "model": model}
        opts = req.stream_options
        self._out: list[bytes] = []
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous = bool(opts and opts.continuous_usage_stats)

    async def _failed_early(self, run: Run) -> str | None:
        """If a generation failed before anything was written, answer with its status; returns the status word."""
        for rec in run.records:
            if rec is not None and rec.failure is not None:
                await respond(self.send, failure_status(rec.failure),
                               error_body(failure_status(rec.failure), f"request failed: {rec.failure}"))
                return "error"
        return None

    async def whole(self, run: Run) -> str:
        while run.left and not run.gone:
            if any(r is not None and r.failure for r in run.records):
                break
            await run.wait()
        if run.gone:
            return "cancelled"
        failed = await self._failed_early(run)
        if failed:
            return failed
        choices = []
        for i, (g, rec) in enumerate(zip(self.gens, run.records)):
            assert rec is not None
            g.written = rec.output_tokens
            text = "".join(g.texts[: rec.output_tokens])
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text, "tool_calls": []},
                                "logprobs": None, "finish_reason": g.finish_reason, "stop_reason": None})
            else:
                choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": g.finish_reason,
                                "stop_reason": None, "prompt_logprobs": None})
        body = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.head["created"], "model": self.model, "choices": choices,
                "usage": self._usage(run.records)}
        if self.kv_answer is not None and (params := self.kv_answer(self.rid)) is not None:
            body["kv_transfer_params"] = params
        self._nvext(body, run.records)
        await respond(self.send, 200, _encode(body))
        return "success"

    async def stream(self, run: Run) -> str:
        """SSE: what is ready at each wake-up leaves in one write (the events stay one per chunk, as vLLM's)."""
        send = self.send
        out = self._out
        started = False
        clock = self.clock
        try:
            while True:
                if run.gone:
                    return "cancelled"
                if not started:
                    if not run.has_news():
                        await run.wait()
                        continue
                    if not any(run.pending) and (failed := await self._failed_early(run)):
                        return failed
                    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
                    started = True
                    if self.chat:
                        for i in range(len(self.gens)):
                            self._chunk(i, {"role": "assistant", "content": ""}, None)
                for i, g in enumerate(self.gens):
                    n = run.pending[i]
                    if not n:
                        continue
                    run.pending[i] = 0
                    if g.first_ns is None:
                        g.first_ns = clock.now_ns()
                    lo, g.written = g.written, min(g.written + n, g.n_out)
                    text = "".join(g.texts[lo:g.written])
                    last = g.written >= g.n_out
                    self._chunk(i, {"content": text} if self.chat else text, g.finish_reason if last else None)
                failure = next((r.failure for r in run.records if r is not None and r.failure), None)
                if failure is not None:
                    out.append(b"data: " + error_body(failure_status(failure), f"request failed: {failure}") + b"\n\n")
                    out.append(SSE_DONE)
                    await self._write(False)
                    return "error"
                if not run.left and not any(run.pending):
                    break
                if out:
                    await self._write(True)
                else:
                    await run.wait()
            if self.include_usage:
                usage: dict[str, Any] = {**self.head, "choices": [], "usage": self._usage(run.records)}
                self._nvext(usage, run.records)
                out.append(b"data: " + _encode(usage) + b"\n\n")
            out.append(SSE_DONE)
            await self._write(False)
            return "success"
        except OSError:  # the client went away while we wrote
            run.gone = True
            return "cancelled"

    async def _write(self, more: bool) -> None:
        body = b"".join(self._out)
        self._out.clear()
        await self.send({"type": "http.response.body", "body": body, "more_body": more})

    def _chunk(self, i: int, delta: Any, finish: str | None) -> None:
        if self.chat:
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": i, "text": delta, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        chunk: dict[str, Any] = {**self.head, "choices": [choice]}
        if self.continuous:
            g = self.gens[i]
            chunk["usage"] = {"prompt_tokens": g.prompt_len, "completion_tokens": g.written,
                              "total_tokens": g.prompt_len + g.written}
        self._out.append(b"data: " + _encode(chunk) + b"\n\n")

    def _usage(self, records: list[RequestRecord | None]) -> dict[str, Any]:
        prompt = sum(g.prompt_len for g in self.gens)
        out = sum(r.output_tokens for r in records if r is not None)
        cached = sum(r.engine.cached_tokens or 0 for r in records if r is not None)
        return {"prompt_tokens": prompt, "total_tokens": prompt + out, "completion_tokens": out,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _nvext(self, body: dict[str, Any], records: list[RequestRecord | None]) -> None:
        fields = self.hints.extra_fields
        rec = records[0]
        if not fields or rec is None:
            return
        nv: dict[str, Any] = {}
        if "worker_id" in fields:
            nv["worker_id"] = {"prefill_worker_id": rec.worker_id, "prefill_dp_rank": rec.dp_rank,
                               "decode_worker_id": rec.worker_id, "decode_dp_rank": rec.dp_rank}
        if "timing" in fields:
            nv["timing"] = timing(rec, self.block_size)
        body["nvext"] = nv


def _ms(a: int | None, b: int | None) -> float | None:
    return None if a is None or b is None else round((b - a) / 1e6, 3)


def timing(rec: RequestRecord, block_size: int) -> dict[str, Any]:
    """Where the time of one request went, as the router and the engine saw it (milliseconds)."""
    n = rec.output_tokens
    return {
        "queue_ms": _ms(rec.queued_ns, rec.routed_ns) if rec.queued_ns is not None else 0.0,
        "routing_ms": _ms(rec.arrival_ns, rec.routed_ns),
        "engine_queue_ms": _ms(rec.routed_ns, rec.engine.admitted_ns),
        "ttft_ms": _ms(rec.arrival_ns, rec.first_token_ns),
        "itl_ms": (_ms(rec.first_token_ns, rec.completion_ns) or 0.0) / (n - 1) if n > 1 else None,
        "total_time_ms": _ms(rec.arrival_ns, rec.completion_ns),
        "cached_tokens": rec.engine.cached_tokens or 0,
        "predicted_cached_tokens": (rec.predicted_overlap_blocks or 0) * block_size,
        "kv_hit_rate": round((rec.engine.cached_tokens or 0) / rec.isl, 4) if rec.isl else 0.0,
        "routing_reason": rec.routing_reason,
    }
