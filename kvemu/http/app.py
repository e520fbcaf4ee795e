"""The OpenAI-compatible HTTP application: a thin raw-ASGI app over a ``Backend``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as vLLM streams them, or whole),
``GET /v1/models``, ``GET /health`` (and SGLang's ``/health_generate``), ``GET /metrics``, SGLang's ``GET
/server_info`` and ``/model_info`` (and their old ``/get_`` names) and, on a worker, ``/get_load`` (and ``HEAD``
on each GET route), ``POST /tokenize``, ``POST /detokenize``, and vLLM's ``POST /v1/completions/render`` and
``/v1/chat/completions/render`` (a request's token ids, which vllm-router asks a worker for before routing
text). No framework and no task group per response: a request is parsed, submitted, and its
tokens are written as the backend reports them. One watcher per request notices the client leaving and
cancels the request in the engine. The status line waits for the first token, so a request refused before
producing anything gets a real status (400, 404, 429, 503) even when it asked for a stream. How an answer is
written (SSE chunks or one body, usage, nvext) is ``kvemu.http.reply``'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import functools
import itertools
import logging
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from kvemu.clock import NS_PER_S, Clock
from kvemu.http.admission import Admission, Refused
from kvemu.http.asgi import Message, Receive, Routes, Scope, Send
from kvemu.http.backend import Backend, Handoff
from kvemu.http.errors import ApiError, error_body
from kvemu.http.info import ServerInfo, load_body, model_info_body, models_body, server_info_body
from kvemu.http.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Hints,
    TokenizeRequest,
    check_prompt_length,
    decode_body,
    hints_of,
    output_budget,
    prompts_of,
)
from kvemu.http.reply import CLOSE_HEADERS, Gen, Reply, Run, respond
from kvemu.http.tokenizer import TextTokenizer
from kvemu.records import RequestRecord
from kvemu.messages import ClientRequest

__all__ = ["OpenAIApp", "Metrics", "read_body"]

_encode = msgspec.json.encode
log = logging.getLogger("kvemu.http")


class Metrics(Protocol):
    """What the app tells its metrics, and how they are exported (``GET /metrics``)."""

    def started(self) -> None: ...

    def refused(self, endpoint: str, stream: bool) -> None: ...

    def ended(self, endpoint: str, stream: bool, status: str, first_ns: int | None, arrived_ns: int, now_ns: int,
              records: list[RequestRecord | None], prompt_lens: list[int]) -> None: ...

    def render(self) -> tuple[bytes, str]: ...


class OpenAIApp:
    """An ASGI application serving the OpenAI routes over ``backend``.

    ``output_lengths`` draws how long an answer is when the client did not set ``ignore_eos`` (the
    scenario's output-length distribution; capped by ``max_tokens``, at least ``min_tokens``); without it
    every answer runs to its budget. ``rank_header`` is the header that pins a DP rank (the front door takes
    Dynamo's ``x-dp-rank``, a worker vLLM's ``x-data-parallel-rank``, or SGLang's ``data_parallel_rank``, one of
    ``info.dp_ranks``). ``info`` is what the server says of itself (``/server_info``, ``/get_load``).
    ``handoff`` (a prefill or decode worker) takes the legs of another router's disaggregated serving; without
    it their fields are ignored, as by a vLLM server with no KV connector.
    """

    def __init__(self, backend: Backend, tokenizer: TextTokenizer, *, model: str, clock: Clock,
                 metrics: Metrics | None = None, output_lengths: Callable[[], int] | None = None,
                 rank_header: str = "x-dp-rank", info: ServerInfo | None = None,
                 max_body_bytes: int = 16 << 20, body_timeout_s: float = 30.0, prompt_chars_per_token: int = 16,
                 off_loop_chars: int = 64 << 10,
                 extra_routes: Routes | None = None,
                 handoff: Handoff | None = None, admission: Admission | None = None) -> None:
        self.backend = backend
        self.admission = admission if admission is not None else Admission()
        """How many generation requests run and wait at once (past that: 429/503 with ``Retry-After``)."""
        self.handoff = handoff
        self.tok = tokenizer
        self.model = model
        self.clock = clock
        self.metrics = metrics
        self.output_lengths = output_lengths
        self.rank_header = rank_header
        self.info = info if info is not None else ServerInfo()
        self._own_ranks = self.info.dp_ranks if rank_header != "x-dp-rank" else None
        """The ranks a request may pin bare (a worker's own server); None at the front door (a rank names a worker)."""
        self.max_body_bytes = max_body_bytes
        """Larger bodies are refused with 413: at once when ``content-length`` says so, else when they reach it."""
        self.body_timeout_s = body_timeout_s
        """A body that takes longer to arrive is refused with 408 (with granian, which bounds only the headers'
        time; the uvicorn server bounds a whole request's time itself)."""
        self.max_prompt_chars = prompt_chars_per_token * backend.max_model_len
        """The most characters of prompt text one request may carry (its prompts together): more is refused
        before tokenizing, whatever the tokenizer (a tokenizer.json gives no bound of tokens by characters)."""
        self.off_loop_chars = off_loop_chars
        """Texts of a loop turn longer than this together are tokenized in a thread, not on the event loop."""
        self._tokenizer_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._unix_s: Callable[[], int] = getattr(clock, "unix_s", lambda: clock.now_ns() // NS_PER_S)
        """Seconds since the epoch for ``created`` (virtual clocks count from their start)."""
        self.created = self._unix_s()
        self._routes: Routes = {
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/health_generate"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/server_info"): self._server_info,
            ("GET", "/get_server_info"): self._server_info,
            ("GET", "/model_info"): self._model_info,
            ("GET", "/get_model_info"): self._model_info,
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/detokenize"): self._detokenize,
            ("POST", "/v1/completions/render"): self._render_completions,
            ("POST", "/v1/chat/completions/render"): self._render_chat,
        }
        if self.info.loads is not None:
            self._routes[("GET", "/get_load")] = self._load
        self._routes.update(extra_routes or {})  # (method, path) -> async handler(scope, receive, send)
        self._paths = {path for _, path in self._routes}
        self._to_tokenize: list[tuple[list[str], asyncio.Future[list[list[int]]]]] = []

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if kind != "http":
            return
        handler = self._routes.get((scope["method"], scope["path"]))
        if handler is None and scope["method"] == "HEAD":  # GET's status and headers, no body (as starlette)
            handler = self._routes.get(("GET", scope["path"]))
            if handler is not None:
                send = _headers_only(send)
        try:
            if handler is None:
                if scope["path"] in self._paths:
                    raise ApiError(405, f"method {scope['method']} is not allowed on {scope['path']}")
                raise ApiError(404, f"no route {scope['path']}")
            self._check_length(scope)
            await handler(scope, receive, send)
        except ApiError as exc:
            if self.metrics is not None and handler in (self._completions, self._chat):
                self.metrics.refused("chat_completions" if handler == self._chat else "completions", False)
            # a refused body is not read: the connection cannot carry another request
            await respond(send, exc.status, exc.body, exc.headers if isinstance(exc, Refused)
                          else CLOSE_HEADERS if exc.status in (408, 413) else None)
        except Exception as exc:  # noqa: BLE001 - a bug must not cost the client its answer
            log.exception("%s %s failed", scope["method"], scope["path"])
            await respond(send, 500, error_body(500, f"internal error: {type(exc).__name__}: {exc}"))

    def _check_length(self, scope: Scope) -> None:
        """413 before reading a body whose ``content-length`` is past the limit."""
        for name, value in scope["headers"]:
            if name.lower() == b"content-length":
                try:
                    n = int(value)
                except ValueError:
                    raise ApiError(400, "content-length header: not a number") from None
                if n > self.max_body_bytes:
                    raise ApiError(413, f"the request body is larger than {self.max_body_bytes} bytes "
                                        f"(content-length: {n})")

    async def _body(self, receive: Receive) -> bytes:
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await self._read_body(receive)
        except TimeoutError:
            raise ApiError(408, f"the request body took more than {self.body_timeout_s:g} s to arrive") from None

    async def _read_body(self, receive: Receive) -> bytes:
        return await read_body(receive, self.max_body_bytes)

    # ------------------------------------------------------------------ small routes

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, _encode(models_body(self.model, self.created, self.backend.max_model_len)))

    async def _server_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, _encode(server_info_body(self.model, self.backend.max_model_len,
                                                          self.backend.block_size, self.info)))

    async def _model_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, _encode(model_info_body(self.model, self.info)))

    async def _load(self, scope: Scope, receive: Receive, send: Send) -> None:
        loads = self.info.loads
        assert loads is not None  # the route exists only then
        await respond(send, 200, _encode(load_body(loads())))

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        why = self.backend.unavailable()
        if why is None:
            await respond(send, 200, b"", [])
        else:
            await respond(send, 503, error_body(503, why))

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.metrics is None:
            raise ApiError(404, "this server exports no metrics")
        body, content_type = self.metrics.render()
        await respond(send, 200, body, [(b"content-type", content_type.encode())])

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await self._body(receive), TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", "prompt")
        text: str | list[int]
        if req.prompt is not None:
            text = req.prompt
        else:
            text = prompts_of(ChatRequest(messages=req.messages), self.tok)[0]
        self._check_text_size([text], reserve=0)
        ids = (await self._tokens([text]))[0]
        await respond(send, 200, _encode({"count": len(ids), "max_model_len": self.backend.max_model_len,
                                           "tokens": ids}))

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await self._body(receive), DetokenizeRequest)
        self._check_model(req.model)
        try:
            text = self.tok.decode(req.tokens)
        except ValueError as exc:
            raise ApiError(400, f"tokens: {exc}", "tokens") from None
        await respond(send, 200, _encode({"prompt": text}))

    async def _render_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await self._body(receive), CompletionRequest)
        await respond(send, 200, _encode(await self._render(scope, req, False)))

    async def _render_chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = decode_body(await self._body(receive), ChatRequest)
        await respond(send, 200, _encode((await self._render(scope, req, True))[0]))

    async def _render(self, scope: Scope, req: CompletionRequest | ChatRequest, chat: bool) -> list[dict[str, Any]]:
        """vLLM's render: each prompt's token ids as one generate request (the chat route answers its one
        prompt's alone), validated as a generation's prompts are, nothing run."""
        self._check_model(req.model)
        raw_prompts = prompts_of(req, self.tok, self.backend.max_model_len)
        self._check_text_size(raw_prompts)
        prompts = await self._tokens(raw_prompts)
        for ids in prompts:
            check_prompt_length(len(ids), self.backend.max_model_len)
        base = _request_id(_headers(scope), chat)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return [{"request_id": base if len(prompts) == 1 else f"{base}-{i}", "token_ids": ids, "model": self.model,
                 "sampling_params": {"max_tokens": asked, "min_tokens": req.min_tokens, "ignore_eos": req.ignore_eos}}
                for i, ids in enumerate(prompts)]

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")

    # ------------------------------------------------------------------ generation

    def _check_text_size(self, prompts: list[str | list[int]], reserve: int = 1) -> None:
        """Refuse, before tokenizing, prompt text that could not fit the context: more characters than
        ``max_prompt_chars`` (any tokenizer), or a prompt whose lower bound of tokens reaches the context
        (the built-in tokenizer): one that leaves no room for ``reserve`` output tokens, which ``output_budget``
        would refuse after tokenizing."""
        texts = [p for p in prompts if isinstance(p, str)]
        size = sum(len(t) for t in texts)
        if size > self.max_prompt_chars:
            raise ApiError(400, f"prompt: {size} characters of prompt text, more than the {self.max_prompt_chars} "
                                f"this server tokenizes for a model whose maximum context length is "
                                f"{self.backend.max_model_len} tokens", "prompt")
        limit = self.backend.max_model_len
        for t in texts:
            if len(t) + reserve > limit and (n := self.tok.min_tokens(t)) + reserve > limit:
                raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                                    f"has at least {n} tokens. Please reduce the length of the prompt.", "prompt")

    async def _tokens(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of every prompt: texts arriving in one loop turn are tokenized together in one call; large
        texts in one thread (one at a time), so the loop keeps serving while they are."""
        texts = [p for p in prompts if isinstance(p, str)]
        if not texts:
            return prompts  # type: ignore[return-value]
        if sum(len(t) for t in texts) > self.off_loop_chars:
            if self._tokenizer_thread is None:
                self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, "kvemu-tokenize")
            ids = await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, _encode_large, self.tok,
                                                                   texts)
            encoded = iter(ids)
            return [next(encoded) if isinstance(p, str) else p for p in prompts]
        fut = asyncio.get_running_loop().create_future()
        pending = self._to_tokenize
        pending.append((texts, fut))
        if len(pending) == 1:
            asyncio.get_running_loop().call_soon(self._tokenize_pending)
        encoded = iter(await fut)
        return [next(encoded) if isinstance(p, str) else p for p in prompts]

    def _tokenize_pending(self) -> None:
        pending, self._to_tokenize = self._to_tokenize, []
        try:
            ids = self.tok.encode_many([t for texts, _ in pending for t in texts])
        except Exception as exc:  # noqa: BLE001 - every waiter gets the tokenizer's error
            for _, fut in pending:
                if not fut.done():
                    fut.set_exception(exc)
            return
        at = 0
        for texts, fut in pending:
            if not fut.done():  # its client may be gone
                fut.set_result(ids[at:at + len(texts)])
            at += len(texts)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, decode_body(await self._body(receive), CompletionRequest), False)

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, decode_body(await self._body(receive), ChatRequest), True)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, req: CompletionRequest | ChatRequest,
                        chat: bool) -> None:
        arrived = self.clock.now_ns()
        self._check_model(req.model)  # none given: the served model, as vLLM does
        headers = _headers(scope)
        hints = hints_of(req, headers, rank_header=self.rank_header, ranks=self._own_ranks)
        raw_prompts = prompts_of(req, self.tok, self.backend.max_model_len)
        self._check_text_size(raw_prompts)
        base = _request_id(headers, chat)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if asked is None:
            asked = self.backend.max_model_len if chat else 16  # chat: what the context leaves
        tokens = max(0, min(asked, self.backend.max_model_len)) * len(raw_prompts)
        long = tokens > self.admission.limits.long_tokens
        await self.admission.enter(long, tokens, base)  # before tokenizing: a refused request costs no more
        try:
            await self._admitted(scope, receive, send, req, chat, arrived, headers, hints, raw_prompts, base)
        finally:
            self.admission.leave(long, tokens)

    async def _admitted(self, scope: Scope, receive: Receive, send: Send, req: CompletionRequest | ChatRequest,
                        chat: bool, arrived: int,
                        headers: dict[str, str], hints: Hints, raw_prompts: list[str | list[int]], base: str) -> None:
        """Run a generation request that holds an admission slot, and write its answer."""
        prompts = await self._tokens(raw_prompts)
        default = None if chat else 16  # chat: what the context leaves, as vLLM
        handoff = self.handoff if req.kv_transfer_params is not None or req.bootstrap_room is not None else None
        if handoff is not None and len(prompts) != 1:
            raise ApiError(400, f"prompt: a disaggregated leg (kv_transfer_params, bootstrap_room) carries one prompt, "
                                f"not {len(prompts)}", "prompt")
        gens, reqs = [], []
        for i, tokens in enumerate(prompts):
            budget = output_budget(req, len(tokens), self.backend.max_model_len, default)
            n_out = budget
            if not req.ignore_eos and self.output_lengths is not None:
                n_out = max(req.min_tokens, min(budget, max(1, self.output_lengths())))
            rid = base if len(prompts) == 1 else f"{base}-{i}"
            leg = None
            if handoff is not None:
                leg = await handoff.leg(_client_request(rid, tokens, n_out, [], hints), req)
                n_out = budget = leg.max_tokens  # a prefill leg computes one token
            ids, texts = self.tok.output(rid, n_out)
            gens.append(Gen(rid, len(tokens), n_out, budget, texts))
            reqs.append(_client_request(rid, tokens, n_out, ids, hints) if leg is None
                        else msgspec.structs.replace(leg, output_token_ids=ids))
        run = Run(len(gens))
        stream = req.stream
        if self.metrics is not None:
            self.metrics.started()
        watcher = asyncio.ensure_future(receive())  # completes when the client leaves (any awaitable: granian)
        watcher.add_done_callback(run.disconnected)
        reply = Reply(base, chat, gens, req, hints, send, arrived, model=self.model, created_s=self._unix_s(),
                      clock=self.clock, block_size=self.backend.block_size,
                      kv_answer=handoff.answer if handoff is not None else None)
        status = "error"
        submitted = 0
        try:
            for i, r in enumerate(reqs):  # a backend that raises still gets the request's end recorded below
                self.backend.submit(r, functools.partial(run.tokens, i), functools.partial(run.ended, i))
                submitted += 1
            status = await (reply.stream(run) if stream else reply.whole(run))
        finally:
            watcher.remove_done_callback(run.disconnected)
            watcher.cancel()
            if run.left:  # the client left, or another generation failed: cancel what is still open
                for g, rec in zip(gens[:submitted], run.records):
                    if rec is None:
                        self.backend.cancel(g.rid, "client_disconnected" if run.gone else "sibling_failed")
                status = "cancelled" if run.gone else status
            if self.metrics is not None:
                first = min((g.first_ns for g in gens if g.first_ns is not None), default=None)
                self.metrics.ended("chat_completions" if chat else "completions", stream, status, first, arrived,
                                   self.clock.now_ns(), run.records, [g.prompt_len for g in gens])


async def read_body(receive: Receive, limit: int) -> bytes:
    """A request's whole body; 413 past ``limit`` bytes, 400 when the client leaves first."""
    chunks = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ApiError(400, "the client went away before sending its body")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes")
        chunks.append(chunk)
        if not msg.get("more_body"):
            return b"".join(chunks)


def _encode_large(tok: TextTokenizer, texts: list[str]) -> list[list[int]]:
    """``encode_many`` in the tokenizer thread, then hand the allocator's free pages back to the system: the
    tokenizer's intermediate structures are many times the text, and glibc keeps them otherwise."""
    try:
        return tok.encode_many(texts)
    finally:
        _trim()


def _trim() -> None:
    if _libc is not None:
        _libc.malloc_trim(0)


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


def _client_request(rid: str, tokens: list[int], n_out: int, ids: list[int], hints: Hints) -> ClientRequest:
    return ClientRequest(request_id=rid, tokens=tokens, max_tokens=n_out, session_id=hints.session_id,
                         parent_session_id=hints.parent_session_id, worker_id=hints.worker_id, dp_rank=hints.dp_rank,
                         priority=hints.priority, expected_output_tokens=hints.osl, output_token_ids=ids,
                         engine_priority=hints.engine_priority)


_ids = itertools.count()
_ID_PREFIX = uuid.uuid4().hex[:12]  # ids stay unique across processes and restarts


def _headers(scope: Scope) -> dict[str, str]:
    """A request's headers by lower-case name."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _request_id(headers: dict[str, str], chat: bool) -> str:
    given = headers.get("x-request-id")
    if given:
        if len(given) > 128:
            raise ApiError(400, "x-request-id header: at most 128 characters", "x-request-id")
        return given
    return f"{'chatcmpl' if chat else 'cmpl'}-{_ID_PREFIX}{next(_ids):x}"


def _headers_only(send: Send) -> Send:
    """``send`` for a HEAD request: the response's start as it is, every body message empty."""
    async def head_send(message: Message) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)
    return head_send
