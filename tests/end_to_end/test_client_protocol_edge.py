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
                                                             max_tokens=4_000_000))
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


def test_a_cancelled_request_is_aborted_at_its_worker_and_its_record_says_why(tmp_path):
    """``CancelRequest`` (a lanes deadline in ``kvemu loadgen``): the router ends the request, its worker aborts it
    and frees its KV, and the record comes back failed with the client's reason."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    scenario = small(tmp_path)
    kids = Children()
    try:
        router = kids.start("router", ["router", "--listen", "tcp://127.0.0.1:0", "--config", str(scenario)])
        worker = kids.start("w0", ["worker", "--router", router["listen"], "--worker-id", "3", "--config",
                                   str(scenario), "--http", "127.0.0.1:0", "--set",
                                   "cluster.engine.decode_speedup_ratio=0.01", "--own-engine"])  # ~1 s a token: it stays open

        async def main():
            client = _RouterClient(router["listen"])
            async with anyio.create_task_group() as tg, httpx.AsyncClient(base_url=worker["http"]) as http:
                tg.start_soon(client.listen)
                await registered(client)
                with anyio.fail_after(30):
                    async with anyio.create_task_group() as play:
                        got = []

                        async def go():
                            got.append(await client.submit(ClientRequest(request_id="long", tokens=list(range(1, 200)),
                                                                         max_tokens=1000)))
                        play.start_soon(go)
                        while (await http.get("/kvemu/unsettled")).json()["requests"] == 0:  # it reached the engine
                            await anyio.sleep(0.01)
                        await client.cancel("long", "lanes_deadline")
                    unsettled = (await http.get("/kvemu/unsettled")).json()["requests"]
                    while unsettled:  # the abort reached the worker after the router answered
                        await anyio.sleep(0.01)
                        unsettled = (await http.get("/kvemu/unsettled")).json()["requests"]
                    metrics = (await http.get("/metrics")).text
                tg.cancel_scope.cancel()
            return got[0], metrics

        rec, metrics = anyio.run(main)
    finally:
        kids.stop_all()
    assert rec.failure == "lanes_deadline" and rec.completion_ns is None
    aborted = sum(s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                  if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "abort")
    assert aborted == 1
