"""Per-request token times stay O(1) where nobody reads them: a router's record of a request served to an HTTP
client keeps its count and last time only (before: 8 bytes a token for the whole stream)."""

from __future__ import annotations

import pytest

from kvemu.http.backend import LastTokenTime
from kvemu.records import router_record

from tests.kvemu.http.test_frontdoor import PROMPT, serve


def test_last_token_time_counts_every_token_and_keeps_only_the_last():
    rec = router_record("r", session_id=None, parent_session_id=None, arrival_ns=0, isl=1, max_tokens=5)
    rec.token_times_ns = LastTokenTime()  # type: ignore[assignment]
    rec.add_token_times([10, 20])
    rec.add_token_times([])
    rec.add_token_times([30])
    assert len(rec.token_times_ns) == 3 and rec.last_token_ns() == 30
    with pytest.raises(IndexError):
        rec.token_times_ns[0]
    with pytest.raises(TypeError):  # nothing may read it as the whole list it is not
        list(rec.token_times_ns)


def test_a_router_record_of_an_http_stream_keeps_no_list_of_token_times():
    seen: list[tuple[type, int, int]] = []

    async def body(client, http, c):
        c.router.hooks.subscribe(lambda ev: seen.append((type(ev.record.token_times_ns),
                                                         len(ev.record.token_times_ns), ev.record.output_tokens)),
                                 "tokens")
        r = await http.post("/v1/completions", json={"model": "kvemu", "prompt": PROMPT, "max_tokens": 400,
                                                     "ignore_eos": True, "nvext": {"extra_fields": ["timing"]}})
        return r.json()

    answer = serve(body)
    assert answer["usage"]["completion_tokens"] == 400 and answer["nvext"]["timing"]["itl_ms"] is not None
    assert seen and {t for t, _, _ in seen} == {LastTokenTime}  # before: an array('q') of every token's time
    assert all(n == out for _, n, out in seen) and seen[-1][2] == 400


def test_an_output_plan_is_the_same_walk_of_pieces_built_by_slices():
    """A request's output ids and texts, piece ``(start + 7919 i) % k`` for token i, come from one laid-out walk
    by slicing (100,000 tokens: a copy in C, not two Python loops a token on the event loop)."""
    import xxhash

    from kvemu.http.tokenizer import builtin_tokenizer

    tok = builtin_tokenizer()
    k = len(tok._pieces)
    assert tok._cycle is not None
    for rid, n in (("a", 0), ("b", 1), ("cmpl-1", 1000), ("x", 2 * k + 5)):
        start = xxhash.xxh3_64_intdigest(rid.encode()) % k
        picks = [(start + 7919 * i) % k for i in range(n)]
        assert tok.output(rid, n) == ([tok._piece_ids[j] for j in picks], [tok._pieces[j] for j in picks])
