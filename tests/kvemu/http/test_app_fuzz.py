"""Hostile bodies and headers against the OpenAI app itself (no sockets): every answer is a vLLM-form error or a
well-formed response, never a crash, and what a refused request asked for never reaches the backend."""

from __future__ import annotations

import asyncio
import json

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from kvemu import ManualClock
from kvemu.http.app import OpenAIApp
from kvemu.http.tokenizer import builtin_tokenizer
from kvemu.records import RequestRecord
from kvemu.messages import encode


class Backend:
    """Answers at once: every request completes with its planned tokens."""

    block_size = 16

    def __init__(self, max_model_len: int = 4096) -> None:
        self.max_model_len = max_model_len
        self.submitted = []

    def submit(self, req, on_tokens, on_end):
        self.submitted.append(req)
        assert req.tokens and len(req.tokens) + req.max_tokens <= self.max_model_len
        assert all(0 <= t < builtin_tokenizer().vocab_size for t in req.tokens)
        encode(req)  # whatever the app takes, the wire carries (#27: an integer beyond 64 bits did not encode)
        on_tokens(req.max_tokens)
        on_end(RequestRecord(request_id=req.request_id, isl=len(req.tokens), output_tokens=req.max_tokens))

    def cancel(self, request_id, reason):
        pass

    def unavailable(self):
        return None


scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**7), st.integers(-10**30, 10**30),
                    st.floats(allow_nan=False),
                    st.text(max_size=30), st.sampled_from(["kvemu", "user", "text", "system", "worker_id"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "n",
        "ignore_eos", "min_tokens", "nvext", "priority", "logprobs", "echo", "seed"]
bodies = st.one_of(
    st.dictionaries(st.sampled_from(KEYS), values, max_size=8),
    st.fixed_dictionaries({"model": st.just("kvemu"), "prompt": st.one_of(
        st.text(max_size=40), st.lists(st.integers(-3, 60000), max_size=20), st.lists(st.text(max_size=10), max_size=3))},
        optional={"max_tokens": st.integers(-2, 5000), "stream": st.booleans(), "min_tokens": st.integers(-1, 50),
                  "priority": st.integers(-10**30, 10**30),
                  "nvext": st.dictionaries(st.sampled_from(["backend_instance_id", "dp_rank", "extra_fields",
                                                            "agent_hints"]), values, max_size=3)}),
    st.binary(max_size=64),
)
headers = st.dictionaries(st.sampled_from(["x-dynamo-session-id", "x-dp-rank", "x-worker-instance-id",
                                           "x-request-id", "session-id"]),
                          st.one_of(st.text(max_size=300), st.integers(-10**30, 10**30).map(str)), max_size=3)


def call(app, path, body: bytes, hdrs: dict[str, str]):
    sent = []

    async def run():
        msgs = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if msgs:
                return msgs.pop()
            await asyncio.sleep(3600)

        async def send(m):
            sent.append(m)

        scope = {"type": "http", "method": "POST", "path": path,
                 "headers": [(k.encode(), v.encode("utf-8", "surrogatepass")) for k, v in hdrs.items()]}
        await asyncio.wait_for(app(scope, receive, send), 5)

    asyncio.run(run())
    status = sent[0]["status"]
    return status, b"".join(m.get("body", b"") for m in sent[1:])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, hdrs=headers, chat=st.booleans())
@example(body={"model": "kvemu", "prompt": "hi there", "priority": 10**30}, hdrs={}, chat=False)
@example(body={"model": "kvemu", "prompt": "hi there", "nvext": {"agent_hints": {"osl": 2**64}}}, hdrs={}, chat=True)
@example(body={"model": "kvemu", "prompt": "hi there"}, hdrs={"x-dp-rank": "1"}, chat=False)
@example(body=b'{"prompt": ' + b"[" * 1500 + b"]" * 1500 + b"}", hdrs={}, chat=False)
def test_any_body_gets_a_typed_answer(body, hdrs, chat):
    backend = Backend()
    app = OpenAIApp(backend, builtin_tokenizer(), model="kvemu", clock=ManualClock())
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, out = call(app, "/v1/chat/completions" if chat else "/v1/completions", raw, hdrs)
    event(f"status {status}")
    assert status in (200, 400, 404), (status, out[:300])
    if status != 200:
        err = json.loads(out)["error"]
        assert err["code"] == status and err["message"] and err["type"]
        assert backend.submitted == []  # a refused request changes nothing
    elif out.startswith(b"data: "):
        assert out.endswith(b"data: [DONE]\n\n")
    else:
        assert json.loads(out)["usage"]["completion_tokens"] >= 1
