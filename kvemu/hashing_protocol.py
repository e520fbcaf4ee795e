"""``SelfHashingTokens``, the protocol of prompts that hash themselves (re-exported by ``kvemu.hashing``).

It lives apart because ``kvemu.hashing`` is compiled by mypyc, which cannot compile a ``@runtime_checkable``
Protocol.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["SelfHashingTokens"]


@runtime_checkable
class SelfHashingTokens(Protocol):
    """A lazy prompt (e.g. a trace row's) that hashes its own blocks without being expanded.

    ``local_block_hashes(block_size)`` must equal ``local_block_hashes(list(self), block_size)`` with the
    base seed, and ``sequence_hashes(block_size)`` their ``sequence_hashes``; routers and engines use them
    instead of hashing token by token, and may share the (unmutated) lists.
    """

    def __len__(self) -> int: ...

    def local_block_hashes(self, block_size: int) -> list[int]: ...

    def sequence_hashes(self, block_size: int) -> list[int]: ...
