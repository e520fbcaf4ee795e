"""#27 over ZeroMQ against real processes: a request no worker can serve fails with the worker's own refusal, and
a malformed client message whose request id can be read gets an error reply naming what was wrong."""

from __future__ import annotations

import anyio
import msgspec

from kvemu.messages import ClientRequest

from harness.procs.loadgen import _RouterClient
from harness.procs.protocol import CLIENT
from harness.procs.up import Children
from tests.end_to_end.test_processes import registered, router_and_worker, small


def test_a_refused_request_keeps_the_workers_reason_and_a_malformed_one_gets_an_answer(tmp_path):
    scenario = small(tmp_path)
    kids = Children()
    try:
        router = router_and_worker(kids, scenario, 3)

        async def main():
            client = _RouterClient(router["listen"])
            client.replies = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.listen)
                await registered(client)
                with anyio.fail_after(20):
                    huge = await client.submit(ClientRequest(request_id="huge", tokens=list(range(1, 65)),
                                                             max_tokens=10**9))
                    raw = client.sock.send_multipart
                    await raw([CLIENT, b"\xc1 not msgpack"])  # nobody to answer: ignored
                    await raw([CLIENT, msgspec.msgpack.encode({"type": "ClientRequest", "request_id": "bad",
                                                               "tokens": "nope"})])
                    client._waiting["bad"] = waiter = anyio.Event()
                    await waiter.wait()
                    ok = await client.submit(ClientRequest(request_id="ok", tokens=list(range(1, 65)), max_tokens=2))
                tg.cancel_scope.cancel()
            return huge, client.records["bad"], ok, [r.request_id for r in client.replies]

        huge, bad, ok, replies = anyio.run(main)
    finally:
        kids.stop_all()
    assert huge.failure.startswith("no_endpoints") and "the last refusal, by 3/" in huge.failure, huge.failure
    assert "max_tokens" in huge.failure.split("the last refusal", 1)[1], huge.failure
    assert bad.failure.startswith("invalid_request: malformed ClientRequest") and "tokens" in bad.failure, bad.failure
    assert ok.failure is None
    assert replies == ["huge", "bad", "ok"]
