"""A client's prompt over ZeroMQ is bounded where it is decoded (issue #27): three 10^7-token prompts used to
delay every other request to 7-10 s and push the router to 1.4 GB. Real router and worker processes on
127.0.0.1."""

from __future__ import annotations

import time

import anyio

from kvemu.runtime.messages import ClientRequest, decode_client_request, encode
from kvemu.wire.limits import MAX_PROMPT_TOKENS

from harness.processes import _RouterClient

from test_hostile_peers import Stack, timed_requests


def test_the_bound_is_the_documented_one():
    from workers.trace import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS as TRACE_MAX

    from kvemu.wire.limits import MAX_OUTPUT_TOKENS as WIRE_OUTPUT

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
