"""A client's prompt over ZeroMQ is bounded where it is decoded (issue #27): three 10^7-token prompts used to
delay every other request to 7-10 s and push the router to 1.4 GB. Real router and worker processes on
127.0.0.1."""

from __future__ import annotations

import time

import anyio
import pytest

from kvemu.packed_tokens import PackedTokens
from kvemu.records import RequestRecord
from kvemu.messages import ClientRequest, decode_client_request, encode
from kvemu.messages import MAX_PROMPT_TOKENS

from harness.procs.loadgen import _RouterClient

from tests.end_to_end.test_hostile_peers import Stack, timed_requests


def test_the_bound_is_the_documented_one():
    from kvemu.limits import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS as TRACE_MAX

    from kvemu.messages import MAX_OUTPUT_TOKENS as WIRE_OUTPUT

    assert MAX_PROMPT_TOKENS == TRACE_MAX == 1 << 22 and WIRE_OUTPUT == MAX_OUTPUT_TOKENS
    ok = ClientRequest(request_id="a", tokens=[1] * MAX_PROMPT_TOKENS)
    assert len(decode_client_request(encode(ok)).tokens) == MAX_PROMPT_TOKENS


def test_a_prompt_past_the_bound_is_refused_unread_and_others_keep_their_pace(tmp_path):
    stack = Stack(tmp_path)
    try:
        answers = []

        async def attack():
            client = _RouterClient(stack.router)
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.listen)
                for i in range(3):
                    t0 = time.monotonic()
                    with anyio.fail_after(20):
                        rec = await client.submit(ClientRequest(request_id=f"huge{i}",
                                                                tokens=[7] * (MAX_PROMPT_TOKENS + 1), max_tokens=1))
                    answers.append((rec, time.monotonic() - t0))
                tg.cancel_scope.cancel()

        took = anyio.run(timed_requests, stack.router, 5, attack, 0)
        assert stack.kids.procs["router"].poll() is None
    finally:
        stack.close()
    for rec, seconds in answers:
        assert rec is not None and rec.failure.startswith("invalid_request: ") and "4194304" in rec.failure, rec
        assert seconds < 2.0
    assert max(took) < 1.0, took


@pytest.mark.parametrize("form", ["list", "packed"])
def test_a_burst_of_the_longest_prompts_leaves_other_requests_their_pace(tmp_path, form):
    """Three prompts of MAX_PROMPT_TOKENS ids arrive together while a short request goes every 25 ms: as lists
    (the attack: decoded, packed and hashed by the router) and packed (what kvemu's own clients send). They
    used to stack their work into the router's loop passes: short requests took 1.4-1.9 s; now the prompt
    lane spreads it (typically 0.1-0.3 s at most)."""
    stack = Stack(tmp_path)
    huge = list(range(MAX_PROMPT_TOKENS)) if form == "list" else PackedTokens.from_ids(range(MAX_PROMPT_TOKENS))
    ends: list[RequestRecord | None] = []
    took: list[float] = []
    try:
        async def main() -> None:
            client = _RouterClient(stack.router)

            async def send_huge(i: int) -> None:
                ends.append(await client.submit(ClientRequest(request_id=f"huge{i}", tokens=huge, max_tokens=1)))

            async def send_short(i: int) -> None:
                t0 = time.monotonic()
                rec = await client.submit(ClientRequest(request_id=f"s{i}", tokens=list(range(1 + i, 65 + i)),
                                                        max_tokens=2))
                assert rec is not None and rec.failure is None, rec
                took.append(time.monotonic() - t0)

            async with anyio.create_task_group() as tg:
                tg.start_soon(client.listen)
                with anyio.fail_after(30):
                    while 0 not in (await client.stats(timeout_s=10)).workers:
                        await anyio.sleep(0.05)
                with anyio.fail_after(60):
                    for i in range(60):
                        if i == 10:
                            for k in range(3):
                                tg.start_soon(send_huge, k)
                        tg.start_soon(send_short, i)
                        await anyio.sleep(0.025)
                    while len(ends) < 3 or len(took) < 60:
                        await anyio.sleep(0.05)
                tg.cancel_scope.cancel()

        anyio.run(main)
        assert stack.kids.procs["router"].poll() is None
    finally:
        stack.close()
    for rec in ends:  # the worker's own refusal (its pool holds 262,144 tokens), carried to the client
        assert rec is not None and "can never fit in the pool" in rec.failure, rec
    assert len(took) == 60 and max(took) < 1.0, sorted(took)[-5:]
