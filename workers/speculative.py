"""One DP rank's speculative-decoding draws: how many tokens each decode pass emits per request, and vLLM's counts.

Dynamo's mocker MTP semantics: a request's decode pass verifies k drafts; draft i is accepted with its
conditional rate once every earlier one was, the walk stops at the first rejection, and the pass emits
1 + the accepted prefix (the bonus token included), cut to what the request may still produce. One stream
per rank, drawn request by request in batch order, pass by pass.

The stream is a fixed sequence of uncut draws (``peek`` reads ahead without using them, ``take`` uses
them), so the stepwise engine, its decode runs and its look-ahead see the same draws whatever the order in
which they ask: fast-forward stays exact.
"""

from __future__ import annotations

import random

from workers.config import SpeculativeConfig

__all__ = ["DraftSampler"]

_COMPACT = 4096
"""Used draws kept before the buffer drops them."""


class DraftSampler:
    """A rank's stream of uncut draws (tokens a decode pass emits: 1 .. k + 1) and what vLLM counts of them."""

    __slots__ = ("rates", "k", "_rng", "_buf", "_pos", "drafts", "draft_tokens", "accepted", "accepted_per_pos")

    def __init__(self, config: SpeculativeConfig, worker_id: int, dp_rank: int) -> None:
        self.rates = config.conditional_rates
        self.k = config.num_speculative_tokens
        # Dynamo adds the worker index to the seed; a DP rank of a worker needs its own stream too
        self._rng = random.Random(f"kvemu-speculative:{config.seed}:{worker_id}:{dp_rank}")
        self._buf: list[int] = []
        self._pos = 0
        self.drafts = 0
        """Decode passes that verified drafts, per request (vLLM's ``spec_decode_num_drafts``)."""
        self.draft_tokens = 0
        """Draft tokens verified (``num_drafts * k``)."""
        self.accepted = 0
        """Draft tokens accepted, before a max_tokens cut (vLLM counts them before it trims)."""
        self.accepted_per_pos = [0] * self.k
        """Drafts accepted at each position 0 .. k-1."""

    def _draw(self) -> int:
        rng = self._rng.random
        n = 1
        for rate in self.rates:
            if rng() < rate:
                n += 1
            else:
                break
        return n

    def peek(self, i: int) -> int:
        """The ``i``-th draw after those used so far (drawn now if needed; not used)."""
        buf = self._buf
        want = self._pos + i
        while len(buf) <= want:
            buf.append(self._draw())
        return buf[want]

    def take(self, n: int) -> None:
        """Use the next ``n`` draws (after ``peek`` read them) and count them."""
        buf = self._buf
        pos = self._pos
        while len(buf) < pos + n:
            buf.append(self._draw())
        per_pos = self.accepted_per_pos
        accepted = 0
        for i in range(pos, pos + n):
            a = buf[i] - 1
            accepted += a
            for j in range(a):
                per_pos[j] += 1
        self.drafts += n
        self.draft_tokens += n * self.k
        self.accepted += accepted
        pos += n
        if pos >= _COMPACT:
            del buf[:pos]
            pos = 0
        self._pos = pos

    def next(self) -> int:
        """Use the next draw and return it."""
        n = self.peek(0)
        self.take(1)
        return n

    def __repr__(self) -> str:
        return f"DraftSampler(k={self.k}, rates={self.rates}, drafts={self.drafts}, accepted={self.accepted})"
