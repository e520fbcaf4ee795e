"""The OpenAI front door of router processes (``kvemu front``, which ``kvemu serve`` and ``kvemu up --http`` start
with ``router.replicas``): requests spread by ``router.replica_front``, tokens streamed back from the router that
runs each request, and every router's messages accepted only on that router's own link."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvemu.clock import WallClock
from kvemu.messages import ClientRequest, encode
from kvemu.records import RequestRecord
from kvemu.replica_front import ReplicaFront

from harness.procs.protocol import (CLIENT, CancelRequest, RecordReply, Stats, StatsQuery, StreamTokens,
                                    TokensReply, client_decoder, reply_decoder)
from harness.procs.replica_door import RouterLink, RouterProcesses
from harness.procs.up import Children
from tests.end_to_end.test_processes import FAST, ROOT, _gone, router_and_worker, small
from tests.end_to_end.test_supervisor import finish, served, slow_replicas
from tests.process_output import tagged, tagged_env
from tests.sse_client import open_streams, stream_chat

TWO_REPLICAS = "router: {policy: kv, heartbeat_timeout_s: 1.5, replicas: 2, replica_front: session}\n"


# ------------------------------------------------------------------ the front door's links, against fake routers


class FakeRouter:
    """A ROUTER socket on 127.0.0.1 standing in for a router process: it keeps what clients send and answers as
    the test says."""

    def __init__(self, endpoint: str | None = None) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if endpoint is None:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            endpoint = f"tcp://127.0.0.1:{port}"
        else:  # a router started again at the address of one that went away
            self.sock.bind(endpoint)
        self.endpoint = endpoint
        self.got: list[object] = []
        self.peer: bytes | None = None

    async def receive(self, kind: type, timeout_s: float = 5.0) -> object:
        """The next client message of type ``kind`` (others are kept in ``got`` too)."""
        with anyio.fail_after(timeout_s):
            while True:
                peer, frame, data = await self.sock.recv_multipart()
                assert frame == CLIENT
                self.peer = peer
                msg = client_decoder.decode(data)
                self.got.append(msg)
                if type(msg) is kind:
                    return msg

    async def send(self, msg: object) -> None:
        assert self.peer is not None
        await self.sock.send_multipart([self.peer, CLIENT, encode(msg)])

    def close(self) -> None:
        self.sock.close(linger=0)


def _stats(workers: int) -> Stats:
    return Stats(now_ns=0, workers=list(range(workers)), ranks=[], samples=[], kv_stats={})


def _record(rid: str, tokens: int = 3) -> RequestRecord:
    return RequestRecord(request_id=rid, arrival_ns=1, isl=4, max_tokens=tokens, output_tokens=tokens,
                         first_token_ns=2, completion_ns=3)


def _request(rid: str, session: str | None = None) -> ClientRequest:
    return ClientRequest(request_id=rid, tokens=[1, 2, 3, 4], max_tokens=3, session_id=session)


async def _until(cond, timeout_s: float = 5.0) -> None:
    with anyio.fail_after(timeout_s):
        while not cond():
            await anyio.sleep(0.01)


def _sessions_by_replica(front: ReplicaFront) -> tuple[str, str]:
    """A session id the front sends to replica 0 and one it sends to replica 1."""
    ids = [f"s{i}" for i in range(64)]
    return (next(s for s in ids if front.pick(s) == 0), next(s for s in ids if front.pick(s) == 1))


def test_each_request_goes_to_the_replica_its_session_picks_and_streams_back_from_it_alone():
    async def main() -> None:
        routers = [FakeRouter(), FakeRouter()]
        clock = WallClock()
        links = [RouterLink(i, r.endpoint, clock) for i, r in enumerate(routers)]
        front = ReplicaFront(2, "session", seed=1)
        backend = RouterProcesses(links, front, clock, max_model_len=4096, block_size=16)
        s0, s1 = _sessions_by_replica(ReplicaFront(2, "session", seed=1))
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        ended: dict[str, RequestRecord] = {}
        async with anyio.create_task_group() as tg:
            await tg.start(backend.serve)
            for r in routers:  # each link asks its router for tokens first, then pings it
                await r.receive(StreamTokens)
                await r.receive(StatsQuery)
            assert backend.unavailable() == "no worker is registered with router replica 0"
            for r in routers:
                await r.send(_stats(2))
            await _until(lambda: backend.unavailable() is None)
            backend.submit(_request("a", s0), tokens["a"].append, lambda rec: ended.setdefault("a", rec))
            backend.submit(_request("b", s1), tokens["b"].append, lambda rec: ended.setdefault("b", rec))
            a = await routers[0].receive(ClientRequest)
            b = await routers[1].receive(ClientRequest)
            assert (a.request_id, b.request_id) == ("a", "b")  # type: ignore[attr-defined]
            # router 1 speaks of router 0's request: not accepted on its link, nothing reaches "a"
            await routers[1].send(TokensReply(request_id="a", n=5))
            await routers[1].send(RecordReply(record=_record("a", 5)))
            await routers[0].send(TokensReply(request_id="a", n=1))
            await routers[0].send(TokensReply(request_id="a", n=2))
            await routers[0].send(RecordReply(record=_record("a")))
            await _until(lambda: "a" in ended)
            assert tokens["a"] == [1, 2] and ended["a"].output_tokens == 3
            assert links[1].unmatched == 2 and links[0].unmatched == 0
            assert "b" not in ended  # still open at router 1
            assert [link.sent for link in links] == [1, 1]
            await routers[1].send(RecordReply(record=_record("b")))
            await _until(lambda: "b" in ended)
            assert tokens["b"] == []  # a record without tokens first: the front end streams them at its end
            tg.cancel_scope.cancel()
        for r in routers:
            r.close()

    anyio.run(main)


def test_a_cancel_goes_to_the_requests_router_and_its_id_is_not_reused_before_that_router_ended_it():
    async def main() -> None:
        router = FakeRouter()
        clock = WallClock()
        backend = RouterProcesses([RouterLink(0, router.endpoint, clock)], ReplicaFront(1), clock,
                                  max_model_len=4096, block_size=16)
        ended: list[RequestRecord] = []
        async with anyio.create_task_group() as tg:
            await tg.start(backend.serve)
            backend.submit(_request("x"), lambda n: None, ended.append)
            await router.receive(ClientRequest)
            backend.submit(_request("x"), lambda n: None, ended.append)  # the same id while it is open
            assert len(ended) == 1 and ended[0].failure.startswith("duplicate_request_id")
            backend.cancel("x", "client_disconnected")
            cancel = await router.receive(CancelRequest)
            assert cancel == CancelRequest(request_id="x", reason="client_disconnected")
            backend.submit(_request("x"), lambda n: None, ended.append)  # the router has not ended the old one
            assert len(ended) == 2 and "was cancelled" in ended[1].failure
            await router.send(RecordReply(record=_record("x")))  # the cancelled one ends: nobody is told
            await _until(lambda: backend.links[0].unmatched == 1)
            assert len(ended) == 2
            backend.submit(_request("x"), lambda n: None, ended.append)  # now the id is free again
            await router.receive(ClientRequest)
            assert len(ended) == 2 and backend.links[0].open.keys() == {"x"}
            tg.cancel_scope.cancel()
        router.close()

    anyio.run(main)


def test_a_silent_router_is_lost_its_requests_fail_and_it_is_found_again_when_it_answers():
    async def main() -> None:
        router = FakeRouter()
        clock = WallClock()
        link = RouterLink(0, router.endpoint, clock, lost_after_s=0.3, ping_s=0.05)
        backend = RouterProcesses([link], ReplicaFront(1), clock, max_model_len=4096, block_size=16)
        ended: list[RequestRecord] = []
        async with anyio.create_task_group() as tg:
            await tg.start(backend.serve)
            await router.receive(StatsQuery)
            await router.send(_stats(1))
            await _until(lambda: backend.unavailable() is None)
            backend.submit(_request("x"), lambda n: None, ended.append)
            await router.receive(ClientRequest)
            await _until(lambda: link.lost is not None)  # no answer for 0.3 s
            assert [r.failure.split(":")[0] for r in ended] == ["router_lost"]
            assert "did not answer" in (backend.unavailable() or "")
            backend.submit(_request("y"), lambda n: None, ended.append)  # fails at once, never sent
            assert ended[1].failure.startswith("router_lost") and link.sent == 1
            await router.send(_stats(1))
            await _until(lambda: link.lost is None and backend.unavailable() is None)
            tg.cancel_scope.cancel()
        router.close()

    anyio.run(main)


def test_a_router_whose_connection_drops_is_lost_at_once_its_requests_go_to_the_next_live_one_and_a_new_connection_asks_for_tokens_first():
    """A router process that dies closes its connection: its open requests end with ``router_lost`` at once (not
    after ``lost_after_s`` of silence), the requests the front gives it go to the next live replica round the
    ring, and when a router is back at that address the new connection's first message is ``StreamTokens`` (a
    router streams to a connection: without it a restarted router would send records only)."""
    async def main() -> None:
        routers = [FakeRouter(), FakeRouter(), FakeRouter()]
        clock = WallClock()
        links = [RouterLink(i, r.endpoint, clock, lost_after_s=60, ping_s=0.05) for i, r in enumerate(routers)]
        front = ReplicaFront(3, "round_robin")
        backend = RouterProcesses(links, front, clock, max_model_len=4096, block_size=16)
        ended: dict[str, RequestRecord] = {}
        tokens: list[int] = []

        def submit(rid: str) -> None:
            backend.submit(_request(rid), tokens.append, lambda rec: ended.setdefault(rid, rec))

        async with anyio.create_task_group() as tg:
            await tg.start(backend.serve)
            for r in routers:
                await r.receive(StatsQuery)
                await r.send(_stats(1))
            await _until(lambda: backend.unavailable() is None)
            submit("a")  # round robin: replica 0
            await routers[0].receive(ClientRequest)
            started = clock.now_ns()
            routers[0].close()  # its process died
            await _until(lambda: "a" in ended, timeout_s=2.0)
            assert ended["a"].failure.startswith("router_lost: router replica 0 at ")
            assert "closed its connection" in ended["a"].failure
            assert (clock.now_ns() - started) / 1e9 < 2.0 and links[0].lost is not None
            assert backend.unavailable() is None  # the others serve: /health stays 200
            for rid in ("b", "c", "d"):  # round robin gives replicas 1, 2, then 0: lost, so its successor, 1
                submit(rid)
            assert [(await routers[i].receive(ClientRequest)).request_id for i in (1, 1, 2)] == ["b", "d", "c"]
            assert [link.sent for link in links] == [1, 2, 1] and [link.rerouted for link in links] == [0, 1, 0]
            routers[0] = FakeRouter(routers[0].endpoint)  # started again at its address
            first = client_decoder.decode((await routers[0].sock.recv_multipart())[2])
            assert type(first) is StreamTokens  # before any ping or request on the new connection
            await routers[0].receive(StatsQuery)
            await routers[0].send(_stats(1))
            await _until(lambda: links[0].live)
            submit("e")  # replica 1's turn; then "f" is replica 2's and "g" replica 0's again
            submit("f")
            submit("g")
            assert (await routers[0].receive(ClientRequest)).request_id == "g"  # type: ignore[attr-defined]
            await routers[0].send(TokensReply(request_id="g", n=2))
            await routers[0].send(RecordReply(record=_record("g", 2)))
            await _until(lambda: "g" in ended)
            assert tokens == [2] and ended["g"].failure is None and links[0].dropped == 1
            tg.cancel_scope.cancel()
        for r in routers:
            r.close()

    anyio.run(main)


# ------------------------------------------------------------------ router processes and kvemu serve


def _client(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 20_000)
    sock.connect(endpoint)
    return sock


def _replies_until_record(sock: zmq.Socket) -> list[object]:
    out: list[object] = []
    while not out or type(out[-1]) is not RecordReply:
        frame, data = sock.recv_multipart()
        assert frame == CLIENT
        out.append(reply_decoder.decode(data))
    return out


@pytest.mark.process_supervision
def test_a_router_process_streams_tokens_only_to_a_client_that_asked(tmp_path):
    kids = Children()
    try:
        router = router_and_worker(kids, small(tmp_path), 0, *FAST, router_args=tuple(FAST))
        streaming, plain = _client(router["listen"]), _client(router["listen"])
        streaming.send_multipart([CLIENT, encode(StreamTokens())])
        for sock in (streaming, plain):
            sock.send_multipart([CLIENT, encode(ClientRequest(request_id="r", tokens=list(range(64)), max_tokens=12))])
        got = _replies_until_record(streaming)
        record = got[-1].record  # type: ignore[attr-defined]
        assert record.failure is None and record.output_tokens == 12
        steps = [m.n for m in got[:-1]]  # type: ignore[attr-defined]
        assert all(type(m) is TokensReply and m.request_id == "r" for m in got[:-1])
        assert sum(steps) == 12 and len(steps) >= 2  # as the tokens came, before the record
        got = _replies_until_record(plain)
        assert len(got) == 1 and got[0].record.output_tokens == 12  # type: ignore[attr-defined]
    finally:
        kids.stop_all()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _chat(base: str, session: str) -> list[dict]:
    body = json.dumps({"model": "kvemu", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 12,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "x-session-id": session})
    with urllib.request.urlopen(req, timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


@pytest.mark.process_supervision
def test_kvemu_serve_with_two_router_replicas_spreads_http_requests_by_session_and_streams_them(tmp_path):
    path = small(tmp_path)
    text = path.read_text().replace(
        "router: {policy: kv, affinity: {enabled: true, ttl_secs: 30}, heartbeat_timeout_s: 1.5}\n", TWO_REPLICAS)
    assert "replicas: 2" in text
    path.write_text(text)
    tag, env = tagged_env()
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "serve", str(path), *FAST, "--http", "127.0.0.1:0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        serving = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert serving["event"] == "serving" and len(serving["routers"]) == 2, serving
        base = serving["http"]
        deadline = time.monotonic() + 20
        while _get(f"{base}/health")[0] != 200 and time.monotonic() < deadline:  # both routers know the workers
            time.sleep(0.1)
        assert _get(f"{base}/health")[0] == 200
        s0, s1 = _sessions_by_replica(ReplicaFront(2, "session", seed=4))  # the scenario's run.seed
        for session in (s0, s0, s0, s1):
            chunks = _chat(base, session)
            assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]).strip()
            assert chunks[-1]["usage"]["completion_tokens"] == 8  # the scenario's output length (osl), under 12
        metrics = _get(f"{base}/metrics")[1].decode()
        assert 'kvemu_front_replica_requests_total{replica="0"} 3.0' in metrics
        assert 'kvemu_front_replica_requests_total{replica="1"} 1.0' in metrics
        assert 'kvemu_front_replica_up{replica="1"} 1.0' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        code, err = finish(proc, timeout=60)
    assert code == 0, err[-3000:]
    assert "behind 2 router replicas" in err
    assert _gone(tag)


def test_front_refuses_router_flags_that_do_not_fit_the_scenario(tmp_path):
    path = small(tmp_path)
    path.write_text(path.read_text().replace(
        "router: {policy: kv, affinity: {enabled: true, ttl_secs: 30}, heartbeat_timeout_s: 1.5}\n", TWO_REPLICAS))
    res = subprocess.run([sys.executable, "-m", "harness.cli", "front", "--router", "tcp://127.0.0.1:9", "--config",
                          str(path), "--http", "127.0.0.1:0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "1 --router flags for router.replicas 2" in res.stderr and "Traceback" not in res.stderr


def test_tokens_reply_bounds_its_count():
    for n in (0, -1, 1 << 40):
        with pytest.raises(msgspec.ValidationError):
            reply_decoder.decode(msgspec.msgpack.encode({"type": "TokensReply", "request_id": "r", "n": n}))


# ------------------------------------------------------------------ a router replica lost or restarted under load

def _sessions(n: int, per: int) -> list[list[str]]:
    """``per`` session ids for each of ``n`` replicas, as the scenario's front (session, run.seed 4) picks."""
    front, out, i = ReplicaFront(n, "session", seed=4), [[] for _ in range(n)], 0
    while min(len(x) for x in out) < per:
        s, i = f"s{i}", i + 1
        if len(out[front.pick(s)]) < per:
            out[front.pick(s)].append(s)
    return out


def _metric(base: str, name: str, replica: int) -> float:
    text = _get(f"{base}/metrics")[1].decode()
    line = next(x for x in text.splitlines() if x.startswith(f'{name}{{replica="{replica}"}}'))
    return float(line.split()[-1])


def _until_true(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.process_supervision
def test_killing_one_of_three_router_replicas_under_serve_ends_its_streams_with_router_lost_and_serves_on(tmp_path):
    """Issue #43: SIGKILL of one replica used to end the whole stack in 5.4 s and cut all 9 open streams (status
    200, no error event, no [DONE]). Now its 3 streams end with an error event naming ``router_lost``, the 6 on
    the healthy replicas complete, requests for it go to a live one, and the supervisor starts it again."""
    with served(tmp_path, 3) as (proc, err_path, tag, base):
        by_replica = _sessions(3, 3)
        streams, threads = open_streams(base, [s for ss in by_replica for s in ss], 600)
        for s in streams:
            assert s.first_token.wait(30) and s.ttft_s is not None, s
        killed_at = time.monotonic()
        os.kill(next(p for p, c in tagged(tag).items() if " router " in c and "--replica 0 " in c), signal.SIGKILL)
        for t in threads:
            t.join(90)
        assert proc.poll() is None, "the stack stopped"
        lost, healthy = streams[:3], streams[3:]
        assert all(s.ended_with_reason and s.status == 200 for s in streams), streams
        assert all("router_lost: router replica 0" in (s.error or "") for s in lost), lost
        assert all(s.completed and s.usage["completion_tokens"] == 600 for s in healthy), healthy
        assert max(s.ended_at for s in lost) - killed_at < 3.0  # at once, not after 10 s of silence
        # a new request of a session replica 0 had: served (by the next live replica, or the restarted one)
        again = stream_chat(base, by_replica[0][0], 50)
        assert again.completed and again.usage["completion_tokens"] == 50, again
        _until_true(lambda: '"event": "router_restarted", "replica": 0' in err_path.read_text(), 30,
                    "replica 0 was not started again")
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        code, _ = finish(proc, timeout=90)
    text = err_path.read_text()
    assert code == 0, text[-3000:]
    assert '"event": "router_exited", "replica": 0, "how": "signal SIGKILL"' in text
    assert "Traceback" not in text
    assert _gone(tag)


@pytest.mark.process_supervision
def test_a_router_replica_restarted_at_its_address_streams_through_the_front_again(tmp_path):
    """Issue #43: ``StreamTokens`` was sent once per link, at connect; a replica started again at its address got
    a new connection that never asked, so the front's streams came in one piece at the end (TTFT = E2E, 2
    chunks). Now every new connection asks first."""
    path = slow_replicas(tmp_path, 2)
    kids = Children()
    tag, env = tagged_env()
    try:
        routers = [kids.start(f"router-{i}", ["router", "--listen", "tcp://127.0.0.1:0", "--replica", str(i),
                                              "--config", str(path)], env=env) for i in (0, 1)]
        endpoints = [r["listen"] for r in routers]
        for w in (0, 1):
            kids.start(f"worker-{w}", ["worker", *(x for r in endpoints for x in ("--router", r)), "--worker-id",
                                       str(w), "--config", str(path)], env=env)
        base = kids.start("front", ["front", *(x for r in endpoints for x in ("--router", r)), "--http",
                                    "127.0.0.1:0", "--config", str(path)], env=env)["http"]
        _until_true(lambda: _get(f"{base}/health")[0] == 200, 30, "the replicas never had workers")
        session = _sessions(2, 1)[1][0]
        before = stream_chat(base, session, 200)
        assert before.completed and before.chunks >= 20, before
        kids.procs.pop("router-1").kill()
        kids.start("router-1", ["router", "--listen", endpoints[1], "--replica", "1", "--config", str(path)], env=env)
        _until_true(lambda: _metric(base, "kvemu_front_replica_workers", 1) == 2, 30,
                    "the restarted replica never had its workers again, as the front door sees it")
        after = stream_chat(base, session, 200)
        assert after.completed and after.usage["completion_tokens"] == 200, after
        assert after.chunks >= 20 and after.ttft_s < after.e2e_s / 4, after  # streamed, not one piece at the end
        assert _metric(base, "kvemu_front_replica_requests_total", 1) == 2  # both went to replica 1
    finally:
        kids.stop_all()
    assert _gone(tag)
