"""A prefill or decode worker's part in another router's disaggregated serving, over HTTP.

Two routers split a request into a prefill leg and a decode leg, each their own way:

- **vLLM style** (vllm-router ``--vllm-pd-disaggregation``, vLLM's NIXL connector): the prefill leg carries
  ``kv_transfer_params: {do_remote_decode: true}``; the prefill worker computes the prompt (one token), keeps
  its KV and answers with ``kv_transfer_params`` saying where the KV is; the router copies those into the
  decode leg. Here they name the prefill rank and its link model (``kvemu_source``) and a release token.
- **SGLang style** (sglang-router ``--pd-disaggregation``): both legs arrive at once with one
  ``bootstrap_room`` and the prefill worker's bootstrap address; the decode worker asks that address
  (``GET /kvemu/kv/room``, which this module serves on the prefill worker's HTTP port) for the room and
  waits until the prefill leg has finished.

Either way the decode rank then pulls the KV as it does behind kvemu's router (``KvTransfer``: reserve, the
link's delay, join), and once it has, tells the prefill worker to free its copy (``POST /kvemu/kv/release``
with the token, as NIXL notifies the producer). KV nobody claims is freed after ``hold_timeout_s`` (vLLM's
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s). A release that cannot be delivered is logged and counted, never
retried against another peer.

What a decode leg names is checked before anything runs. The prefill worker's address is a host (an IP literal
or a DNS name, at most 253 characters) and a port in 1..65535, and every URL to it is built from those parts,
never by pasting strings. The decode worker runs a leg only once the prefill worker it names has confirmed
(``POST /kvemu/kv/claim``) that it holds KV for that request id, for that release token and for the same prompt
(a digest of its token ids), and takes the link model from that answer, not from the leg. A room
(``GET /kvemu/kv/room``) is handed only to a caller that shows the digest of the room's prompt, and a wrong
digest does not consume it. Trust assumption: whoever has a leg's ``kv_transfer_params`` (the router copied
them) or knows a room's number *and* its prompt is the decode leg; a stranger who has neither cannot take
the KV, free it, or make a decode worker serve a leg no prefill leg ran. A decode worker does not know the
fleet's prefill workers, so it asks whichever server the leg names, at the fixed path ``/kvemu/kv/claim``.

With a **handoff secret** (``KVEMU_HANDOFF_SECRET``, shared by the fleet's workers only: ``kvemu fleet`` makes
one per run) that server must also prove it is one of them: its claim and room answers carry an HMAC-SHA256
under the secret of what they vouch for (``handoff_proof``), and a decode worker refuses an answer without a
valid one (400 naming ``claim.proof`` or ``room.proof``), so a client cannot name a listener of its own that
says yes. The decode worker's claim and room requests carry one too, so only the fleet's workers take KV. The
secret is never used for the KV-event sockets, which other routers read with plain ZeroMQ. A worker started
without it works as before and says so in one line at start.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import re
import secrets
from array import array
from collections.abc import Coroutine, Iterator
from typing import Annotated, Any
from urllib.parse import parse_qs, urlsplit

import msgspec
from msgspec import Meta

from kvemu.http.app import read_body
from kvemu.http.asgi import Receive, Routes, Scope, Send
from kvemu.http.errors import ApiError
from kvemu.http.protocol import KvTransferParams, decode_body
from kvemu.http.reply import respond
from kvemu.messages import ClientRequest
from kvemu.transfer import KvTransfer, transfer_refusal
from kvemu.wire.security import HANDOFF_SECRET_ENV
from workers.actor.actor import WorkerActor

__all__ = ["KvHandoff", "HOLD_TIMEOUT_S", "ROOM_TIMEOUT_S", "handoff_proof"]

log = logging.getLogger("kvemu.handoff")

HOLD_TIMEOUT_S = 480.0
"""How long a finished prefill leg's KV waits for its decode leg (vLLM's NIXL abort timeout)."""
ROOM_TIMEOUT_S = 300.0
"""How long an SGLang-style decode leg waits for its prefill leg to finish."""
ROOM_POLL_S = 10.0
"""The longest one ``GET /kvemu/kv/room`` waits before answering 404 (the decode worker asks again)."""
MAX_ROOMS = 100_000
"""Rooms a prefill worker keeps open at once (more: the leg is refused with 503)."""
MAX_HOST_CHARS = 253
_HOSTNAME = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?\Z")
DIGEST_CHARS = 32
"""A prompt's digest: 16 bytes of BLAKE2b over its token ids, in hex."""
PROOF_CHARS = 64
"""A handoff proof: HMAC-SHA256 under the fleet's handoff secret, in lowercase hex."""
_PROOF = re.compile(f"[0-9a-f]{{{PROOF_CHARS}}}")


RequestId = Annotated[str, Meta(max_length=512)]
Token = Annotated[str, Meta(max_length=128)]
Digest = Annotated[str, Meta(min_length=DIGEST_CHARS, max_length=DIGEST_CHARS)]
Proof = Annotated[str, Meta(min_length=PROOF_CHARS, max_length=PROOF_CHARS, pattern=f"^{_PROOF.pattern}$")]


class ReleaseBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /kvemu/kv/release``: free a finished prefill leg's KV."""

    request_id: RequestId
    token: Token


class ClaimBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /kvemu/kv/claim``: a decode worker asks whether this KV is held for its leg (once per KV)."""

    request_id: RequestId
    token: Token
    digest: Digest
    proof: Proof | None = None
    """The decode worker's ``handoff_proof(key, "claim-request", ...)``: a prefill worker with a handoff secret
    takes no claim without it."""


class ClaimAnswer(msgspec.Struct):
    """The prefill worker's answer to a claim: the link model the KV moves with (its own, not the leg's)."""

    kvemu_source: KvTransfer
    proof: Proof | None = None
    """``handoff_proof(key, "claim-answer", ...)`` of this answer: a decode worker with a handoff secret takes no
    answer without it."""


class RoomAnswer(msgspec.Struct):
    """The prefill worker's answer to ``GET /kvemu/kv/room``: the room's ``kv_transfer_params``, with their
    ``handoff_proof(key, "room-answer", ...)`` when it has a handoff secret."""

    kv_transfer_params: KvTransferParams
    proof: Proof | None = None


class _ErrorParam(msgspec.Struct):
    param: Annotated[str, Meta(max_length=128)] | None = None


class _ErrorBody(msgspec.Struct):
    """The field a peer's 4xx names (``kvemu.http.errors``' body), to say why it refused."""

    error: _ErrorParam


class _Held:
    """A finished prefill leg's KV: its answer, who may free it, its prompt's digest, its timeout, its SGLang room
    (if any) and whether a decode leg claimed it."""

    __slots__ = ("answer", "token", "digest", "source", "timer", "room", "claimed")

    def __init__(self, answer: dict[str, Any], token: str, digest: str, source: KvTransfer,
                 timer: asyncio.TimerHandle, room: int | None) -> None:
        self.answer = answer
        self.token = token
        self.digest = digest
        self.source = source
        self.timer = timer
        self.room = room
        self.claimed = False


class _Source(msgspec.Struct, frozen=True):
    """Where a decode leg's KV is, and how to free it there."""

    url: str
    request_id: str
    token: str


class KvHandoff:
    """The handoff of one prefill or decode worker (``actor.worker_type``); ``url`` is set once it listens."""

    def __init__(self, actor: WorkerActor, *, hold_timeout_s: float | None = None,
                 room_timeout_s: float | None = None, secret: str | None = None) -> None:
        if actor.worker_type not in ("prefill", "decode"):
            raise ValueError(f"a handoff is for prefill or decode workers, not {actor.worker_type}")
        self.actor = actor
        self._key = secret.encode() if secret else None
        """The fleet's handoff secret (None: answers and requests carry no proof and none is asked for)."""
        self.role = actor.worker_type
        self.url = ""
        self.hold_timeout_s = HOLD_TIMEOUT_S if hold_timeout_s is None else hold_timeout_s
        self.room_timeout_s = ROOM_TIMEOUT_S if room_timeout_s is None else room_timeout_s
        self._held: dict[str, _Held] = {}
        """Prefill: finished legs whose KV waits for its decode leg, by request id."""
        self._rooms: dict[int, asyncio.Future[_Held | str]] = {}
        """Prefill: SGLang rooms, resolved with the leg's held KV (or why it failed) when it ends."""
        self._room_of: dict[str, int] = {}
        self._digests: dict[str, str] = {}
        """Prefill: the prompt digest of each leg running here, by request id (its held KV keeps it)."""
        self._sources: dict[str, _Source] = {}
        """Decode: legs whose KV is still held on a prefill worker, by request id."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._client: Any = None  # httpx.AsyncClient, made on first use
        self.released = 0
        """Decode: releases the prefill worker acknowledged."""
        self.release_failures = 0
        """Decode: releases that could not be delivered (the prefill worker is gone, or refused)."""
        self.expired = 0
        """Prefill: held KV freed because no decode leg claimed it in time."""
        self.refused: dict[str, int] = {}
        """Legs and claims refused here, by reason (a forged or stale source, a wrong digest, a link too slow)."""
        actor.on_pulled = self._pulled

    def listening(self, url: str) -> None:
        """Its server listens at ``url`` (a prefill worker's answers name it); without a handoff secret, say once
        what that allows."""
        self.url = url
        if self._key is None:
            log.warning("%s", self.exposure())

    def exposure(self) -> str:
        """The one line a worker whose handoff runs without a secret logs at start."""
        allows = ("a decode leg may name any server to confirm its claim, so a client can have this worker decode "
                  "a prompt no prefill ran, at a link model of its choosing" if self.role == "decode" else
                  "its claim and room answers carry no proof, and whoever holds a leg's kv_transfer_params (or a "
                  "room's number and prompt) can claim its KV")
        return (f"kvemu: the KV handoff of {self.role} worker {self.actor.worker_id} at {self.url} runs without a "
                f"secret: {allows}; set {HANDOFF_SECRET_ENV} to the same secret for every prefill and decode worker "
                f"(kvemu fleet does)")

    def _proof(self, purpose: str, *fields: str | int | bytes | None) -> str | None:
        return handoff_proof(self._key, purpose, *fields) if self._key is not None else None

    def _proven(self, proof: str | None, purpose: str, *fields: str | int | bytes | None) -> bool:
        """Whether ``proof`` is this fleet's proof of ``fields`` (always, without a handoff secret)."""
        expected = self._proof(purpose, *fields)
        return expected is None or (proof is not None and hmac.compare_digest(expected.encode(), proof.encode()))

    # ------------------------------------------------------------------ legs

    async def leg(self, req: ClientRequest, body: Any) -> ClientRequest:
        params: KvTransferParams | None = body.kv_transfer_params
        room: int | None = body.bootstrap_room
        if self.role == "prefill":
            if params is not None and params.do_remote_prefill:
                raise ApiError(400, "kv_transfer_params.do_remote_prefill: this is a prefill worker; the decode leg "
                                    "goes to a decode worker", "kv_transfer_params.do_remote_prefill")
            if room is not None:
                if len(self._rooms) >= MAX_ROOMS and room not in self._rooms:
                    raise ApiError(503, f"bootstrap_room: {MAX_ROOMS} rooms are open on this worker; retry later",
                                   "bootstrap_room")
                self._room(room)
                self._room_of[req.request_id] = room
                if req.dp_rank is None:  # SGLang's follow_bootstrap_room: the room names the prefill rank
                    ranks = self.actor.worker.dp_ranks
                    req = msgspec.structs.replace(req, dp_rank=ranks[room % len(ranks)])
            elif params is None or not params.do_remote_decode:
                return req
            self._digests[req.request_id] = prompt_digest(req.tokens)
            return msgspec.structs.replace(req, kv_hold=True, max_tokens=1)
        if params is not None and params.do_remote_decode:
            raise ApiError(400, "kv_transfer_params.do_remote_decode: this is a decode worker; the prefill leg goes "
                                "to a prefill worker", "kv_transfer_params.do_remote_decode")
        if (params is None or not params.do_remote_prefill) and room is None:
            return req
        digest = prompt_digest(req.tokens)
        claimed: _Source | None = None
        try:
            self._not_running(req.request_id)
            if params is None or not params.do_remote_prefill:
                assert room is not None
                params = await self._fetch_room(body.bootstrap_host, body.bootstrap_port, room, digest)
            how = _source_of(params)
            source = await self._claim(how, digest)
            claimed = how
            if (why := transfer_refusal(source, len(req.tokens))) is not None:
                raise ApiError(400, f"kv_transfer_params.kvemu_source: {why}", "kv_transfer_params.kvemu_source")
            self._not_running(req.request_id)  # (another leg of this id may have come while this one asked)
        except ApiError as exc:
            self._refuse(exc.param or "kv_transfer", exc.message)
            if claimed is not None:  # no decode leg will pull what this one claimed: free it now
                self._spawn(self._send_release(claimed))
            raise
        self._sources[req.request_id] = how
        return msgspec.structs.replace(req, kv_transfer=source)

    def _not_running(self, request_id: str) -> None:
        if request_id in self._sources:
            raise ApiError(400, f"x-request-id: {request_id!r} is a decode leg this worker is already running",
                           "x-request-id")

    def _refuse(self, reason: str, message: str) -> None:
        """A leg or claim refused: counted by reason and logged (the client got the 4xx/5xx with ``message``)."""
        if len(self.refused) < 64 or reason in self.refused:  # (reasons are field names: a handful)
            self.refused[reason] = self.refused.get(reason, 0) + 1
        log.warning("refused a disaggregated leg: %s", message[:300])

    def answer(self, request_id: str) -> dict[str, Any] | None:
        held = self._held.get(request_id)
        return held.answer if held is not None else None

    # ------------------------------------------------------------------ told by the worker's backend

    def held(self, request_id: str, transfer: KvTransfer) -> None:
        """A prefill leg finished and its rank holds the KV: make its answer, start its timeout, open its room."""
        host, port = _host_port(self.url)
        token = secrets.token_urlsafe(24)
        answer = {"do_remote_prefill": True, "do_remote_decode": False,
                  "remote_engine_id": f"kvemu-{transfer.source_worker_id}-dp{transfer.source_dp_rank}",
                  "remote_request_id": request_id, "remote_host": host, "remote_port": port, "tp_size": 1,
                  "kvemu_source": msgspec.to_builtins(transfer), "kvemu_release_token": token}
        timer = asyncio.get_running_loop().call_later(self.hold_timeout_s, self._expire, request_id)
        old = self._held.pop(request_id, None)
        if old is not None:
            old.timer.cancel()
        room = self._room_of.pop(request_id, None)
        held = self._held[request_id] = _Held(answer, token, self._digests.pop(request_id, ""), transfer, timer, room)
        if room is not None:
            fut = self._room(room)
            if not fut.done():
                fut.set_result(held)

    def ended(self, request_id: str, failure: str | None) -> None:
        """A leg ended here: a failed prefill leg fails its room; a decode leg that never pulled its KV (it
        failed or was cancelled first) frees it on the prefill worker now rather than at the timeout."""
        self._digests.pop(request_id, None)
        room = self._room_of.pop(request_id, None)
        if room is not None:
            fut = self._room(room)
            if not fut.done():
                fut.set_result(failure or "ended without holding its KV")
        if request_id in self._sources:
            self._release(request_id)

    def _pulled(self, request_id: str) -> None:
        if request_id in self._sources:
            self._release(request_id)

    def _expire(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self.expired += 1
            log.warning("the KV of %s was held %g s and never claimed: freed", request_id, self.hold_timeout_s)
            self.actor.release_kv(request_id)
            self._drop_room(held)

    def _drop_room(self, held: _Held) -> None:
        """Close a freed leg's room if no decode leg took it (one that did closed it)."""
        if held.room is not None and (fut := self._rooms.get(held.room)) is not None and fut.done() \
                and fut.result() is held:
            del self._rooms[held.room]

    # ------------------------------------------------------------------ the wire

    def _room(self, room: int) -> asyncio.Future[_Held | str]:
        fut = self._rooms.get(room)
        if fut is None:
            fut = self._rooms[room] = asyncio.get_running_loop().create_future()
        return fut

    def _http(self) -> Any:
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(timeout=httpx.Timeout(ROOM_POLL_S + 5.0),
                                             limits=httpx.Limits(max_connections=64))
        return self._client

    async def _fetch_room(self, host: str | None, port: int | None, room: int, digest: str) -> KvTransferParams:
        """Wait for the prefill leg of ``room`` at its bootstrap server; its answer's ``kv_transfer_params``."""
        if not host or port is None:
            raise ApiError(400, "bootstrap_port: a decode leg with a bootstrap_room needs the prefill worker's "
                                "bootstrap_host and bootstrap_port (sglang-router --prefill URL BOOTSTRAP_PORT)",
                           "bootstrap_port")
        import httpx

        url = peer_url(host, port, "/kvemu/kv/room", host_field="bootstrap_host", port_field="bootstrap_port")
        deadline = asyncio.get_running_loop().time() + self.room_timeout_s
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            query: dict[str, str | int | float] = {"room": room, "wait_s": min(ROOM_POLL_S, left), "digest": digest}
            if (proof := self._proof("room-request", room, digest)) is not None:
                query["proof"] = proof
            try:
                resp = await self._http().get(url, params=query)
            except httpx.HTTPError as exc:
                raise ApiError(502, f"kv_transfer_failed: the prefill worker's bootstrap server {host}:{port} did not "
                                    f"answer: {type(exc).__name__}: {exc}") from None
            if resp.status_code == 200:
                return self._proven_room(resp.content, f"{host}:{port}", room, digest)
            if resp.status_code == 403 and _error_param(resp.content) == "proof":
                raise ApiError(502, f"room.proof: the bootstrap server {host}:{port} refused this worker's proof: the "
                                    f"two do not share {HANDOFF_SECRET_ENV}", "room.proof")
            if resp.status_code == 403:
                raise ApiError(400, f"bootstrap_room: room {room} at {host}:{port} is not this prompt's: "
                                    f"{resp.text[:300]}", "bootstrap_room")
            if resp.status_code != 404:
                raise ApiError(502, f"kv_transfer_failed: room {room} at {host}:{port}: {resp.text[:300]}")
        raise ApiError(504, f"kv_transfer_failed: the prefill leg of room {room} did not finish within "
                            f"{self.room_timeout_s:g} s")

    def _proven_room(self, content: bytes, server: str, room: int, digest: str) -> KvTransferParams:
        """A room answer's ``kv_transfer_params``, once its proof shows a worker of this fleet made it (400
        ``room.proof`` otherwise)."""
        try:
            answer = decode_body(content, RoomAnswer)
        except ApiError as exc:
            if exc.param == "proof" and self._key is not None:
                raise _unproven("room.proof", f"{server} answered room {room}", None, malformed=True) from None
            raise ApiError(400, f"bootstrap_host: {server} is not a kvemu prefill worker's bootstrap server (its room "
                                f"answer: {exc.message[:300]})", "bootstrap_host") from None
        p = answer.kv_transfer_params
        if not self._proven(answer.proof, "room-answer", room, p.remote_request_id, p.kvemu_release_token, digest,
                            _link(p.kvemu_source), p.remote_host, p.remote_port):
            raise _unproven("room.proof", f"{server} answered room {room}", answer.proof)
        return p

    async def _claim(self, how: _Source, digest: str) -> KvTransfer:
        """Ask the prefill worker a leg names to confirm it holds this KV for this token and prompt; the link
        model it answers with. A 400 naming the field when it does not (a forged or stale source), or when its
        answer does not prove it is a worker of this fleet (``claim.proof``)."""
        import httpx

        claim = ClaimBody(how.request_id, how.token, digest, self._proof("claim-request", how.request_id, how.token,
                                                                          digest))
        try:
            resp = await self._http().post(f"{how.url}/kvemu/kv/claim", content=msgspec.json.encode(claim),
                                           headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            raise ApiError(502, f"kv_transfer_failed: the prefill worker {how.url} did not answer a claim: "
                                f"{type(exc).__name__}: {exc}") from None
        if resp.status_code == 200:
            try:
                answer = decode_body(resp.content, ClaimAnswer)
            except ApiError as exc:
                if exc.param == "proof" and self._key is not None:
                    raise _unproven("claim.proof", f"{how.url} answered the claim", None, malformed=True) from None
                raise ApiError(400, f"kv_transfer_params.remote_host: {how.url} is not a kvemu prefill worker (its "
                                    f"claim answer: {exc.message[:300]})", "kv_transfer_params.remote_host") from None
            if not self._proven(answer.proof, "claim-answer", how.request_id, how.token, digest,
                                _link(answer.kvemu_source)):
                raise _unproven("claim.proof", f"{how.url} answered the claim", answer.proof)
            return answer.kvemu_source
        param = _error_param(resp.content)
        if resp.status_code == 403 and param == "proof":
            raise ApiError(502, f"claim.proof: the prefill worker {how.url} refused this worker's proof: the two do "
                                f"not share {HANDOFF_SECRET_ENV}", "claim.proof")
        field = {403: "kv_transfer_params.kvemu_release_token", 404: "kv_transfer_params.remote_request_id",
                 409: "kv_transfer_params.remote_request_id"}.get(resp.status_code, "kv_transfer_params.remote_host")
        if resp.status_code == 403 and param == "digest":
            field = "prompt"  # the token is right, the prompt is not the prefill leg's
        raise ApiError(400, f"{field}: the prefill worker {how.url} does not hold this KV for this leg "
                            f"({resp.status_code}: {resp.text[:200]})", field)

    def _release(self, request_id: str) -> None:
        self._spawn(self._send_release(self._sources.pop(request_id)))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_release(self, how: _Source) -> None:
        import httpx

        try:
            resp = await self._http().post(f"{how.url}/kvemu/kv/release",
                                           json={"request_id": how.request_id, "token": how.token})
        except httpx.HTTPError as exc:
            self.release_failures += 1
            log.warning("could not free the KV of %s at %s: %s: %s", how.request_id, how.url, type(exc).__name__, exc)
            return
        if resp.status_code == 200:
            self.released += 1
        else:
            self.release_failures += 1
            log.warning("%s would not free the KV of %s: %s %s", how.url, how.request_id, resp.status_code,
                        resp.text[:200])

    async def aclose(self) -> None:
        """Deliver the releases under way, close the client, stop the timeouts of what is still held (the
        worker's engines, and the KV with them, are going)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)
        if self._client is not None:
            await self._client.aclose()
        for held in self._held.values():
            held.timer.cancel()

    def collect(self) -> Iterator[Any]:
        """Its Prometheus series (a worker's ``/metrics`` registers it): what is held, and every release."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        held = GaugeMetricFamily("kvemu_kv_handoff_held", "Finished prefill legs whose KV waits for its decode leg")
        held.add_metric([], len(self._held))
        yield held
        for name, value, what in (
                ("released", self.released, "KV copies freed on the prefill worker once this decode worker had them"),
                ("release_failures", self.release_failures, "Releases the prefill worker did not take (gone, refused)"),
                ("expired", self.expired, "Held KV freed because no decode leg claimed it in time")):
            family = CounterMetricFamily(f"kvemu_kv_handoff_{name}", what)
            family.add_metric([], value)
            yield family
        refused = CounterMetricFamily("kvemu_kv_handoff_refused", "Legs and claims refused, by the field at fault",
                                      labels=["reason"])
        for reason, n in sorted(self.refused.items()):
            refused.add_metric([reason], n)
        yield refused

    # ------------------------------------------------------------------ routes

    def routes(self) -> Routes:
        """A prefill worker's ``POST /kvemu/kv/release``, ``POST /kvemu/kv/claim`` and ``GET /kvemu/kv/room`` (its
        bootstrap server)."""
        if self.role != "prefill":
            return {}

        def held_for(what: str, request_id: str, token: str) -> _Held:
            """The KV held for ``request_id``, if ``token`` is the one it was handed out with (404, 403)."""
            held = self._held.get(request_id)
            if held is None:
                raise ApiError(404, f"request_id: no KV of {request_id[:200]!r} is held here (freed, timed out, "
                                    f"or never held)", "request_id")
            if not hmac.compare_digest(held.token.encode(), token.encode()):
                self._refuse(f"{what}_token", f"a {what} of {request_id[:200]!r} with another token")
                raise ApiError(403, "token: not the token this KV was handed out with", "token")
            return held

        async def release(scope: Scope, receive: Receive, send: Send) -> None:
            body = decode_body(await read_body(receive, 64 << 10), ReleaseBody)
            held = held_for("release", body.request_id, body.token)
            del self._held[body.request_id]
            held.timer.cancel()
            self._drop_room(held)
            self.actor.release_kv(body.request_id)
            await respond(send, 200, b'{"released":true}')

        async def room(scope: Scope, receive: Receive, send: Send) -> None:
            number, wait_s, digest, proof = _room_query(scope)
            if not self._proven(proof, "room-request", number, digest):  # (the room stays for its decode leg)
                self._refuse("room_proof", f"room {number}: asked for without this fleet's proof")
                raise ApiError(403, f"proof: a room is handed only to a worker of this fleet ({HANDOFF_SECRET_ENV})",
                               "proof")
            created = number not in self._rooms
            if created and len(self._rooms) >= MAX_ROOMS:
                raise ApiError(503, f"room: {MAX_ROOMS} rooms are open on this worker; retry later", "room")
            fut = self._room(number)
            try:
                held = await asyncio.wait_for(asyncio.shield(fut), wait_s)
            except TimeoutError:
                if created and not fut.done() and number not in self._room_of.values():
                    self._rooms.pop(number, None)  # no prefill leg yet: the decode worker asks again
                raise ApiError(404, f"room {number}: its prefill leg has not finished yet", "room") from None
            if isinstance(held, str):
                self._rooms.pop(number, None)
                raise ApiError(410, f"room {number}: its prefill leg failed: {held}", "room")
            if not hmac.compare_digest(held.digest.encode(), digest.encode()):  # the room stays for its decode leg
                self._refuse("room_digest", f"room {number}: a claim with another prompt's digest")
                raise ApiError(403, f"digest: room {number} holds another prompt", "digest")
            self._rooms.pop(number, None)  # one decode leg per room
            a = held.answer
            proof = self._proof("room-answer", number, a["remote_request_id"], held.token, held.digest,
                                _link(held.source), a["remote_host"], a["remote_port"])
            await respond(send, 200, msgspec.json.encode({"kv_transfer_params": a, "proof": proof}))

        async def claim(scope: Scope, receive: Receive, send: Send) -> None:
            body = decode_body(await read_body(receive, 64 << 10), ClaimBody)
            if not self._proven(body.proof, "claim-request", body.request_id, body.token, body.digest):
                self._refuse("claim_proof", f"a claim of {body.request_id[:200]!r} without this fleet's proof")
                raise ApiError(403, f"proof: a claim is taken only from a worker of this fleet ({HANDOFF_SECRET_ENV})",
                               "proof")
            held = held_for("claim", body.request_id, body.token)
            if not hmac.compare_digest(held.digest.encode(), body.digest.encode()):
                self._refuse("claim_digest", f"a claim of {body.request_id[:200]!r} for another prompt")
                raise ApiError(403, "digest: this KV is another prompt's", "digest")
            if held.claimed:
                raise ApiError(409, f"request_id: the KV of {body.request_id[:200]!r} was claimed by a decode leg "
                                    f"already", "request_id")
            held.claimed = True
            proof = self._proof("claim-answer", body.request_id, body.token, held.digest, _link(held.source))
            await respond(send, 200, msgspec.json.encode(ClaimAnswer(kvemu_source=held.source, proof=proof)))

        return {("POST", "/kvemu/kv/release"): release, ("GET", "/kvemu/kv/room"): room,
                ("POST", "/kvemu/kv/claim"): claim}


def _source_of(params: KvTransferParams) -> _Source:
    """Where a decode leg's ``kv_transfer_params`` say its KV is, and how to free it once pulled."""
    missing = [name for name in ("kvemu_source", "kvemu_release_token", "remote_host", "remote_port",
                                 "remote_request_id") if getattr(params, name) is None]
    if missing:
        raise ApiError(400, f"kv_transfer_params.{missing[0]}: missing; a decode leg takes the kv_transfer_params a "
                            f"kvemu prefill worker answered with, as they are", f"kv_transfer_params.{missing[0]}")
    assert params.kvemu_release_token is not None and params.remote_request_id is not None
    assert params.remote_host is not None and params.remote_port is not None
    return _Source(peer_url(params.remote_host, params.remote_port, "", host_field="kv_transfer_params.remote_host",
                            port_field="kv_transfer_params.remote_port"),
                   params.remote_request_id, params.kvemu_release_token)


def handoff_proof(key: bytes, purpose: str, *fields: str | int | bytes | None) -> str:
    """HMAC-SHA256 under the fleet's handoff secret of ``purpose`` and ``fields``, each typed and length-prefixed
    (no two different lists encode alike), in hex: what shows a claim or room answer (or request) came from a
    worker holding the secret, for exactly those values."""
    mac = hmac.new(key, b"kvemu-kv-handoff-v1", hashlib.sha256)
    for part in (purpose, *fields):
        kind, data = (b"n", b"") if part is None else (b"b", part) if isinstance(part, bytes) else \
            (b"i", str(part).encode()) if isinstance(part, int) else (b"s", part.encode())
        mac.update(kind + len(data).to_bytes(8, "big") + data)
    return mac.hexdigest()


def _link(source: KvTransfer | None) -> bytes | None:
    """A link model as its proof covers it: every field, as the wire carries it."""
    return msgspec.json.encode(source) if source is not None else None


def _unproven(param: str, what: str, proof: str | None, malformed: bool = False) -> ApiError:
    """The 400 of an answer that does not prove a worker of this fleet made it (``param`` names the proof)."""
    how = "with a malformed proof" if malformed else "without a proof" if proof is None else "with a wrong proof"
    return ApiError(400, f"{param}: {what} {how}: it is not a prefill worker of this fleet (they share "
                         f"{HANDOFF_SECRET_ENV}); nothing was reserved", param)


def _error_param(content: bytes) -> str | None:
    """The field a peer's error answer names (None: none, or not kvemu's error body)."""
    try:
        return msgspec.json.decode(content, type=_ErrorBody).error.param
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def prompt_digest(tokens: Any) -> str:
    """What both legs of one request know and a stranger does not: a digest of the prompt's token ids."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=DIGEST_CHARS // 2).hexdigest()


def peer_url(host: str, port: int, path: str, *, host_field: str, port_field: str) -> str:
    """``http://host:port/path`` for a peer a leg names, built from checked parts: the host an IP literal or a DNS
    name, the port in 1..65535 (a 400 naming the field otherwise)."""
    import httpx

    if not 1 <= port <= 65535:
        raise ApiError(400, f"{port_field}: a port in 1..65535, not {port}", port_field)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is None or getattr(ip, "scope_id", None):  # (a scoped IPv6 address: not a peer a leg can name)
        if len(host) > MAX_HOST_CHARS or not _HOSTNAME.match(host):
            raise ApiError(400, f"{host_field}: an IP address or a host name (letters, digits, '-' and '.', at most "
                                f"{MAX_HOST_CHARS} characters), not {host[:64]!r}", host_field) from None
    return str(httpx.URL(scheme="http", host=str(ip) if ip is not None else host, port=port, path=path or "/")
               ).rstrip("/")


def _host_port(url: str) -> tuple[str, int | None]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port


def _room_query(scope: Scope) -> tuple[int, float, str, str | None]:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    raw = query.get("room", [""])[-1]
    if not raw.isdigit() or len(raw) > 19 or int(raw) >= 1 << 63:
        raise ApiError(400, f"room: an integer in 0..2^63-1, not {raw[:32]!r}", "room")
    wait = query.get("wait_s", ["0"])[-1]
    try:
        wait_s = float(wait)
    except ValueError:
        raise ApiError(400, f"wait_s: a number of seconds, not {wait[:32]!r}", "wait_s") from None
    if not 0 <= wait_s <= ROOM_POLL_S:
        raise ApiError(400, f"wait_s: 0..{ROOM_POLL_S:g} seconds, not {wait_s:g}", "wait_s")
    digest = query.get("digest", [""])[-1]
    if len(digest) != DIGEST_CHARS:
        raise ApiError(403, f"digest: a room is handed only to its decode leg, which shows the {DIGEST_CHARS}-character"
                            f" digest of the room's prompt (harness.procs.kv_handoff.prompt_digest)", "digest")
    proof = query.get("proof", [None])[-1]
    if proof is not None and not _PROOF.fullmatch(proof):
        raise ApiError(400, f"proof: {PROOF_CHARS} lowercase hex characters (handoff_proof), not {proof[:80]!r}",
                       "proof")
    return int(raw), wait_s, digest, proof

