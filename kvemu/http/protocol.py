"""OpenAI request bodies as real clients send them, validated into what kvemu runs, and the responses back.

Unknown fields are ignored (clients send sampling parameters an emulator has no use for); a field of the
wrong type or out of range is a 400 naming it, as vLLM answers. Routing hints are taken as Dynamo's
frontend takes them: ``nvext`` in the body and the session and pin headers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from kvemu.errors import InvalidArgument
from kvemu.http.errors import ApiError
from kvemu.http.tokenizer import ROLES, TextTokenizer
from kvemu.limits import (INT64_MAX, MAX_BODY_BYTES, MAX_ID_CHARS, MAX_PROMPT_TOKENS, RANK_MAX, I64, Count, Finite,
                          Name)
from kvemu.transfer import KvTransfer

__all__ = [
    "CompletionRequest",
    "ChatRequest",
    "TokenizeRequest",
    "DetokenizeRequest",
    "Hints",
    "KvTransferParams",
    "decode_body",
    "prompts_of",
    "hints_of",
    "output_budget",
    "check_prompt_length",
    "MAX_PROMPTS",
    "MAX_ID_BYTES",
]

MAX_PROMPTS = 256
"""Prompts one completions request may carry (each becomes one choice)."""
MAX_ID_BYTES = MAX_ID_CHARS
"""Session ids (as the affinity table bounds them)."""
EXTRA_FIELDS = ("worker_id", "timing")
T = TypeVar("T")

# Every integer a client sends is bounded to what the wire (msgpack) carries (``I64``): an integer beyond it would
# be accepted here and fail to encode later, on its way to a worker (#27: ``"priority": 10**30``).
Id = Annotated[int, Meta(ge=0, le=INT64_MAX)]
"""A worker instance id."""
Rank = Annotated[int, Meta(ge=0, le=RANK_MAX)]
"""A DP rank."""
Body = Annotated[str, Meta(max_length=MAX_BODY_BYTES)]
"""A prompt's or a message's text: at most what a body holds (``app.max_body_bytes``; ``prompts_of`` and the
app bound it by the model's context)."""
Model = Annotated[str, Meta(max_length=1024)]
"""A model name (a Hugging Face id or a path, as clients send it)."""


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class AgentHints(msgspec.Struct):
    priority: I64 | None = None
    osl: Count | None = None
    latency_sensitivity: Finite | None = None


class NvExt(msgspec.Struct):
    backend_instance_id: Id | None = None
    dp_rank: Rank | None = None
    agent_hints: AgentHints | None = None
    extra_fields: Annotated[list[Name], Meta(max_length=16)] | None = None


MAX_MESSAGES = 1 << 16
"""Messages of one chat request (and content parts of one message)."""
Text = Annotated[str, Meta(max_length=512)]
Port = Annotated[int, Meta(ge=0, le=65535)]
MAX_BLOCK_IDS = 1 << 17
"""Block ids one ``kv_transfer_params`` may list (2M tokens of 16-token blocks)."""
BlockIds = Id | Annotated[list[Id], Meta(max_length=MAX_BLOCK_IDS)]


class KvTransferParams(msgspec.Struct):
    """vLLM's ``kv_transfer_params`` (its NIXL connector's fields), with kvemu's own beside them.

    A prefill leg carries ``do_remote_decode``; its answer carries what a decode leg needs
    (``do_remote_prefill``, where the KV is), which the router copies into the decode leg as it is."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: Text | None = None
    remote_request_id: Text | None = None
    remote_block_ids: Annotated[list[BlockIds], Meta(max_length=MAX_BLOCK_IDS)] | None = None
    """vLLM's block ids, per KV cache group or flat (kvemu never reads them; bounded as they cross)."""
    remote_host: Annotated[str, Meta(min_length=1, max_length=253)] | None = None
    """The prefill worker: an IP literal or a DNS name (``harness.procs.kv_handoff.peer_url`` checks its form)."""
    remote_port: Annotated[int, Meta(ge=1, le=65535)] | None = None
    tp_size: Annotated[int, Meta(ge=1, le=1 << 16)] | None = None
    kvemu_source: KvTransfer | None = None
    """The prefill rank that holds the KV and its link model, as the prefill leg answered (the decode worker takes
    the link model from the prefill worker itself when it claims the KV; ``kvemu.transfer`` bounds it)."""
    kvemu_release_token: Annotated[str, Meta(max_length=128)] | None = None
    """What the decode worker shows the prefill worker to free the held KV (only whoever got the answer can)."""


class _Generate(msgspec.Struct):
    model: Model | None = None
    max_tokens: I64 | None = None
    max_completion_tokens: I64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: I64 = 0
    n: I64 = 1
    echo: bool = False
    logprobs: Any = None
    priority: I64 = 0
    seed: I64 | None = None
    """Taken (as vLLM takes it) and bounded; the emulator's output does not depend on it."""
    data_parallel_rank: Any = None
    """SGLang's rank pin (sglang-router ``--dp-aware`` sets it): a worker's own server takes it, checked in
    ``hints_of``; the front door, which picks ranks itself, ignores it as any engine field it has no use for."""
    nvext: NvExt | None = None
    kv_transfer_params: KvTransferParams | None = None
    """vLLM's disaggregated legs (vllm-router ``--vllm-pd-disaggregation``); see ``KvTransferParams``."""
    bootstrap_host: Text | None = None
    """SGLang's disaggregated legs (sglang-router ``--pd-disaggregation``): both legs name the prefill worker's
    bootstrap server and one room, where the decode leg finds the prefill leg's KV."""
    bootstrap_port: Port | None = None
    bootstrap_room: Count | None = None


class CompletionRequest(_Generate):
    """``POST /v1/completions``."""

    prompt: Body | Annotated[list[Any], Meta(max_length=MAX_PROMPT_TOKENS)] | None = None


class ContentPart(msgspec.Struct):
    type: Name
    text: Body | None = None


class Message(msgspec.Struct):
    role: Name
    content: Body | Annotated[list[ContentPart], Meta(max_length=MAX_MESSAGES)] | None = None


class ChatRequest(_Generate):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Meta(max_length=MAX_MESSAGES)] | None = None


class TokenizeRequest(msgspec.Struct):
    """``POST /tokenize``: a prompt, or chat messages."""

    model: Model | None = None
    prompt: Body | None = None
    messages: Annotated[list[Message], Meta(max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(msgspec.Struct):
    """``POST /detokenize``."""

    tokens: Annotated[list[I64], Meta(max_length=MAX_PROMPT_TOKENS)]
    model: Model | None = None


_decoders: dict[type, msgspec.json.Decoder[Any]] = {}
"""Each body type's decoder, made at its first body."""


def decode_body(body: bytes, kind: type[T]) -> T:
    """Parse a JSON body into ``kind``; a 400 naming the field when it does not fit."""
    dec: msgspec.json.Decoder[T] | None = _decoders.get(kind)  # (the decoder of kind: made so just below)
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return dec.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        raise ApiError(400, f"invalid request body: {text}", param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # a body nested ~1,000 deep: the client's mistake, not a crash to log
        raise ApiError(400, "the request body nests too deeply") from None


def prompts_of(req: CompletionRequest | ChatRequest, tok: TextTokenizer,
               max_model_len: int | None = None) -> list[str | list[int]]:
    """The prompts of a request: text still to tokenize, or token ids already checked against the vocabulary
    (a completions request may carry several; a chat request is one prompt, its messages in the template).

    A prompt of ids that leaves no room in ``max_model_len`` for one output token is refused by its length,
    before its ids are scanned (a 16 MiB body holds millions)."""
    if isinstance(req, ChatRequest):
        if not req.messages:
            raise ApiError(400, "messages: at least one message is required", "messages")
        return [tok.chat_prompt([_message(m, i) for i, m in enumerate(req.messages)])]
    p = req.prompt
    if p is None:
        raise ApiError(400, "prompt: a prompt is required", "prompt")
    if isinstance(p, str):
        return [p]
    if not p:
        raise ApiError(400, "prompt: the list is empty", "prompt")
    if type(p[0]) is int:
        check_prompt_length(len(p), max_model_len)
        if all(type(x) is int for x in p):
            return [_ids(p, tok, "prompt")]
    if len(p) > MAX_PROMPTS:
        raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(p)}", "prompt")
    if all(isinstance(x, str) for x in p):
        return list(p)
    if all(isinstance(x, list) for x in p):
        for x in p:
            check_prompt_length(len(x), max_model_len)
        if all(all(type(y) is int for y in x) for x in p):
            return [_ids(x, tok, f"prompt[{i}]") for i, x in enumerate(p)]
    raise ApiError(400, "prompt: must be a string, a list of strings, a list of token ids or a list of lists of "
                        "token ids", "prompt")


def check_prompt_length(n: int, max_model_len: int | None) -> None:
    """A prompt of ``n`` tokens must leave room for one output token in ``max_model_len`` (None: no bound)."""
    if max_model_len is not None and n + 1 > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                            f"has {n} tokens. Please reduce the length of the prompt.", "prompt")


def _ids(ids: list[int], tok: TextTokenizer, field: str) -> list[int]:
    try:
        tok.check_ids(ids, field)
    except InvalidArgument as exc:
        raise ApiError(400, str(exc), "prompt") from None
    return ids


def _message(m: Message, i: int) -> tuple[str, str]:
    if m.role not in ROLES:
        raise ApiError(400, f"messages[{i}].role: {m.role!r} is not one of {', '.join(ROLES)}", "messages")
    c = m.content
    if c is None:
        return m.role, ""
    if isinstance(c, str):
        return m.role, c
    texts = []
    for j, part in enumerate(c):
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are supported, got type "
                                f"{part.type!r}", "messages")
        texts.append(part.text)
    return m.role, "\n".join(texts)


class Hints(msgspec.Struct, kw_only=True):
    """Routing hints of one request, from Dynamo's headers and ``nvext``."""

    session_id: str | None = None
    parent_session_id: str | None = None
    worker_id: int | None = None
    dp_rank: int | None = None
    priority: int = 0
    """The router's policy-queue tier (``nvext.agent_hints.priority``, higher first)."""
    engine_priority: int = 0
    """vLLM's ``priority`` body field: the engine scheduler's order (lower first)."""
    osl: int | None = None
    extra_fields: tuple[str, ...] = ()


_SESSION_HEADERS = ("x-dynamo-session-id", "x-session-id", "session-id")
_PARENT_HEADERS = ("x-dynamo-parent-session-id", "x-parent-session-id")


def hints_of(req: _Generate, headers: Mapping[str, str], *, rank_header: str = "x-dp-rank",
             ranks: Sequence[int] | None = None) -> Hints:
    """Session, parent session, pins, priority, expected output length and extra response fields.

    ``rank_header`` pins a DP rank (``x-dp-rank`` is taken too). The router's rank pin must name its worker
    too; a worker's own server (another ``rank_header``, its ``ranks`` given) takes a bare rank of its own,
    from that header (vLLM's ``X-data-parallel-rank``), the body's ``data_parallel_rank`` (SGLang's) or
    ``nvext.dp_rank``: one that is not among ``ranks``, or two that disagree, is a 400 naming the field."""
    nv = req.nvext or NvExt()
    hints = nv.agent_hints or AgentHints()
    session = _first(headers, _SESSION_HEADERS)
    parent = _first(headers, _PARENT_HEADERS)
    for name, value in (("session id", session), ("parent session id", parent)):
        if value is not None and (not value or len(value.encode()) > MAX_ID_BYTES):
            raise ApiError(400, f"{name} header: must be 1..{MAX_ID_BYTES} bytes", name.replace(" ", "_"))
    worker = _int_header(headers, "x-worker-instance-id", INT64_MAX)
    rank_name = rank_header if rank_header in headers else "x-dp-rank"
    rank = _int_header(headers, rank_name, RANK_MAX)
    extra = tuple(nv.extra_fields or ())
    unknown = [f for f in extra if f not in EXTRA_FIELDS]
    if unknown:
        raise ApiError(400, f"nvext.extra_fields: unknown {unknown}; supported: {list(EXTRA_FIELDS)}",
                       "nvext.extra_fields")
    if hints.osl is not None and hints.osl < 0:
        raise ApiError(400, "nvext.agent_hints.osl: must be >= 0", "nvext.agent_hints.osl")
    worker_id = worker if worker is not None else nv.backend_instance_id
    if ranks is not None:
        dp_rank = _own_rank(((rank_name, rank), ("data_parallel_rank", _body_rank(req.data_parallel_rank)),
                             ("nvext.dp_rank", nv.dp_rank)), ranks)
    else:
        dp_rank = rank if rank is not None else nv.dp_rank
    if rank_header == "x-dp-rank" and dp_rank is not None and worker_id is None:
        name = rank_name if rank is not None else "nvext.dp_rank"
        raise ApiError(400, f"{name}: a DP rank pins a rank of one worker; give the worker too "
                            f"(x-worker-instance-id header or nvext.backend_instance_id)", name)
    return Hints(session_id=session, parent_session_id=parent, worker_id=worker_id, dp_rank=dp_rank,
                 priority=hints.priority or 0, engine_priority=req.priority, osl=hints.osl, extra_fields=extra)


def _body_rank(value: Any) -> int | None:
    """The body's ``data_parallel_rank``: None, or an integer in 0..``RANK_MAX`` (not a bool, not a float)."""
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= RANK_MAX:
        raise ApiError(400, f"data_parallel_rank: must be an integer in 0..{RANK_MAX}, got {str(value)[:40]!r}",
                       "data_parallel_rank")
    return value


def _own_rank(given: tuple[tuple[str, int | None], ...], ranks: Sequence[int]) -> int | None:
    """The rank a request pins on a worker's own server, from wherever it was given; a 400 naming the field when
    two places disagree or the rank is not one of ``ranks``."""
    named = [(name, r) for name, r in given if r is not None]
    if not named:
        return None
    name, rank = named[0]
    for other, r in named[1:]:
        if r != rank:
            raise ApiError(400, f"{other}: {r} disagrees with {name}: {rank}; give one rank", other)
    if rank not in ranks:
        raise ApiError(400, f"{name}: {rank} is not a rank of this server (its ranks: "
                            f"{', '.join(map(str, ranks))})", name)
    return rank


def _first(headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        value = headers.get(name)
        if value is not None:
            return value
    return None


def _int_header(headers: Mapping[str, str], name: str, most: int) -> int | None:
    """A non-negative decimal integer header up to ``most`` (plain ASCII digits: no sign, ``_`` or other
    scripts' digits, which ``int`` would take)."""
    value = headers.get(name)
    if value is None:
        return None
    v = value.strip()
    if not v or len(v) > 20 or not (v.isascii() and v.isdigit()):
        raise ApiError(400, f"{name} header: {value[:40]!r} is not a non-negative integer", name)
    n = int(v)
    if n > most:
        raise ApiError(400, f"{name} header: must be <= {most}, got {v}", name)
    return n


def output_budget(req: _Generate, prompt_len: int, max_model_len: int, default: int | None) -> int:
    """The most tokens this request may produce (``max_completion_tokens`` over ``max_tokens``; ``default``,
    or what the context leaves when it is None); a 400 when it is not positive or the context overflows."""
    if req.n != 1:
        raise ApiError(400, f"n: kvemu produces one choice per prompt, got n={req.n}", "n")
    if req.echo:
        raise ApiError(400, "echo: not supported by kvemu", "echo")
    if req.logprobs not in (None, False):
        raise ApiError(400, "logprobs: not supported by kvemu (it generates no real tokens)", "logprobs")
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if asked is None:
        asked = default if default is not None else max_model_len - prompt_len
    elif asked < 1:
        raise ApiError(400, f"{field}: must be at least 1, got {asked}", field)
    if prompt_len < 1:
        raise ApiError(400, "prompt: the prompt is empty (it tokenizes to no token)", "prompt")
    if prompt_len + asked > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{prompt_len + asked} tokens ({prompt_len} in the messages, {asked} in the completion). "
                            f"Please reduce the length of the messages or completion.", field)
    if not 0 <= req.min_tokens <= asked:
        raise ApiError(400, f"min_tokens: must be in 0..{asked} (the output budget), got {req.min_tokens}",
                       "min_tokens")
    return asked
