"""A live worker keeps O(1) token times per request: what it sent the router (or its HTTP client) it drops,
and its ITL histogram still counts every gap once."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.kvemu.http.test_worker_server import serve_worker


def test_a_long_stream_holds_a_bounded_number_of_token_times_on_its_worker_and_every_gap_is_counted():
    held: list[int] = []

    async def body(http, actor):
        async with http.stream("POST", "/v1/completions",
                               json={"model": "kvemu", "prompt": "a long answer", "max_tokens": 3000,
                                     "ignore_eos": True, "stream": True}) as r:
            async for line in r.aiter_lines():
                for rec in actor._records.values():  # the engine's own records of what runs
                    held.append(len(rec.token_times_ns))
                if line == "data: [DONE]":
                    break
        return (await http.get("/metrics")).text

    text = serve_worker(body)
    counts = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "vllm:inter_token_latency_seconds_count"}
    assert sum(counts.values()) == 3000 - 1  # every gap once, though the worker dropped the times it sent
    assert held and max(held) < 300, max(held)  # before: up to 3000 (every token's time, the whole stream)


def test_past_a_few_streams_a_live_worker_coalesces_each_ones_tokens_longer():
    """The batches a live worker sends a second stay about ``MAX_BATCHES_PER_S`` however many requests
    stream (300 long streams through ``kvemu serve``: front 927 -> 245 MB, routers ~730 -> ~400 MB each, and
    the front's /metrics answering again)."""
    from workers.actor.actor import MAX_BATCHES_PER_S

    async def body(http, actor):
        base = actor.stream_interval_ns
        alone = actor.flush_interval_ns()
        n = 5 * base * MAX_BATCHES_PER_S // 10**9  # streams that need 5 x the base interval
        actor._records.update({f"r{i}": None for i in range(n)})
        try:
            return base, alone, actor.flush_interval_ns()
        finally:
            actor._records.clear()

    base, alone, crowded = serve_worker(body)
    assert alone == base and crowded == 5 * base
