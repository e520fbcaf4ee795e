"""The messages actors exchange, as msgspec structs: identical bytes on ZeroMQ and in memory.

Client → router: ``ClientRequest``. Router ↔ worker: ``Register``/``RegisterAck``, ``Heartbeat``,
``Dispatch``/``DispatchAck``, ``TokenBatch``, ``Finished``, ``RequestFailed``, ``Draining``,
``RankDown``, ``Deregister``, ``Abort`` (the client went away: drop the request), ``Chaos`` (a fault the router
asks a worker to apply to itself), and, on in-memory transports, ``KvBatch`` (a vLLM-encoded KV-event payload
with its sequence number).
Disaggregated serving adds ``KvPulled`` (a decode rank took a request's KV) and ``ReleaseKv`` (the
prefill rank that held it may free it).
"""

from __future__ import annotations

import warnings
from typing import Annotated, Literal, TypeVar, get_args

import msgspec
from msgspec import Meta

from kvemu.config import RouterOverrides
from kvemu.errors import InvalidArgument
from kvemu.limits import (MAX_KV_BATCH_BYTES, MAX_LIST_ITEMS, MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, I64, Count,
                          Endpoint, Id, Key, Name, Rank, RequestId, Seconds, Text, TimeNs, WireInt,
                          WorkerId)
from kvemu.packed_tokens import PackedTokens
from kvemu.records import EngineFacts, TokenTimes, sequences_as_lists
from kvemu.transfer import KvTransfer

__all__ = [
    "ClientRequest",
    "MAX_PROMPT_TOKENS",
    "MAX_OUTPUT_TOKENS",
    "EngineSettings",
    "Register",
    "RegisterAck",
    "Reregister",
    "Heartbeat",
    "Dispatch",
    "DispatchAck",
    "TokenBatch",
    "Finished",
    "RequestFailed",
    "Draining",
    "RankDown",
    "Deregister",
    "KvBatch",
    "Abort",
    "KvPulled",
    "ReleaseKv",
    "Chaos",
    "WORKER_CHAOS",
    "WorkerMessage",
    "RouterMessage",
    "encode",
    "decode_worker_message",
    "decode_router_message",
    "decode_client_request",
    "with_packed_prompt",
    "WirePrompt",
    "PACK_FROM_TOKENS",
]

# MAX_PROMPT_TOKENS (kvemu.limits): a longer prompt is refused while the message is decoded, from its array's
# length, before a list of it is built or any block of it hashed (a 64 MiB message holds up to 64M one-byte
# token ids: 0.3 s and 360 MB per 10M tokens before this bound).

MAX_RANKS = 1 << 16
"""Most DP ranks one worker registers."""
MAX_BLOCK_SIZE = 1 << 16
"""Largest KV block (tokens)."""

TokenId = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]
"""A token id (u32, as packed prompts carry them)."""
OutputTokens = Annotated[int, Meta(ge=0, le=MAX_OUTPUT_TOKENS)]

WirePrompt = (Annotated[list[WireInt], Meta(max_length=MAX_PROMPT_TOKENS)]
              | Annotated[bytes, Meta(max_length=4 * MAX_PROMPT_TOKENS)])
"""A prompt on the wire: a list of token ids (range-checked when packed, ``with_packed_prompt``, or by the
router), or the ids packed as little-endian u32 (msgpack ``bin``), which
kvemu's own senders use for lazy and packed prompts; decoding gives a ``PackedTokens`` for the packed form and
for long lists (``PACK_FROM_TOKENS``)."""

PACK_FROM_TOKENS = 4096
"""A decoded list prompt at least this long is packed (its ids range-checked in C): a 4M-token list would
otherwise stay ~150 MB of ints for the request's whole life. Shorter lists stay lists."""

_OPTS = dict(frozen=True, kw_only=True, tag=True, omit_defaults=True, forbid_unknown_fields=True)


class ClientRequest(msgspec.Struct, **_OPTS):
    """One inference request as a client (or the load generator) submits it."""

    request_id: RequestId
    tokens: WirePrompt
    """The prompt; in process any ``Sequence[int]`` (a lazy trace prompt, ``PackedTokens``), on the wire a list
    or packed u32 bytes of at most ``MAX_PROMPT_TOKENS`` (a longer one fails to decode, unread)."""
    max_tokens: OutputTokens = 16
    session_id: Id | None = None
    """Session affinity key (multi-turn conversations)."""
    parent_session_id: Id | None = None
    """Sub-agent requests of one parent share a sibling-group binding."""
    worker_id: WorkerId | None = None
    """Explicit pin; never rewritten by affinity."""
    dp_rank: Rank | None = None
    allowed_worker_ids: Annotated[list[WorkerId], Meta(max_length=MAX_LIST_ITEMS)] | None = None
    router_overrides: RouterOverrides | None = None
    priority: I64 = 0
    """Strict priority tier in the router queue (higher first)."""
    do_not_queue: bool = False
    lora_name: Id | None = None
    expected_output_tokens: Count | None = None
    """Expected output length (``nvext.agent_hints.osl``): weights tracked output blocks by what is left."""
    output_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_OUTPUT_TOKENS)] | None = None
    """The ids the engine generates (a front end that shows text chooses them); default: the engine's own."""
    engine_priority: I64 = 0
    """The engine scheduler's priority (vLLM: lower first), passed through to the worker."""
    prefill_worker_id: WorkerId | None = None
    """Disaggregated clusters: pin the prefill leg to this worker (``worker_id`` pins the decode leg)."""
    prefill_dp_rank: Rank | None = None
    decode_worker_id: WorkerId | None = None
    """Disaggregated clusters: pin the decode leg (the same as ``worker_id``)."""
    decode_dp_rank: Rank | None = None
    kv_hold: bool = False
    """Set by a disaggregated router only: a prefill leg, whose KV the worker keeps for a decode rank."""
    kv_transfer: KvTransfer | None = None
    """Set by a disaggregated router only: a decode leg, whose prompt KV comes from this prefill rank."""


MAX_KNOB_CHARS = 64
"""Longest engine-knob value a worker registers (``EngineSettings.knobs``); a longer one goes as its digest."""


class EngineSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A worker's engine settings as it registers them: a digest of them all (but its DP size, which a worker may
    choose) and each top-level knob compactly, so a router expecting other settings names the knobs that differ."""

    digest: Annotated[str, Meta(min_length=1, max_length=64, pattern="^[0-9a-f]+$")]
    knobs: Annotated[list[tuple[Name, Annotated[str, Meta(max_length=MAX_KNOB_CHARS)]]], Meta(max_length=64)] = []

    def differences(self, expected: EngineSettings, most: int = 8) -> tuple[str, str]:
        """The knobs that differ, as ``name=value`` lists: (this worker's, ``expected``'s); at most ``most``."""
        mine, theirs = dict(self.knobs), dict(expected.knobs)
        names = [n for n in dict.fromkeys([*theirs, *mine]) if mine.get(n) != theirs.get(n)]
        more = f" and {len(names) - most} more" if len(names) > most else ""

        def show(knobs: dict[str, str]) -> str:
            return ", ".join(f"{n}={knobs.get(n, '(none)')}" for n in names[:most]) + more

        if not names:  # the digests differ, the knobs say nothing more (a knob-less or foreign sender)
            return f"engine settings {self.digest[:16]}", f"engine settings {expected.digest[:16]}"
        return show(mine), show(theirs)


class Register(msgspec.Struct, **_OPTS):
    """A worker announces itself and its ranks."""

    worker_id: WorkerId
    dp_size: Annotated[int, Meta(ge=1, le=MAX_RANKS)] = 1
    dp_start: Rank = 0
    block_size: Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE)] = 64
    total_kv_blocks: Count | None = None
    max_num_batched_tokens: Count | None = None
    worker_type: Name = "aggregated"
    taints: Annotated[list[Name], Meta(max_length=MAX_LIST_ITEMS)] = []
    kv_endpoints: Annotated[list[Endpoint], Meta(max_length=MAX_RANKS)] = []
    """One KV-event endpoint per rank (live mode); empty when events travel in ``KvBatch`` messages."""
    kv_replay_endpoints: Annotated[list[Endpoint], Meta(max_length=MAX_RANKS)] = []
    kv_groups: Annotated[list[tuple[Name, Count | None]], Meta(max_length=MAX_LIST_ITEMS)] = []
    """A hybrid engine's KV cache groups by ``group_idx``: (``kv_cache_spec_kind``, sliding window), from its engine
    config; the router judges by them the events that do not name their group's kind (vLLM 0.20/0.21). Empty:
    one group, or not known."""
    engine: EngineSettings | None = None
    """Its engine settings (a kvemu worker sends them): a router whose pool expects others refuses it
    (``engine_mismatch``), naming the knobs that differ. None: not said, not checked."""
    own_engine: bool = False
    """Its settings differ from its pool's on purpose (``kvemu worker --own-engine``: a straggler, a test): the
    router takes it and logs the knobs that differ."""


class RegisterAck(msgspec.Struct, **_OPTS):
    """The router's answer to ``Register``."""

    worker_id: WorkerId
    accepted: bool
    reason: Text | None = None
    retry_after_s: Seconds | None = None
    """Set when the refusal is temporary (``rate_limited``): register again after this long."""


class Reregister(msgspec.Struct, **_OPTS):
    """The router does not know this worker (it restarted): send ``Register`` again."""


class Heartbeat(msgspec.Struct, **_OPTS):
    """A worker is alive."""

    worker_id: WorkerId


class Draining(msgspec.Struct, **_OPTS):
    """A worker stops taking new requests and finishes what it has (graceful shutdown begins)."""

    worker_id: WorkerId


class RankDown(msgspec.Struct, **_OPTS):
    """One DP rank of a worker died: its requests failed, its cache is gone, it takes no more work."""

    worker_id: WorkerId
    dp_rank: Rank


class Deregister(msgspec.Struct, **_OPTS):
    """A worker leaves (graceful shutdown)."""

    worker_id: WorkerId
    reason: Text = "shutdown"


class Dispatch(msgspec.Struct, **_OPTS):
    """Run this request on this rank."""

    request_id: Key
    dp_rank: Rank
    tokens: WirePrompt
    max_tokens: OutputTokens
    output_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_OUTPUT_TOKENS)] | None = None
    engine_priority: I64 = 0
    """The engine scheduler's priority (``ClientRequest.engine_priority``; vLLM: lower first)."""
    kv_hold: bool = False
    """A prefill leg: compute the prompt, report it finished, and keep its KV until ``ReleaseKv``."""
    kv_transfer: KvTransfer | None = None
    """A decode leg: the prompt's KV comes from this prefill rank (reserve room, wait the transfer, decode)."""

    @property
    def hold_kv(self) -> bool:
        """Deprecated spelling of ``kv_hold`` (one release)."""
        warnings.warn("Dispatch.hold_kv is now Dispatch.kv_hold", DeprecationWarning, stacklevel=2)
        return self.kv_hold

    @property
    def priority(self) -> int:
        """Deprecated spelling of ``engine_priority`` (one release)."""
        warnings.warn("Dispatch.priority is now Dispatch.engine_priority", DeprecationWarning, stacklevel=2)
        return self.engine_priority


class DispatchAck(msgspec.Struct, **_OPTS):
    """The worker accepted the dispatch, or rejected it with a reason."""

    request_id: Key
    accepted: bool
    reason: Text | None = None


class Abort(msgspec.Struct, **_OPTS):
    """Drop this request (its client went away or it was cancelled): free its blocks, send nothing more."""

    request_id: Key
    reason: Text = "cancelled"


class TokenBatch(msgspec.Struct, **_OPTS):
    """Tokens produced since the last message for this request, with their engine times."""

    request_id: Key
    times_ns: TokenTimes


class Finished(msgspec.Struct, **_OPTS):
    """The request completed; ``times_ns`` are its last tokens, ``engine`` the engine's facts (which the router's
    record embeds as they came)."""

    request_id: Key
    times_ns: TokenTimes
    engine: EngineFacts = msgspec.field(default_factory=EngineFacts)
    """What the engine found (cached, reused and host-cached prompt tokens, admission, preemptions): the router's
    ``RequestRecord.engine``."""
    dp_rank: Rank = 0
    """The rank that ran it."""
    kv_transfer: KvTransfer | None = None
    """A prefill leg: where its KV is held and how fast it moves (the decode leg's ``Dispatch`` carries it)."""

    def _moved(self, name: str, new: str) -> EngineFacts:
        warnings.warn(f"Finished.{name} is now Finished.engine.{new}", DeprecationWarning, stacklevel=3)
        return self.engine

    @property
    def cached_tokens(self) -> int:
        """Deprecated (one release): ``engine.cached_tokens``."""
        return self._moved("cached_tokens", "cached_tokens").cached_tokens or 0

    @property
    def reused_tokens(self) -> int | None:
        """Deprecated (one release): ``engine.reused_tokens``."""
        return self._moved("reused_tokens", "reused_tokens").reused_tokens

    @property
    def host_cached_tokens(self) -> int | None:
        """Deprecated (one release): ``engine.host_cached_tokens``."""
        return self._moved("host_cached_tokens", "host_cached_tokens").host_cached_tokens

    @property
    def admitted_ns(self) -> int | None:
        """Deprecated (one release): ``engine.admitted_ns``."""
        return self._moved("admitted_ns", "admitted_ns").admitted_ns

    @property
    def preemptions(self) -> int:
        """Deprecated (one release): ``engine.preemptions``."""
        return self._moved("preemptions", "preemptions").preemptions


class KvPulled(msgspec.Struct, **_OPTS):
    """A decode rank has a request's KV (the transfer is over): the prefill rank may free its copy."""

    request_id: Key
    reserved_ns: TimeNs
    """When the decode rank reserved room for the prompt (the transfer started)."""
    activated_ns: TimeNs
    """When the request joined the decode rank's passes (the transfer ended, at a pass boundary)."""


class ReleaseKv(msgspec.Struct, **_OPTS):
    """The decode rank took the KV of this prefill leg: free it (the blocks stay cached)."""

    request_id: Key


class RequestFailed(msgspec.Struct, **_OPTS):
    """The worker could not finish the request."""

    request_id: Key
    reason: Text


class KvBatch(msgspec.Struct, **_OPTS):
    """A vLLM-encoded KV-event payload of one rank (in-memory transports only)."""

    dp_rank: Rank
    seq: Count
    payload: Annotated[bytes, Meta(max_length=MAX_KV_BATCH_BYTES)]


WorkerChaosAction = Literal["kill_rank", "drop_kv_events", "delay_kv_events", "slow_worker"]
"""The chaos actions a worker applies to itself (``WorkerActor.apply_chaos``)."""
WORKER_CHAOS: tuple[WorkerChaosAction, ...] = get_args(WorkerChaosAction)
"""The same, as a tuple."""


class Chaos(msgspec.Struct, **_OPTS):
    """A fault for the worker to apply to itself: the control channel of chaos on real processes."""

    action: WorkerChaosAction
    dp_rank: Rank = 0
    """The rank (``kill_rank``, ``drop_kv_events``)."""
    count: Annotated[int, Meta(ge=1, le=1 << 30)] = 1
    """Batches to drop (``drop_kv_events``)."""
    lag_ms: Annotated[float, Meta(ge=0, le=1e9)] = 0.0
    """How late every rank publishes from now on (``delay_kv_events``)."""
    factor: Annotated[float, Meta(gt=0, le=1e6)] = 1.0
    """Forward passes take this many times as long (``slow_worker``)."""


WorkerMessage = (Register | Heartbeat | Draining | RankDown | Deregister | DispatchAck | TokenBatch | Finished
                 | RequestFailed | KvBatch | KvPulled)
"""What workers send to the router."""
RouterMessage = RegisterAck | Reregister | Dispatch | Abort | Chaos | ReleaseKv
"""What the router sends to workers."""



def _wire_form(obj: object) -> object:
    """msgspec ``enc_hook``: a prompt that can pack itself (``PackedTokens``, a lazy trace prompt) as its u32
    bytes; other compact sequences (token times in an ``array('q')``) as lists."""
    packed = getattr(obj, "u32_bytes", None)
    if packed is not None:
        return packed()
    return sequences_as_lists(obj)


_encoder = msgspec.msgpack.Encoder(enc_hook=_wire_form)
_worker_decoder = msgspec.msgpack.Decoder(WorkerMessage)
_router_decoder = msgspec.msgpack.Decoder(RouterMessage)
_client_decoder = msgspec.msgpack.Decoder(ClientRequest)


def encode(msg: msgspec.Struct) -> bytes:
    """The wire bytes of any message."""
    return _encoder.encode(msg)


def decode_worker_message(data: bytes) -> WorkerMessage:
    """Decode what a worker sent; ``msgspec.DecodeError``/``ValidationError`` if malformed."""
    return _worker_decoder.decode(data)


def decode_router_message(data: bytes) -> RouterMessage:
    """Decode what the router sent (a ``Dispatch``'s prompt as ``with_packed_prompt`` gives it)."""
    return with_packed_prompt(_router_decoder.decode(data))


def decode_client_request(data: bytes) -> ClientRequest:
    """Decode a client request (its prompt as ``with_packed_prompt`` gives it)."""
    return with_packed_prompt(_client_decoder.decode(data))


_M = TypeVar("_M")


def with_packed_prompt(msg: _M) -> _M:
    """A just-decoded message with its prompt as ``PackedTokens`` if it came packed or as a long list (a list
    with an id out of range stays a list, refused downstream as any such prompt); ``msgspec.ValidationError``
    for packed bytes that are not whole u32 ids."""
    t = type(msg)
    if t is not ClientRequest and t is not Dispatch:
        return msg
    tokens = msg.tokens  # type: ignore[attr-defined]
    try:
        if type(tokens) is bytes:
            packed = PackedTokens(tokens)
        elif len(tokens) >= PACK_FROM_TOKENS:
            packed = PackedTokens.from_ids(tokens)
        else:
            return msg
    except InvalidArgument as exc:
        if type(tokens) is bytes:
            raise msgspec.ValidationError(f"{exc} - at `$.tokens`") from None
        return msg
    return msgspec.structs.replace(msg, tokens=packed)  # type: ignore[type-var]
