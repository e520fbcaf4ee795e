"""The KV transfer of disaggregated serving: what a prefill rank hands a decode rank, and how long it takes.

A prefill rank that finished a prompt keeps its KV blocks (the *source*) until a decode rank has pulled
them. The decode rank reserves room for the prompt, the transfer takes

    delay = tokens x bytes_per_token / (bandwidth_gbps x 1e9) seconds

and then the request joins the decode rank's next pass. ``tokens`` is the prompt length
(``full_prompt``) or the prompt blocks the decode rank does not already hold, whole blocks
(``destination_missing``). Without a bandwidth or a per-token size the transfer is instant. The
parameters are the prefill rank's (its NIC and model), as in the reference mocker; speed-up ratios do
not shorten a transfer.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

__all__ = ["KvTransfer", "TransferMode", "transfer_tokens", "transfer_delay_ns"]

TransferMode = Literal["full_prompt", "destination_missing"]


class KvTransfer(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Where a request's KV is and how fast it moves: set by the prefill rank, carried to the decode rank."""

    source_worker_id: Annotated[int, Meta(ge=0)]
    source_dp_rank: Annotated[int, Meta(ge=0)] = 0
    bandwidth_gbps: Annotated[float, Meta(gt=0, le=1e6)] | None = None
    """Decimal GB/s (1e9 bytes per second); None: the transfer is instant."""
    bytes_per_token: Annotated[int, Meta(ge=1, le=1 << 40)] | None = None
    """KV bytes of one token (layers x 2 x KV heads x head dim x dtype bytes); None: instant."""
    mode: TransferMode = "full_prompt"


def transfer_tokens(mode: TransferMode, prompt_tokens: int, missing_blocks: int, block_size: int) -> int:
    """The tokens a transfer moves: the prompt, or the whole blocks the destination is missing."""
    return prompt_tokens if mode == "full_prompt" else missing_blocks * block_size


def transfer_delay_ns(transfer: KvTransfer, tokens: int) -> int:
    """How long moving ``tokens`` tokens of KV takes, in integer nanoseconds (0 without a link model)."""
    bw, per_token = transfer.bandwidth_gbps, transfer.bytes_per_token
    if bw is None or per_token is None or tokens <= 0:
        return 0
    return round(tokens * per_token / bw)  # bytes / (GB/s x 1e9) s = bytes / GB/s ns
