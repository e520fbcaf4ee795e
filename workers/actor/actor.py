"""The worker actor: a ``MockWorker`` (one engine core per DP rank) behind a router link.

It registers, heartbeats, accepts or rejects dispatches, drives its cores and publishes each rank's
KV events. How the cores move in time (fast-forward on virtual time, one task per rank sleeping each
pass on wall time) is its ``ModeDriver``'s (``workers.actor.drivers``), chosen once at construction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio
import msgspec

from kvemu.clock import NS_PER_MS, NS_PER_S, Clock
from kvemu.router_events import EngineEvents
from kvemu.records import EngineRecord
from kvemu.messages import (
    Abort,
    Chaos,
    ClientRequest,
    Deregister,
    Dispatch,
    Draining,
    RankDown,
    Reregister,
    RequestFailed,
    DispatchAck,
    Finished,
    Heartbeat,
    KvPulled,
    Register,
    RegisterAck,
    ReleaseKv,
    RouterMessage,
    TokenBatch,
)
from kvemu.runtime.transport import WorkerEnd
from kvemu.runtime.wakeup import Wakeup
from kvemu.transfer import KvTransfer
from kvemu.kv_events import AllBlocksCleared, KVEventBatch
from workers.actor.drivers import ModeDriver, RunMode, mode_driver
from workers.results import AdvanceResult, StepResult
from workers.request import Request
from workers.mock_worker import Core, MockWorker, engine_core
from workers.config import SPEC_KIND
from workers.rank_engine import RankEngine

__all__ = ["KvPublisher", "WorkerRejected", "WorkerActor"]

log = logging.getLogger("kvemu.worker")


class KvPublisher(Protocol):
    """Anything that publishes one rank's KV-event batches (ZeroMQ or in-memory), in the form it carries."""

    drop_next: int
    """Chaos: this many coming batches reach only the replay buffer."""
    lag_ns: int
    """Chaos: batches are published this long late."""

    def publish(self, batch: KVEventBatch | EngineEvents) -> bool: ...


class WorkerRejected(RuntimeError):
    """The router refused this worker's registration (or never answered it)."""


MAX_BATCHES_PER_S = 1000
"""Live: about the most token batches a worker sends a second: with many requests running, each one's tokens are
coalesced longer (at 1,000 a second, 100 streams get a batch each per 100 ms), as the router and the front door
each do work again per batch."""


class WorkerActor:
    """Serves dispatches from one router with a ``MockWorker``."""

    def __init__(
        self,
        worker: MockWorker,
        end: WorkerEnd,
        clock: Clock,
        publishers: Sequence[KvPublisher],
        *,
        mode: RunMode,
        heartbeat_interval_s: float | None = 1.0,
        kv_endpoints: Sequence[str] = (),
        kv_replay_endpoints: Sequence[str] = (),
        worker_type: str = "aggregated",
        taints: Sequence[str] = (),
    ) -> None:
        if len(publishers) != len(worker.cores):
            raise ValueError(f"worker {worker.worker_id}: {len(publishers)} KV publishers for {len(worker.cores)} ranks")
        self.worker = worker
        self.end = end
        self.clock = clock
        self.publishers = list(publishers)
        self.heartbeat_interval_s = heartbeat_interval_s
        """How long the worker may be silent before it heartbeats; None: never (its host decided nothing can
        observe its silence: an in-process virtual run with no fault that makes one)."""
        self.worker_type = worker_type
        cfg = worker.config
        self._transfer = KvTransfer(source_worker_id=worker.worker_id, bandwidth_gbps=cfg.kv_transfer_bandwidth,
                                    bytes_per_token=cfg.kv_transfer_bytes_per_token, mode=cfg.kv_transfer_timing_mode)
        """The link model a prefill leg's KV moves with (this rank's; the decode rank applies it)."""
        self._held: dict[str, int] = {}  # prefill legs whose KV this worker holds for a decode rank -> rank
        self._legs: set[str] = set()  # prefill legs running here: their one token is not streamed
        self.register_msg = Register(
            worker_id=worker.worker_id,
            dp_size=len(worker.cores),
            dp_start=worker.dp_start_rank,
            block_size=worker.config.resolved_block_size,
            total_kv_blocks=worker.config.num_gpu_blocks,
            max_num_batched_tokens=worker.config.max_num_batched_tokens,
            worker_type=worker_type,
            taints=list(taints),
            kv_endpoints=list(kv_endpoints),
            kv_replay_endpoints=list(kv_replay_endpoints),
            kv_groups=[(SPEC_KIND[g.kind], g.window) for g in cfg.kv_cache_groups],
            engine=worker.config.settings(),
        )
        self.on_chaos: Callable[[Chaos, str | None], None] | None = None
        """Told each fault the router asked for, and why it could not be applied (None: it was)."""
        self.registered = anyio.Event()
        self._answered = anyio.Event()
        self._retry_after_s = 0.0
        self.stopped = False
        self._defer = False
        self.register_timeout_s = 30.0
        self.register_warn_s = 5.0
        """With no answer at all to its registration after this long, the worker says so (``on_unanswered``)."""
        self.on_unanswered: Callable[[float], None] | None = None
        """Told (the seconds waited) when the router has not answered the registration after ``register_warn_s``
        (a wrong address or a different ``KVEMU_SECRET`` look the same: silence); logged when unset."""
        self.stream_interval_ns = 2_000_000
        """Wall time: after the first token, a request's tokens are sent at most this often (and at the end);
        with many requests running, less often, so the worker sends at most about ``MAX_BATCHES_PER_S`` however
        many stream (the router and the front door do the
        same work again per batch: unbounded, their queues and memory grow with every token in flight). The
        times a batch carries stay exact."""
        self._flushed_at: dict[str, int] = {}
        self.dead_ranks: set[int] = set()
        self._last_sent_ns = -(1 << 62)
        self.engine_errors = 0
        """Engine passes that raised (``fault``): each ended its rank's requests with ``engine_error``."""

        self.driver: ModeDriver = mode_driver(mode, self)
        """Brings the engines to now, re-arms or wakes them after each act, runs them."""
        self._beats = Wakeup(self._heartbeat, clock.now_ns)
        self._records: dict[str, EngineRecord] = {}
        self._sent: dict[str, int] = {}
        self.local: dict[str, Callable[[TokenBatch | Finished | RequestFailed], None]] = {}
        """Requests that came to this worker directly (its HTTP server), by id: where their replies go instead
        of the router."""
        self.on_end: Callable[[EngineRecord, str], None] | None = None
        """Told every request that ends on this worker, with vLLM's finish reason (``length`` or ``abort``):
        the worker's metrics."""
        self.on_sent_times: Callable[[EngineRecord, list[int]], None] | None = None
        """Live mode: told a request's token times once they have been sent and before all but the last are
        dropped (a live worker keeps O(1) of them per request; whoever counts gaps, the worker's metrics, sees
        each gap once: here, or at ``on_end`` for the rest)."""
        self.on_pulled: Callable[[str], None] | None = None
        """Told each decode leg that came directly (``local``) once its rank has pulled the prompt's KV: the
        prefill worker holding it can free it (over HTTP, as vLLM's NIXL connector notifies the producer)."""

    def kill_rank(self, dp_rank: int) -> list[str]:
        """Chaos: one rank dies. Its requests fail (``rank_lost``), its cache is gone, it takes no more work."""
        self._replace(dp_rank, engine_core(self.core(dp_rank).config, dp_rank=dp_rank))  # an empty, idle stand-in
        if self._defer:
            self.defer_kv_events()
        self.dead_ranks.add(dp_rank)
        lost = self._fail_rank(dp_rank, "rank_lost")
        self._send(RankDown(worker_id=self.worker_id, dp_rank=dp_rank))
        return lost

    def _fail_rank(self, dp_rank: int, reason: str, *, record: bool = False) -> list[str]:
        """End every request running on ``dp_rank`` with ``reason`` (``record``: in its engine record too, which
        a lost rank's keep as aborted); their ids."""
        lost = sorted(rid for rid, rec in self._records.items() if rec.dp_rank == dp_rank)
        for rid in lost:
            rec = self._records.pop(rid)
            self._sent.pop(rid, None)
            self._flushed_at.pop(rid, None)
            self._legs.discard(rid)
            if record:
                rec.failure = reason
            if self.on_end is not None:
                self.on_end(rec, "abort")
            self._reply(RequestFailed(request_id=rid, reason=reason))
        return lost

    def fault(self, core: RankEngine, exc: Exception) -> RankEngine:
        """An engine call of one rank raised: the rank's state is no longer to be trusted (a pass stopped half
        way). Every request on it ends with ``engine_error`` and the exception's type, the rank starts again
        empty (its cache cleared, the router's index told so) and the worker goes on serving; returns the new
        core. Requests are checked at admission (``workers.admission``), so this is the guard for what those
        checks miss, not a path a known bad input takes."""
        rank = core.dp_rank
        log.error("worker %s rank %s: an engine pass failed; its requests end with engine_error and the rank "
                  "restarts empty", self.worker_id, rank, exc_info=exc)
        self.engine_errors += 1
        fresh = engine_core(core.config, dp_rank=rank, timing=core.timer.model, worker_id=self.worker_id)
        fresh.timer.set_slowdown(core.timer.slowdown)
        self._replace(rank, fresh)
        for rid in [rid for rid, r in self._held.items() if r == rank]:  # its held KV went with it
            del self._held[rid]
        self._fail_rank(rank, f"engine_error: {type(exc).__name__}: {str(exc)[:200]}", record=True)
        self.publishers[rank - self.worker.dp_start_rank].publish(KVEventBatch(
            ts=self.clock.now_ns() / NS_PER_S, events=[AllBlocksCleared()], data_parallel_rank=rank))
        self.driver.wake(rank)
        return fresh

    @property
    def cores(self) -> Sequence[RankEngine]:
        """Its ranks' engines in rank order, as the shell sees them (``RankEngine``, whatever the flavour)."""
        return self.worker.cores

    def core(self, dp_rank: int) -> RankEngine:
        """One rank's engine (``InvalidArgument`` for a rank this worker does not serve)."""
        return self.worker.core(dp_rank)

    def _replace(self, dp_rank: int, core: Core) -> None:
        """``core`` takes the place of ``dp_rank``'s engine (a dead rank's stand-in, a faulted rank's restart)."""
        self.worker.cores[dp_rank - self.worker.dp_start_rank] = core

    def _advance(self, t_ns: int) -> list[AdvanceResult]:
        """``MockWorker.advance_to``, rank by rank, each guarded (``fault``): a rank that fails reports nothing."""
        out = []
        for core in list(self.cores):
            try:
                out.append(core.advance_to(t_ns))
            except Exception as exc:  # noqa: BLE001 - one rank's failed pass must not stop the worker
                out.append(self.fault(core, exc).advance_to(t_ns))
        return out

    def next_event_ns(self) -> int | None:
        """``MockWorker.next_event_ns``, rank by rank, each guarded (``fault``)."""
        times = []
        for core in list(self.cores):
            try:
                t = core.next_event_ns()
            except Exception as exc:  # noqa: BLE001 - as in _advance
                t = self.fault(core, exc).next_event_ns()
            if t is not None:
                times.append(t)
        return min(times) if times else None

    def _guarded(self, dp_rank: int, call: Callable[[RankEngine], object]) -> None:
        """``call(core)`` on one rank's core, guarded (``fault``)."""
        core = self.core(dp_rank)
        try:
            call(core)
        except Exception as exc:  # noqa: BLE001 - as in _advance
            self.fault(core, exc)

    def slow_down(self, factor: float) -> None:
        """Chaos: every later forward pass of every rank takes ``factor`` times as long."""
        for core in self.cores:
            core.timer.set_slowdown(factor)
        self.driver.replan()  # re-plan the horizon with the new durations

    async def _register(self) -> None:
        """Wait for the router's answer, registering again when it asks us to retry later (rate limited)."""
        while True:
            await self._answered.wait()
            if self.registered.is_set():
                return
            self._answered = anyio.Event()
            await anyio.sleep(self._retry_after_s)
            self._send(self.register_msg)

    def apply_chaos(self, msg: Chaos) -> str | None:
        """Apply a fault to this worker; returns why it cannot (an unknown or dead rank), or None."""
        rank = msg.dp_rank
        if msg.action in ("kill_rank", "drop_kv_events"):
            first = self.worker.dp_start_rank
            if not first <= rank < first + len(self.publishers) or rank in self.dead_ranks:
                return (f"worker {self.worker_id} has no live rank {rank} (its ranks: {first}.."
                        f"{first + len(self.publishers) - 1}, dead: {sorted(self.dead_ranks) or 'none'})")
        if msg.action == "kill_rank":
            self.kill_rank(rank)
        elif msg.action == "drop_kv_events":
            self.publishers[rank - self.worker.dp_start_rank].drop_next += msg.count
        elif msg.action == "delay_kv_events":
            for pub in self.publishers:
                pub.lag_ns = round(msg.lag_ms * NS_PER_MS)
        else:
            self.slow_down(msg.factor)
        return None

    @property
    def worker_id(self) -> int:
        """The worker's id."""
        return self.worker.worker_id

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Register, then serve until cancelled (``WorkerRejected`` if the router refuses us)."""
        self._send(self.register_msg)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.end.serve, self.on_message)
            with anyio.move_on_after(self.register_timeout_s):
                with anyio.move_on_after(min(self.register_warn_s, self.register_timeout_s)):
                    await self._register()
                if not self._answered.is_set() and not self._retry_after_s:  # not a word from the router yet
                    if self.on_unanswered is not None:
                        self.on_unanswered(self.register_warn_s)
                    else:
                        log.warning("worker %s: no answer from the router after %g s: check its address (and %s); "
                                    "still trying", self.worker_id, self.register_warn_s, "KVEMU_SECRET")
                await self._register()
            if not self.registered.is_set():
                why = ("it kept refusing us with rate_limited" if self._retry_after_s else
                       "no answer from the router; check its address (and KVEMU_SECRET)")
                raise WorkerRejected(f"worker {self.worker_id}: not registered within {self.register_timeout_s} s: {why}")
            task_status.started()
            if self.heartbeat_interval_s is not None:
                tg.start_soon(self._beats.run)
            self.driver.start(tg)

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Refuse new work, let accepted requests finish (up to ``grace_s``), then deregister."""
        self.worker.begin_shutdown()
        self._send(Draining(worker_id=self.worker_id))
        with anyio.move_on_after(grace_s):
            while not self.worker.idle:
                await anyio.sleep(0.01)
        self._send(Deregister(worker_id=self.worker_id))
        self.stopped = True

    # ------------------------------------------------------------------ messages

    def on_message(self, msg: RouterMessage) -> None:
        """Handle one message from the router (the transport's handler)."""
        # (``type(msg) is``: mypy narrows the union on it; messages are exact classes, never subclassed)
        if type(msg) is Dispatch:
            self._on_dispatch(msg)
        elif type(msg) is Abort:
            self.abort(msg.request_id, msg.reason)
        elif type(msg) is ReleaseKv:
            self.release_kv(msg.request_id)
        elif type(msg) is Chaos:
            why = self.apply_chaos(msg)
            if why is not None:
                log.warning("chaos %s refused: %s", msg.action, why)
            if self.on_chaos is not None:
                self.on_chaos(msg, why)
        elif type(msg) is Reregister:  # the router restarted and lost us
            self._send(self.register_msg)
        elif type(msg) is RegisterAck:
            if not msg.accepted:
                if msg.retry_after_s is None:
                    raise WorkerRejected(f"worker {self.worker_id}: registration refused: {msg.reason}")
                # rate limited: retry then (a registered worker is asked again at its next heartbeat)
                self._retry_after_s = min(max(msg.retry_after_s, 0.0), 60.0)
            else:
                self.registered.set()
                self.driver.registered()
            self._answered.set()

    def _on_dispatch(self, msg: Dispatch) -> None:
        why = self._admit(msg)
        self._send(DispatchAck(request_id=msg.request_id, accepted=why is None, reason=why))

    def _admit(self, msg: Dispatch) -> str | None:
        """Put a request on its rank's engine; why it cannot be (None: it runs)."""
        if msg.dp_rank in self.dead_ranks:
            return f"rank_down: rank {msg.dp_rank} is dead"
        if msg.request_id in self._records:
            return f"duplicate_request_id: {msg.request_id!r} is already running on this worker"
        if msg.kv_hold and self.worker_type != "prefill":
            return f"wrong_pool: worker {self.worker_id} is a {self.worker_type} worker; prefill legs go to prefill workers"
        if msg.kv_transfer is not None and self.worker_type != "decode":
            return f"wrong_pool: worker {self.worker_id} is a {self.worker_type} worker; decode legs go to decode workers"
        if msg.kv_hold and msg.request_id in self._held:
            return f"duplicate_request_id: the KV of {msg.request_id!r} is still held on this worker"
        now = self.clock.now_ns()
        self.driver.catch_up()
        req = Request(request_id=msg.request_id, token_ids=msg.tokens, max_tokens=1 if msg.kv_hold else msg.max_tokens,
                      arrival_ns=self._arrival(msg.dp_rank, now), priority=msg.engine_priority,
                      output_token_ids=msg.output_token_ids, kv_hold=msg.kv_hold, kv_transfer=msg.kv_transfer)
        try:
            outcome = self.worker.dispatch(req, msg.dp_rank)
        except Exception as exc:  # noqa: BLE001 - a request the engine's own checks let through and then choked on
            core = self.core(msg.dp_rank)
            if core.has_request(msg.request_id):
                self.fault(core, exc)
            return f"engine_error: {type(exc).__name__}: {str(exc)[:200]}"
        if not outcome.accepted:
            reason = outcome.reason.value if outcome.reason is not None else "rejected"
            return f"{reason}: {outcome.message}"
        self._records[msg.request_id] = outcome.record  # type: ignore[assignment]
        self._sent[msg.request_id] = 0
        if msg.kv_hold:
            self._legs.add(msg.request_id)
        self.driver.settle(msg.dp_rank)
        return None

    def submit_local(self, req: ClientRequest, dp_rank: int,
                     reply: Callable[[TokenBatch | Finished | RequestFailed], None]) -> str | None:
        """Run a request that came to this worker directly (not through the router): its tokens, its end or its
        failure go to ``reply``. Returns why it was refused (nothing runs then), or None."""
        if self.worker.shutting_down:
            return f"shutting_down: worker {self.worker_id} is shutting down"
        if req.request_id in self.local or req.request_id in self._records:  # refused without touching the other
            return f"duplicate_request_id: {req.request_id!r} is already running on this worker"
        self.local[req.request_id] = reply
        why = self._admit(Dispatch(request_id=req.request_id, dp_rank=dp_rank, tokens=req.tokens,
                                   max_tokens=req.max_tokens, output_token_ids=req.output_token_ids,
                                   engine_priority=req.engine_priority, kv_hold=req.kv_hold, kv_transfer=req.kv_transfer))
        if why is not None:
            self.local.pop(req.request_id, None)
        return why

    def _reply(self, msg: TokenBatch | Finished | RequestFailed) -> None:
        """A request's tokens or end: to the router, or to the local client it came from."""
        local = self.local
        if local:
            to = local.get(msg.request_id)
            if to is not None:
                if type(msg) is not TokenBatch:
                    del local[msg.request_id]
                to(msg)
                return
        self._send(msg)

    def abort(self, request_id: str, reason: str = "cancelled") -> bool:
        """Drop a request this worker runs (its client went away): the engine frees its blocks at once and
        nothing more is sent about it. Returns whether it was here."""
        if self.release_kv(request_id):  # a finished prefill leg: its held KV is freed
            return True
        rec = self._records.pop(request_id, None)
        self._legs.discard(request_id)
        if rec is None:
            return False
        self._sent.pop(request_id, None)
        self._flushed_at.pop(request_id, None)
        self.local.pop(request_id, None)
        rank = self.core(rec.dp_rank or 0).dp_rank
        self.driver.catch_up()
        self._guarded(rank, lambda c: c.abort(request_id, reason))
        if self.on_end is not None:
            self.on_end(rec, "abort")
        self.driver.settle(rank)
        return True

    def release_kv(self, request_id: str) -> bool:
        """A decode rank pulled the KV this worker held for a finished prefill leg: free it (at the rank's next
        pass boundary). Returns whether it was held here."""
        rank = self._held.pop(request_id, None)
        if rank is None:
            return False
        self.driver.catch_up()
        self._guarded(rank, lambda c: c.release_kv(request_id))
        self.driver.settle(rank)
        return True

    def _engine_now(self) -> int:
        return max(core.now_ns for core in self.cores)

    def _arrival(self, dp_rank: int, now: int) -> int:
        try:
            core = self.core(dp_rank)
        except Exception:  # noqa: BLE001 - an unknown rank is rejected by dispatch itself
            return now
        return max(now, core.now_ns)

    def _send(self, msg: msgspec.Struct) -> None:
        self._last_sent_ns = self.clock.now_ns()
        self.end.send_nowait(msg)

    def _heartbeat(self) -> int | None:
        """Prove liveness when nothing else did: any message counts, so a busy worker sends none.

        Wakes one ``heartbeat_interval_s`` after the last message sent, so a healthy worker is never silent for
        longer than that (checking on fixed ticks instead let it be silent for almost two intervals, and a router
        whose ``heartbeat_timeout_s`` was under two intervals dropped idle workers); returns that instant."""
        if self.stopped or self.heartbeat_interval_s is None:
            return None
        now = self.clock.now_ns()
        interval = round(self.heartbeat_interval_s * NS_PER_S)
        if now - self._last_sent_ns >= interval:
            self._send(Heartbeat(worker_id=self.worker_id))
        return max(self._last_sent_ns + interval, now + 1)

    # ------------------------------------------------------------------ virtual time

    def sync(self) -> None:
        """Bring the engines to now and publish what they did, then re-arm their next instant (virtual time: on
        wall time they run at now).

        A host that lets the engines publish KV events lazily (``defer_kv_events``) calls it before anything
        reads what those events say."""
        if not self.stopped:
            self.driver.sync()

    def defer_kv_events(self) -> bool:
        """Virtual time: let engines that can pass over passes whose only visible effect is KV events (the
        SGLang flavour's per-pass evictions) do so; the host promises to ``sync`` before reading the index.
        Returns whether any engine here does (only those workers need syncing)."""
        for core in self.cores:
            if core.can_defer_kv_events:
                core.defer_kv_events = True
                self._defer = True
        return self._defer

    def catch_up(self) -> None:
        """Advance every core to now (or to the furthest core's own now), publish what became visible."""
        self._emit_advance(self._advance(max(self.clock.now_ns(), self._engine_now())))

    def say_alive(self) -> None:
        """A heartbeat now, whenever the last message went."""
        self._send(Heartbeat(worker_id=self.worker_id))

    def _emit_advance(self, results: list[AdvanceResult]) -> None:
        reply = self._reply
        for core, res in zip(self.cores, results):
            pub = self.publishers[core.dp_rank - self.worker.dp_start_rank]
            for pe in res.events:
                pub.publish(pe)
            for rid, t in res.first_tokens:
                if self._sent.get(rid) == 0 and rid not in self._legs:
                    self._sent[rid] = 1
                    reply(TokenBatch(request_id=rid, times_ns=[t]))
            for rid, reserved, activated in res.pulled:
                self._pulled(rid, reserved, activated)
            for rec in res.completed:
                if rec.request_id in self._records:
                    self._finish(rec)

    def _pulled(self, rid: str, reserved_ns: int, activated_ns: int) -> None:
        """A decode rank took a request's KV: the router is told, or for a local request ``on_pulled``."""
        if rid in self.local:
            if self.on_pulled is not None:
                self.on_pulled(rid)
        elif rid in self._records:
            self._send(KvPulled(request_id=rid, reserved_ns=reserved_ns, activated_ns=activated_ns))

    def _finish(self, rec: EngineRecord) -> None:
        rid = rec.request_id
        self._flushed_at.pop(rid, None)
        sent = self._sent.pop(rid, 0)
        self._records.pop(rid, None)
        transfer = None
        if rid in self._legs:  # a prefill leg: its KV stays here until the decode rank pulled it
            self._legs.discard(rid)
            self._held[rid] = rank = rec.dp_rank or 0
            transfer = msgspec.structs.replace(self._transfer, source_dp_rank=rank)
        if self.on_end is not None:
            self.on_end(rec, "length")
        # the engine is done with its facts: the router's record embeds them as they are
        self._reply(Finished(request_id=rid, times_ns=rec.token_times_ns[sent:], engine=rec.engine,
                             dp_rank=rec.dp_rank or 0, kv_transfer=transfer))

    # ------------------------------------------------------------------ wall time

    def flush_interval_ns(self) -> int:
        """How long a live request's tokens are coalesced now: ``stream_interval_ns``, or longer, as long as it
        takes to send ``MAX_BATCHES_PER_S`` for each running request."""
        return max(self.stream_interval_ns, len(self._records) * NS_PER_S // MAX_BATCHES_PER_S)

    def emit_step(self, core: RankEngine, res: StepResult) -> None:
        """Wall time: publish one forward pass's KV events, stream its tokens (coalesced), finish what it ended."""
        batch = res.kv_batch
        if batch is not None:
            self.publishers[core.dp_rank - self.worker.dp_start_rank].publish(batch)
        done = {rec.request_id for rec in res.completed}
        send = self._reply
        now = res.end_ns
        interval = self.flush_interval_ns()
        flushed = self._flushed_at
        for rid, reserved, activated in res.pulled:
            self._pulled(rid, reserved, activated)
        for rid in res.tokens:
            if rid in done or rid in self._legs:
                continue
            rec = self._records.get(rid)
            if rec is None:
                continue
            sent = self._sent.get(rid, 0)
            # the first token goes at once; later ones are coalesced (zero-length passes come in bursts)
            times = rec.token_times_ns
            if len(times) > sent and (sent == 0 or now - flushed.get(rid, 0) >= interval):
                send(TokenBatch(request_id=rid, times_ns=times[sent:]))
                if self.on_sent_times is not None:
                    self.on_sent_times(rec, times)
                del times[:-1]  # the router has them: keep the last (the next gap starts there)
                self._sent[rid] = 1
                flushed[rid] = now
        for rec in res.completed:
            if rec.request_id in self._records:  # not aborted while its pass ran
                self._finish(rec)
