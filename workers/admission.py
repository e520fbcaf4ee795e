"""Accept/reject rules for requests dispatched to a mock worker, with typed reasons naming the field."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from kvemu.errors import KvemuError
from kvemu.transfer import transfer_refusal
from workers.config import EngineConfig
from workers.request import Request

__all__ = ["RejectReason", "RequestRejected", "check_request", "check_tokens_u32", "sglang_max_len"]

_U32_LIMIT = 1 << 32


class RejectReason(enum.Enum):
    """Why a worker refused a dispatched request."""

    SHUTTING_DOWN = "shutting_down"
    MALFORMED = "malformed"
    UNKNOWN_DP_RANK = "unknown_dp_rank"
    DUPLICATE_REQUEST_ID = "duplicate_request_id"


class RequestRejected(KvemuError):
    """A worker or engine core refused a request; nothing was changed. ``reason`` and ``field`` say why."""

    def __init__(self, reason: RejectReason, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.field = field


def _malformed(field: str, message: str) -> RequestRejected:
    return RequestRejected(RejectReason.MALFORMED, f"{field}: {message}", field=field)


def check_tokens_u32(tokens: Sequence[int], field: str) -> None:
    """Raise ``RequestRejected`` unless every element is an int in ``[0, 2**32)``."""
    check = getattr(tokens, "check_u32", None)
    if check is not None:  # lazily expanded trace tokens validate their few distinct ids
        if not check():
            raise _malformed(field, "every token id must be an integer in [0, 2**32)")
        return
    try:
        ok = all(type(t) is int for t in tokens) and (not tokens or (min(tokens) >= 0 and max(tokens) < _U32_LIMIT))
    except TypeError:
        ok = False
    if not ok:
        raise _malformed(field, "every token id must be an integer in [0, 2**32)")


def sglang_max_len(config: EngineConfig) -> int:
    """The longest prompt + output an SGLang rank accepts (its pool less one page); outputs are clipped to it."""
    return config.capacity_tokens - config.resolved_block_size


def check_request(req: Request, config: EngineConfig, *, now_ns: int, check_tokens: bool,
                  group_blocks: Callable[[int], int] | None = None) -> None:
    """Reject a malformed request (empty prompt, ``max_tokens < 1``, arrival in the past, too long to ever fit, a KV
    transfer slower than ``MAX_TRANSFER_S``).

    Token ids are range-checked here only when ``check_tokens`` (otherwise hashing them checks them).
    ``group_blocks``: with hybrid KV cache groups (``kv_groups``), the engine's count of the pool blocks a request of
    that many KV tokens holds at once over every group (``workers.vllm.hybrid``); None without them.
    """
    # "Too long": its KV (prompt + max_tokens - 1 tokens; the last token's KV is never computed) exceeds
    # the pool, or, without chunked prefill, one pass's budget (a preempted request re-prefills all it has).
    if not isinstance(req.request_id, str) or not req.request_id:
        raise _malformed("request_id", f"must be a non-empty string, got {req.request_id!r}")
    mt = req.max_tokens
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise _malformed("max_tokens", f"must be an integer >= 1, got {mt!r}")
    try:
        n = len(req.token_ids)
    except TypeError:
        raise _malformed("token_ids", "must be a sequence of token ids") from None
    if n == 0:
        raise _malformed("token_ids", "the prompt is empty")
    if req.arrival_ns is not None:
        a = req.arrival_ns
        if not isinstance(a, int) or isinstance(a, bool) or a < now_ns:
            raise _malformed("arrival_ns", f"must be an integer >= the engine's current time {now_ns}, got {a!r}")
    if not isinstance(req.priority, int) or isinstance(req.priority, bool):
        raise _malformed("priority", f"must be an integer, got {req.priority!r}")
    kv_tokens = n + mt - 1
    if config.backend == "trtllm" and n + mt > config.capacity_tokens:  # it reserves prompt + max_tokens
        raise _malformed(
            "token_ids",
            f"prompt ({n}) + max_tokens ({mt}) = {n + mt} tokens can never be reserved in the pool of "
            f"{config.num_gpu_blocks} blocks x {config.block_size} tokens",
        )
    if config.backend == "sglang":  # SGLang clips max_tokens to what fits; only a prompt too long is refused
        limit = sglang_max_len(config)
        if n >= limit:
            raise _malformed(
                "token_ids",
                f"prompt ({n} tokens) leaves no room for output in {limit}, the longest sequence an SGLang pool "
                f"of {config.num_gpu_blocks} pages x {config.block_size} tokens holds (SGLang aborts such requests)",
            )
    elif config.kv_groups:  # hybrid KV groups: the blocks it may hold at once over every group must fit the pool
        assert group_blocks is not None, "an engine with kv_groups passes its group_blocks"
        need = group_blocks(kv_tokens)
        if need > config.pool_blocks:
            raise _malformed(
                "token_ids",
                f"prompt ({n}) + max_tokens ({mt}) - 1 = {kv_tokens} KV tokens need up to {need} blocks over the "
                f"model's KV cache groups, more than the pool's {config.pool_blocks}",
            )
    elif kv_tokens > config.capacity_tokens:
        raise _malformed(
            "token_ids",
            f"prompt ({n}) + max_tokens ({mt}) - 1 = {kv_tokens} KV tokens can never fit in the pool of "
            f"{config.num_gpu_blocks} blocks x {config.block_size} tokens",
        )
    if not config.enable_chunked_prefill and kv_tokens > config.max_num_batched_tokens:
        raise _malformed(
            "token_ids",
            f"prompt ({n}) + max_tokens ({mt}) - 1 = {kv_tokens} tokens exceed max_num_batched_tokens "
            f"({config.max_num_batched_tokens}) with chunked prefill disabled",
        )
    if req.seq_hashes is not None and len(req.seq_hashes) != n // config.resolved_block_size:
        raise _malformed(
            "seq_hashes",
            f"expected {n // config.resolved_block_size} hashes (full blocks of {config.block_size}), got {len(req.seq_hashes)}",
        )
    if req.output_token_ids is not None:
        check_tokens_u32(req.output_token_ids, "output_token_ids")
    if check_tokens:
        check_tokens_u32(req.token_ids, "token_ids")
    if req.kv_transfer is not None and (why := transfer_refusal(req.kv_transfer, n)) is not None:
        raise _malformed("kv_transfer", why)
