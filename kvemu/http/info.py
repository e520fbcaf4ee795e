"""What a server says of itself, in the shapes vLLM and SGLang servers answer: ``/v1/models``, SGLang's
``/server_info`` and ``/model_info`` (and their old names ``/get_server_info``, ``/get_model_info``), and
SGLang's per-rank ``/get_load``.

Routers read these to learn a worker before sending it anything: sglang-router (``--dp-aware``) takes
``dp_size`` from ``/server_info`` and refuses to register a worker without it; both sglang-router and
vllm-router (``power_of_two``) poll ``/get_load`` and sum its ``num_tokens``; vllm-router's ``kv_aware`` reads a
block size from ``/get_server_info``. One definition of each body serves the router's front door and a worker's
own server alike: the front door is one endpoint (``dp_size`` 1; it picks workers and ranks itself), a worker
reports its ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import kvemu

__all__ = ["ServerInfo", "RankLoad", "models_body", "server_info_body", "model_info_body", "load_body"]


@dataclasses.dataclass(frozen=True)
class RankLoad:
    """One DP rank's load as SGLang's ``/get_load`` reports it."""

    dp_rank: int
    running: int
    waiting: int
    kv_tokens: int
    """KV tokens held by requests (SGLang's ``num_tokens``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerInfo:
    """The facts about a server that its requests do not show (the model's name and context length and the
    block size come from the app and its backend)."""

    dp_ranks: tuple[int, ...] = (0,)
    """The ranks a client may pin on this server (``X-data-parallel-rank``, ``data_parallel_rank``)."""
    kv_tokens_per_rank: int | None = None
    """KV tokens one rank holds (vLLM's ``num_gpu_blocks * block_size``, SGLang's ``max_total_num_tokens``)."""
    max_running_requests: int | None = None
    engine: str = "vllm"
    """Which engine the workers mock: ``vllm``, ``sglang`` or ``trtllm``."""
    disaggregation_mode: str = "null"
    """SGLang's: ``null`` (aggregated), ``prefill`` or ``decode``."""
    tokenizer: str | None = None
    """The ``tokenizer.json`` text is tokenized with (None: the built-in tokenizer)."""
    loads: Callable[[], Sequence[RankLoad]] | None = None
    """Each rank's load now (``/get_load``); None: the server has no ranks of its own (the front door)."""


def models_body(model: str, created_s: int, max_model_len: int) -> dict[str, Any]:
    """``GET /v1/models``, as vLLM lists its served model."""
    return {"object": "list", "data": [{
        "id": model, "object": "model", "created": created_s, "owned_by": "kvemu", "root": model, "parent": None,
        "max_model_len": max_model_len, "permission": []}]}


def _tokenizer_path(model: str, info: ServerInfo) -> str:
    """Where the tokenizer is, as SGLang reports its ``tokenizer_path``: the directory of the ``tokenizer.json``
    given (a router that loads it finds its configs there too), else the model's name."""
    return str(Path(info.tokenizer).parent) if info.tokenizer else model


def server_info_body(model: str, max_model_len: int, block_size: int, info: ServerInfo) -> dict[str, Any]:
    """``GET /server_info`` (``/get_server_info``): SGLang's server arguments and scheduler facts, with vLLM's
    names of the same facts beside them (``max_model_len``, ``block_size``)."""
    return {
        "model_path": model,
        "served_model_name": model,
        "tokenizer_path": _tokenizer_path(model, info),
        "dp_size": len(info.dp_ranks),
        "tp_size": 1,
        "page_size": block_size,
        "block_size": block_size,
        "context_length": max_model_len,
        "max_model_len": max_model_len,
        "max_total_num_tokens": info.kv_tokens_per_rank,
        "max_req_input_len": max_model_len - 1,
        "max_running_requests": info.max_running_requests,
        "disaggregation_mode": info.disaggregation_mode,
        "load_balance_method": "follow_bootstrap_room" if info.disaggregation_mode == "prefill" else "round_robin",
        "enable_dp_attention": False,
        "engine": info.engine,
        "version": kvemu.__version__,
    }


def model_info_body(model: str, info: ServerInfo) -> dict[str, Any]:
    """``GET /model_info`` (``/get_model_info``): SGLang's model description of a text-generation model."""
    return {
        "model_path": model,
        "tokenizer_path": _tokenizer_path(model, info),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "kvemu",
        "architectures": ["KvemuMockForCausalLM"],
    }


def load_body(loads: Sequence[RankLoad]) -> list[dict[str, int]]:
    """``GET /get_load``: SGLang's one entry per DP rank (``num_reqs`` counts the running and the waiting)."""
    return [{"dp_rank": r.dp_rank, "num_reqs": r.running + r.waiting, "num_waiting_reqs": r.waiting,
             "num_tokens": r.kv_tokens} for r in loads]
