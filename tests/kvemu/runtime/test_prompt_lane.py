"""The prompt lane (issue #27): huge prompts work one at a time, in arrival order, and give the loop back as
long as each step took, while other prompts go straight through. Virtual time: a step's work is a clock
advance."""

from __future__ import annotations

import anyio

from kvemu.clock import ManualClock
from kvemu.packed_tokens import PackedTokens
from kvemu.runtime.loop import run_virtual
from kvemu.runtime.prompt_lane import PromptLane

MS = 1_000_000


def test_huge_prompts_take_turns_and_leave_the_loop_as_long_as_they_worked():
    clock = ManualClock()
    lane = PromptLane(clock, block_size=4, huge_blocks=8)  # huge: 32 tokens or more
    log: list[tuple[str, str, int]] = []

    async def prompt(name: str, n_tokens: int, work_ms: int) -> None:
        tokens = PackedTokens.from_ids(range(n_tokens))
        async with lane.turn(lane.is_huge(tokens)):
            log.append((name, "in", clock.now_ns()))
            clock.advance(work_ms * MS)  # the step's work
            log.append((name, "out", clock.now_ns()))

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(prompt, "A", 40, 10)
            tg.start_soon(prompt, "B", 32, 5)
            tg.start_soon(prompt, "small", 31, 0)
            await anyio.sleep(0.015)  # A's pause
            tg.start_soon(prompt, "late small", 8, 0)

    run_virtual(main, clock)
    at = {(name, what): t for name, what, t in log}
    assert at["A", "in"] == 0 and at["A", "out"] == 10 * MS
    assert at["B", "in"] == 20 * MS  # after A's step and as long again for everyone else
    assert at["small", "in"] == 0 and at["late small", "in"] == 15 * MS  # neither waited for the lane
    assert clock.now_ns() == 30 * MS  # B's step (5 ms) and its pause


def test_a_huge_packed_prompt_is_hashed_a_slice_per_step_and_routing_finds_it_done():
    clock = ManualClock()
    lane = PromptLane(clock, block_size=4, huge_blocks=8, slice_blocks=10)
    tokens = PackedTokens.from_ids(range(4 * 35 + 3))  # 35 full blocks: slices of 10, 10, 10, 5
    steps: list[int] = []

    async def main() -> None:
        async with lane.turn(lane.is_huge(tokens)) as work:
            await work.hash(tokens)
            steps.append(work.steps)
            assert work.exclusive

    run_virtual(main, clock)
    assert steps == [3]  # a pause between slices: the loop served others three times
    cached = tokens.local_block_hashes(4)
    assert len(cached) == 35 and tokens.local_block_hashes(4) is cached  # memoized: prepare does no work


def test_a_list_prompt_is_left_to_be_hashed_where_it_is_used():
    async def main() -> int:
        async with PromptLane(ManualClock(), block_size=4).turn(False) as work:
            await work.hash(list(range(100)))
            await work.pause()
            return work.steps

    assert run_virtual(main) == 0
