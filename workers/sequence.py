"""Engine-side state of one request: tokens, block hashes, progress through prefill and decode."""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Protocol, cast

from mypy_extensions import mypyc_attr

import xxhash

from kvemu.hashing import BASE_SEED, extend_sequence_hashes, local_block_hashes, sequence_hashes
from kvemu.records import EngineRecord
from workers.request import Request

__all__ = ["SeqState", "FUTURE", "WAITING", "RUNNING", "FINISHED", "HELD"]

FUTURE = 0  # accepted, arrival time not reached yet
WAITING = 1
RUNNING = 2
FINISHED = 3
HELD = 4  # a disaggregated prefill leg that completed and keeps its KV for a decode rank

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack
if sys.byteorder != "little" or array("I").itemsize != 4:  # pragma: no cover - exotic platforms
    raise ImportError("workers.sequence assumes a little-endian platform with 4-byte array('I')")


class _SelfHashingTokens(Protocol):
    """A prompt that hashes itself, memoized per process (``workers.hash_id_prompt.HashIdTokens``)."""

    def sequence_hashes(self, block_size: int) -> list[int]: ...

    def local_block_hashes(self, block_size: int) -> list[int]: ...


@mypyc_attr(allow_interpreted_subclasses=True)  # subclassed outside the compiled build
class SeqState:
    """A request inside an engine core: positions ``0 .. prompt_len-1`` are the prompt, then generated tokens.

    ``computed`` tokens have KV; of its ``n_alloc`` blocks the first ``n_full`` are full (``hashes[:n_full]``).
    """

    __slots__ = (
        "req",
        "rid",
        "record",
        "prompt",
        "prompt_len",
        "max_tokens",
        "block_size",
        "hashes",
        "block_locals",
        "n_out",
        "computed",
        "n_alloc",
        "n_full",
        "prefilling",
        "status",
        "order",
        "host_load",
        "host_stored",
        "glo",
        "src_cached",
        "_out_ids",
        "_out_base",
    )

    def __init__(self, req: Request, record: EngineRecord, block_size: int, order: int) -> None:
        self.req = req
        self.rid = req.request_id
        self.record = record
        self.prompt = req.token_ids
        self.prompt_len = len(req.token_ids)
        self.max_tokens = req.max_tokens
        self.block_size = block_size
        self.block_locals: list[int] | None
        """Local (token) hash of each block in ``hashes``, kept for KV events; None when the request
        brought its sequence hashes (they are then recomputed from tokens on demand)."""
        if req.seq_hashes is not None:
            self.hashes = list(req.seq_hashes)
            self.block_locals = None
        else:
            prompt = req.token_ids
            if hasattr(prompt, "sequence_hashes"):  # SelfHashingTokens (trace prompts): hashed once per process
                hashing = cast(_SelfHashingTokens, prompt)  # (it has both methods; mypy narrows on one)
                self.hashes = list(hashing.sequence_hashes(block_size))
                self.block_locals = list(hashing.local_block_hashes(block_size))
            else:
                local = local_block_hashes(prompt, block_size)
                self.hashes = sequence_hashes(local)
                self.block_locals = local
        self.n_out = 0
        self.computed = 0
        self.n_alloc = 0
        self.n_full = 0
        self.prefilling = True
        self.status = FUTURE
        self.order = order
        self.host_load: tuple[int, int, int] | None = None
        """Host offload: (first block, count, end of the blocks it counts as cached) of a load from the host tier
        for its next admission; while set, the request holds its GPU prefix and the loaded blocks."""
        self.host_stored = 0
        """Host offload: the prompt blocks before this index were offered to the host tier (vLLM's store cursor)."""
        self.glo: list[int] | None = None
        """Hybrid KV groups (``workers.vllm.hybrid``): the first block position each group still holds; None: off."""
        self.src_cached = False
        """Hybrid KV, Mamba ``align`` state groups: whether the older of the two state blocks held is a checkpoint."""
        self._out_ids = req.output_token_ids
        # below 2**31, so base + i stays a valid u32 token id for any output length that fits a pool
        self._out_base = xxhash.xxh3_64_intdigest(req.request_id.encode(), 0) & 0x7FFFFFFF

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens so far."""
        return self.prompt_len + self.n_out

    def output_token(self, i: int) -> int:
        """The ``i``-th generated token id (given by the request, else ``base + i`` with a per-request base)."""
        ids = self._out_ids
        if ids is not None and i < len(ids):
            return ids[i]
        return self._out_base + i

    def token_slice(self, lo: int, hi: int) -> list[int]:
        """Token ids at positions ``lo .. hi-1`` (prompt, then generated tokens)."""
        p = self.prompt_len
        if hi <= p:
            return list(self.prompt[lo:hi])
        out = list(self.prompt[lo:p]) if lo < p else []
        i = max(lo, p) - p  # first output index wanted
        j = hi - p
        ids = self._out_ids
        if ids is not None and i < len(ids):
            given = list(ids[i:j])
            out += given
            i += len(given)
        if i < j:
            base = self._out_base
            out += range(base + i, base + j)
        return out

    def ensure_hashes(self, n_blocks: int) -> list[int]:
        """Extend ``hashes`` to cover the first ``n_blocks`` full blocks (whose tokens must all be known)."""
        hashes = self.hashes
        have = len(hashes)
        if have < n_blocks:
            bs = self.block_size
            locals_ = self.block_locals
            if n_blocks == have + 1:  # the common case while decoding: one block filled up
                local = _xxh3(array("I", self.token_slice(have * bs, n_blocks * bs)).tobytes(), BASE_SEED)
                hashes.append(_xxh3(_pack_pair(hashes[-1], local), BASE_SEED) if have else local)
                if locals_ is not None:
                    locals_.append(local)
            else:
                local_hashes = local_block_hashes(self.token_slice(have * bs, n_blocks * bs), bs)
                hashes.extend(extend_sequence_hashes(hashes[-1] if have else None, local_hashes))
                if locals_ is not None:
                    locals_ += local_hashes
        return hashes

    def local_hashes(self, lo: int, hi: int) -> list[int]:
        """Local hashes of full blocks ``lo .. hi-1`` (already in ``hashes``)."""
        locals_ = self.block_locals
        if locals_ is not None and len(locals_) >= hi:
            return locals_[lo:hi]
        bs = self.block_size
        return local_block_hashes(self.token_slice(lo * bs, hi * bs), bs)

    def __repr__(self) -> str:
        return (
            f"SeqState({self.rid!r}, status={self.status}, computed={self.computed}/{self.num_tokens}, "
            f"out={self.n_out}/{self.max_tokens}, blocks={self.n_full}+{self.n_alloc - self.n_full})"
        )
