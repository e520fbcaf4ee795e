"""Huge prompts take turns on an actor's loop, and at most half of it: the rest keeps serving.

A 4M-token prompt is a few hundred milliseconds of work for a router: decoding a list of ids, hashing its
blocks, matching and booking them. Done as it comes, a burst of such prompts stacks that work into the same
loop passes, and every other request, which needs several passes, waits for all of it. A ``PromptLane`` lets
one huge prompt at a time work (in arrival order), hashes a ``PackedTokens`` prompt a slice of blocks per
step, and after each step leaves the loop to everything else for as long as the step took. Other prompts go
straight through.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio

from kvemu.clock import NS_PER_S, Clock
from kvemu.packed_tokens import HASH_BLOCKS_PER_TURN

__all__ = ["PromptLane", "LaneTurn", "HUGE_PROMPT_BLOCKS"]

HUGE_PROMPT_BLOCKS = HASH_BLOCKS_PER_TURN
"""A prompt of at least this many blocks takes the lane: hashing it alone is more than one step."""


class LaneTurn:
    """A huge prompt's hold on the lane: ``pause`` after each step of work, ``hash`` a prompt step by step."""

    def __init__(self, lane: PromptLane, exclusive: bool) -> None:
        self._lane = lane
        self.exclusive = exclusive
        """Whether this prompt holds the lane (a huge one); others neither wait nor pause."""
        self.steps = 0
        """Pauses taken: the loop turns this prompt's work was spread over."""
        self._mark = lane.clock.now_ns()

    async def pause(self) -> None:
        """Give the loop back for as long as the work since the last pause took (at least one loop turn)."""
        if not self.exclusive:
            return
        worked = self._lane.clock.now_ns() - self._mark
        self.steps += 1
        await anyio.sleep(max(0, worked) / NS_PER_S)
        self._mark = self._lane.clock.now_ns()

    async def hash(self, tokens: Sequence[int]) -> None:
        """Hash ``tokens``' full blocks (a prompt with ``hash_ahead``: a ``PackedTokens``) a slice per step; the
        routing core then finds the hashes done. Other prompts are hashed where they are used."""
        ahead = getattr(tokens, "hash_ahead", None)
        if ahead is None:
            return
        lane = self._lane
        while not ahead(lane.block_size, lane.slice_blocks):
            await self.pause()


class PromptLane:
    """One huge prompt at a time works, then lets the loop serve others as long again (see the module doc)."""

    def __init__(self, clock: Clock, block_size: int, *, huge_blocks: int = HUGE_PROMPT_BLOCKS,
                 slice_blocks: int = HASH_BLOCKS_PER_TURN) -> None:
        self.clock = clock
        self.block_size = block_size
        self.huge_tokens = block_size * huge_blocks
        """A prompt at least this long is huge."""
        self.slice_blocks = slice_blocks
        """Blocks a huge prompt hashes per step."""
        self._lock = anyio.Lock()  # FIFO: waiters are woken in the order they came

    def is_huge(self, tokens: Sequence[int]) -> bool:
        """Whether the prompt takes the lane."""
        return len(tokens) >= self.huge_tokens

    @asynccontextmanager
    async def turn(self, huge: bool) -> AsyncIterator[LaneTurn]:
        """Hold the lane (if ``huge``: after the huge prompts before it) while the body works; on the way out
        the loop gets the body's last step back."""
        if not huge:
            yield LaneTurn(self, False)
            return
        async with self._lock:
            turn = LaneTurn(self, True)
            yield turn
            await turn.pause()
