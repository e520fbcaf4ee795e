"""The KV transfer of disaggregated serving: what a prefill rank hands a decode rank, and how long it takes.

A prefill rank that finished a prompt keeps its KV blocks (the *source*) until a decode rank has pulled
them. The decode rank reserves room for the prompt, the transfer takes

    delay = tokens x bytes_per_token / (bandwidth_gbps x 1e9) seconds

and then the request joins the decode rank's next pass. ``tokens`` is the prompt length
(``full_prompt``) or the prompt blocks the decode rank does not already hold, whole blocks
(``destination_missing``). Without a bandwidth or a per-token size the transfer is instant. The
parameters are the prefill rank's (its NIC and model), as in the reference mocker; speed-up ratios do
not shorten a transfer.

The link model crosses process and trust boundaries (a ``Finished`` from a prefill worker, a ``Dispatch`` to a
decode worker, a decode leg's ``kv_transfer_params`` over HTTP), so it is bounded where it is declared: a link
of at least ``MIN_BANDWIDTH_GBPS`` and at most ``MAX_BYTES_PER_TOKEN`` per token, and no transfer of a prompt
longer than ``MAX_TRANSFER_S`` (``transfer_refusal`` says why one is refused; decode ranks, the router and the
HTTP handoff refuse it before anything is reserved).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

__all__ = ["KvTransfer", "TransferMode", "transfer_tokens", "transfer_delay_ns", "transfer_refusal", "Bandwidth",
           "BytesPerToken", "MIN_BANDWIDTH_GBPS", "MAX_BANDWIDTH_GBPS", "MAX_BYTES_PER_TOKEN", "MAX_TRANSFER_S"]

TransferMode = Literal["full_prompt", "destination_missing"]

MIN_BANDWIDTH_GBPS = 1e-4
"""The slowest link (100 kB/s): far below any real KV link, and far enough from 0 that a delay stays finite."""
MAX_BANDWIDTH_GBPS = 1e6
MAX_BYTES_PER_TOKEN = 1 << 30
"""1 GiB of KV per token: past any model (a 405B model in bf16 is ~0.5 MB)."""
MAX_TRANSFER_S = 300.0
"""The longest transfer a decode rank takes (shorter than a prefill worker's 480 s hold): a link model that
would move a prompt slower than this is refused, not given a reservation for hours."""
MAX_TRANSFER_NS = round(MAX_TRANSFER_S * 1e9)

Bandwidth = Annotated[float, Meta(ge=MIN_BANDWIDTH_GBPS, le=MAX_BANDWIDTH_GBPS)]
"""A KV link's decimal GB/s (finite: msgspec refuses nan and inf against these bounds)."""
BytesPerToken = Annotated[int, Meta(ge=1, le=MAX_BYTES_PER_TOKEN)]


class KvTransfer(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Where a request's KV is and how fast it moves: set by the prefill rank, carried to the decode rank."""

    source_worker_id: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
    source_dp_rank: Annotated[int, Meta(ge=0, le=(1 << 31) - 1)] = 0
    bandwidth_gbps: Bandwidth | None = None
    """Decimal GB/s (1e9 bytes per second); None: the transfer is instant."""
    bytes_per_token: BytesPerToken | None = None
    """KV bytes of one token (layers x 2 x KV heads x head dim x dtype bytes); None: instant."""
    mode: TransferMode = "full_prompt"


def transfer_tokens(mode: TransferMode, prompt_tokens: int, missing_blocks: int, block_size: int) -> int:
    """The tokens a transfer moves: the prompt, or the whole blocks the destination is missing."""
    return prompt_tokens if mode == "full_prompt" else missing_blocks * block_size


def _delay(transfer: KvTransfer, tokens: int) -> float:
    bw, per_token = transfer.bandwidth_gbps, transfer.bytes_per_token
    if bw is None or per_token is None or tokens <= 0:
        return 0.0
    if not bw > 0:  # a struct built in code is not validated: never divide by zero
        return math.inf
    return tokens * per_token / bw  # bytes / (GB/s x 1e9) s = bytes / GB/s ns


def transfer_delay_ns(transfer: KvTransfer, tokens: int) -> int:
    """How long moving ``tokens`` tokens of KV takes, in integer nanoseconds (0 without a link model); never more
    than ``MAX_TRANSFER_NS`` (a longer one is refused before it gets here: ``transfer_refusal``)."""
    delay = _delay(transfer, tokens)
    return round(delay) if delay <= MAX_TRANSFER_NS else MAX_TRANSFER_NS


def transfer_refusal(transfer: KvTransfer, prompt_tokens: int) -> str | None:
    """Why a decode rank refuses to pull a ``prompt_tokens`` prompt over this link (None: it takes it).

    Judged on the whole prompt (what ``full_prompt`` moves; ``destination_missing`` moves at most that), so the
    answer does not depend on what the decode rank happens to hold."""
    delay = _delay(transfer, prompt_tokens)
    if delay <= MAX_TRANSFER_NS:
        return None
    return (f"moving {prompt_tokens} tokens at {transfer.bytes_per_token} bytes per token over "
            f"{transfer.bandwidth_gbps:g} GB/s would take {delay / 1e9:.3g} s, more than the {MAX_TRANSFER_S:g} s a "
            f"decode rank waits for a transfer (kvemu.transfer.MAX_TRANSFER_S)")
