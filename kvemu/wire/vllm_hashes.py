"""vLLM's own block hashes for published KV events, so a kvemu worker's events for a prompt equal a real vLLM's.

vLLM 0.34 (its default ``prefix_caching_hash_algo`` sha256, no LoRA, multimodal input or cache salt) names a full
block by SHA-256 over the pickle (highest protocol) of ``(parent digest, block token ids, None)``, the first block's
parent being the digest of the pickled seed ``"vllm-none-hash"``; its events carry the digest's last 8 bytes as a
big-endian integer (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default). kvemu's engines hash blocks their own
(faster) way; ``VllmHashes`` rewrites one rank's events on their way out, remembering each cached block's digest
until its removal, because a block's hash depends on its whole prefix, which only the parent's digest carries.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

import msgspec

from kvemu.errors import InvalidArgument
from kvemu.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KVEventBatch
from kvemu.router_events import EngineEvents

__all__ = ["BLOCK_HASHES", "NONE_DIGEST", "block_digests", "external_hash", "VllmHashes", "vllm_hashes"]

BLOCK_HASHES = ("kvemu", "vllm-0.34")
"""Whose block hashes a worker's KV events carry: kvemu's own, or vLLM 0.34's (``kv_events_block_hashes``)."""
_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL of every CPython vLLM 0.34 runs on (3.10 to 3.13)
NONE_DIGEST = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=_PROTOCOL)).digest()
"""The parent digest of a prompt's first block (vLLM's ``NONE_HASH`` when ``PYTHONHASHSEED`` is unset)."""
_LOW64 = (1 << 64) - 1


def block_digests(parent: bytes | None, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """vLLM's digests of the full blocks of ``token_ids`` that follow the block whose digest is ``parent``."""
    digest = NONE_DIGEST if parent is None else parent
    out = []
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.sha256(pickle.dumps((digest, tuple(token_ids[i:i + block_size]), None),
                                             protocol=_PROTOCOL)).digest()
        out.append(digest)
    return out


def external_hash(digest: bytes) -> int:
    """What vLLM's events carry for a digest (its int form): the last 8 bytes, big-endian."""
    return int.from_bytes(digest, "big") & _LOW64


class VllmHashes:
    """One rank's events with vLLM's block hashes in place of kvemu's (state: the digest of every cached block)."""

    __slots__ = ("_digests",)

    def __init__(self) -> None:
        self._digests: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._digests)

    def batch(self, batch: KVEventBatch | EngineEvents) -> KVEventBatch:
        """``batch`` (an engine pass's events, or a batch) with vLLM's hashes."""
        b = batch if type(batch) is KVEventBatch else batch.batch()
        return msgspec.structs.replace(b, events=self.events(b.events))

    def events(self, events: Sequence[KvEvent]) -> list[KvEvent]:
        """``events`` (in order) as a vLLM with the same blocks would send them."""
        digests = self._digests
        out: list[KvEvent] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                parent = None
                if ev.parent_block_hash is not None:
                    parent = digests.get(ev.parent_block_hash)
                    if parent is None:  # (a block is stored only after its parent, and removed after its children)
                        raise InvalidArgument(f"BlockStored: parent {ev.parent_block_hash} is not a cached block")
                new = block_digests(parent, ev.token_ids, ev.block_size)
                if len(new) != len(ev.block_hashes):
                    raise InvalidArgument(f"BlockStored: {len(ev.block_hashes)} blocks but "
                                          f"{len(ev.token_ids)} tokens of block size {ev.block_size}")
                for h, d in zip(ev.block_hashes, new):
                    digests[h] = d
                out.append(msgspec.structs.replace(
                    ev, block_hashes=[external_hash(d) for d in new],
                    parent_block_hash=external_hash(parent) if parent is not None else None))
            elif isinstance(ev, BlockRemoved):
                gone = []
                for h in ev.block_hashes:
                    d = digests.pop(h, b"")
                    if not d:
                        raise InvalidArgument(f"BlockRemoved: {h} is not a cached block")
                    gone.append(external_hash(d))
                out.append(msgspec.structs.replace(ev, block_hashes=gone))
            else:
                if isinstance(ev, AllBlocksCleared):
                    digests.clear()
                out.append(ev)
        return out


def vllm_hashes(block_hashes: str) -> VllmHashes | None:
    """A rank's translator for ``block_hashes`` (None: kvemu's own hashes go out as they are)."""
    if block_hashes not in BLOCK_HASHES:
        raise InvalidArgument(f"block_hashes must be one of {', '.join(BLOCK_HASHES)}, got {block_hashes!r}",
                              field="kv_events_block_hashes")
    return VllmHashes() if block_hashes != "kvemu" else None
