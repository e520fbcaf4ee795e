"""Native rolling block sequence hash (kvemu/_native/blockhash.c); kvemu.hashing.extend_sequence_hashes_py is
its pure-Python reference."""

from collections.abc import Sequence

def extend_sequence_hashes(parent: int | None, local_hashes: Sequence[int], /) -> list[int]: ...
