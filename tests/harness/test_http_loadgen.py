"""``kvemu loadgen --http``'s client: prompts that keep the workload's prefix identity, and a record for every
request, whatever the server does."""

from __future__ import annotations

import random
import socket
import threading

import anyio

from kvemu.http.tokenizer import builtin_tokenizer
from kvemu.messages import ClientRequest

from harness.procs.http_loadgen import HttpTarget


def _target(url: str = "http://127.0.0.1:9", form: str = "text") -> HttpTarget:
    return HttpTarget(url, model="kvemu", tokenizer=builtin_tokenizer(), prompt_form=form)  # type: ignore[arg-type]


def test_a_text_prompt_tokenizes_back_to_the_workloads_ids_and_shared_prefixes_stay_shared():
    target = _target()
    r = random.Random(3)
    prefix = [r.randrange(0, 1 << 31) for _ in range(300)]  # a trace's ids may be anywhere in 32 bits
    a, b = prefix + [r.randrange(0, 1 << 31) for _ in range(50)], prefix + [r.randrange(0, 1 << 31) for _ in range(50)]
    ta, tb = (target.body(ClientRequest(request_id=x, tokens=t, max_tokens=4))["prompt"] for x, t in (("a", a), ("b", b)))
    ids_a, ids_b = target.tok.encode(ta), target.tok.encode(tb)
    assert ids_a == target.prompt_ids(a) and len(ids_a) == len(a)
    assert ids_a[:300] == ids_b[:300] and ids_a[300:] != ids_b[300:]
    assert min(ids_a) >= 8  # never a special token


def test_token_id_prompts_and_the_headers_that_match_a_request_to_its_engine_record():
    target = _target(form="tokens")
    req = ClientRequest(request_id="s1-t2", tokens=[5, 9, 70000], max_tokens=3, session_id="s1")
    body = target.body(req)
    assert body["prompt"] == target.prompt_ids([5, 9, 70000]) and body["max_tokens"] == body["min_tokens"] == 3
    assert body["stream"] and body["ignore_eos"]
    assert target.headers(req) == {"X-Request-Id": "s1-t2", "X-Session-Id": "s1"}


def test_a_request_the_server_never_answers_is_recorded_when_the_run_stops():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        held: list[socket.socket] = []
        threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True).start()
        target = _target(f"http://127.0.0.1:{listener.getsockname()[1]}")
        req = ClientRequest(request_id="r", tokens=[10, 11], max_tokens=2)
        rec = target.record(req)

        async def main() -> None:
            with anyio.move_on_after(0.5):
                await target.submit(req, rec)
            await target.aclose()

        anyio.run(main)
        for s in held:
            s.close()
    assert rec.failure == "unanswered: 0 of 2 tokens when the run stopped" and rec.completion_ns is None


def test_a_refused_connection_is_a_failure_with_its_reason():
    target = _target("http://127.0.0.1:9")  # nothing listens on the discard port here
    rec = anyio.run(target.submit, ClientRequest(request_id="r", tokens=[10], max_tokens=2))
    assert rec.failure is not None and rec.failure.startswith("connection: ConnectError")


def test_a_disaggregated_requests_legs_merge_into_one_record():
    """The prefill leg says where the prompt was computed and what it found cached; the decode leg who served
    and when its KV arrived."""
    from kvemu.records import EngineFacts, RequestRecord

    from harness.procs.http_loadgen import _merge, legs_by_id

    pre = RequestRecord(request_id="x", worker_id=0, dp_rank=1, arrival_ns=110, completion_ns=150,
                        engine=EngineFacts(cached_tokens=64, reused_tokens=64))
    dec = RequestRecord(request_id="x", worker_id=2, dp_rank=0, arrival_ns=160,
                        engine=EngineFacts(admitted_ns=190, cached_tokens=0), kv_reserved_ns=170, kv_activated_ns=190)
    legs = legs_by_id([dec, pre], {0: "prefill", 2: "decode"})["x"]
    assert legs.prefill is pre and legs.serving is dec
    out = _merge(RequestRecord(request_id="c1", arrival_ns=5, isl=80), legs, t0=100, scale=2.0)
    assert (out.prefill_worker_id, out.prefill_dp_rank, out.worker_id, out.dp_rank) == (0, 1, 2, 0)
    assert out.engine.cached_tokens == out.engine.reused_tokens == 64
    assert out.dispatch_ns == 20 and out.prefill_done_ns == 100
    assert (out.kv_reserved_ns, out.kv_activated_ns, out.engine.admitted_ns) == (140, 180, 180)


def test_a_streamed_answers_token_times_take_8_bytes_a_token_on_the_client():
    """A client that reads a long stream keeps each token's time for its report in an ``array('q')``, not a list
    of int objects (~40 bytes a token: ~3 GB for 300 long streams in 30 s)."""
    from array import array

    target = _target()
    rec = target.record(ClientRequest(request_id="r", tokens=[1, 2], max_tokens=6))
    for text in (" ab", " cd ef", " gh ij kl"):
        target._on_line(rec, 'data: {"id": "r", "choices": [{"text": "' + text + '"}]}')
    assert isinstance(rec.token_times_ns, array) and rec.token_times_ns.itemsize == 8
    assert len(rec.token_times_ns) == rec.output_tokens == 6
