"""The routing truth of separate processes (``run.event_truth``): the load generator's own view of every rank's
cache, from the workers' KV events.

With the engines in other processes nobody can read them at the routing decision (``harness.run.routing_truth``), so
the load generator, which writes the report, follows every worker's KV-event publisher itself (the endpoints the
router's ``Stats.publishers`` lists) into a prefix index of its own, keyed by (worker, rank), with the router's
own intake (``KvIngest`` into a ``RoutingCore``: the same ordering, gap replays, hashing and hybrid-group rules).

**When it looks.** The load generator learns which rank a request went to only from its record, when the request
has ended, by which time the request's own blocks are cached there. So the oracle reads every registered rank's
cached prefix of the prompt at the last instant it knows the request is not routed yet: when it sends it (after
applying whatever events have arrived). When the record comes back it takes the chosen rank's figure and the best,
and classes the lost blocks as the in-process probe does (``RegretJudge``). Between the send and the decision
lie the hop to the router and any wait in its queue.

**What it is not.** The oracle's view is what the workers published, as it arrived: it has the events' own delay
and none of the faults chaos applies to a router's feed (``drop_kv_events``, ``delay_kv_events``). The report says
so (``kvemu.routing.regret.truth``: ``kv_events``).
"""

from __future__ import annotations

from kvemu.config import RouterConfig
from kvemu.errors import KvemuError
from kvemu.index import WorkerKey
from kvemu.messages import ClientRequest, Register
from kvemu.records import RequestRecord
from kvemu.routing_core import RoutingCore
from kvemu.runtime.kv_ingest import KvIngest
from kvemu.runtime.router import worker_spec

from harness.run.routing_truth import RegretJudge

__all__ = ["TruthOracle", "TRUTH_SOURCE", "FEED_KEYS"]

TRUTH_SOURCE = "kv_events"
"""``kvemu.routing.regret.truth`` of a run whose truth is the oracle's (absent: the engines were read)."""
FEED_KEYS = ("batches", "gaps", "replays", "replayed_batches", "lost_batches")
"""The oracle's feed counters the report gives (``kvemu.routing.regret.truth_feed``)."""


class TruthOracle:
    """Every registered rank's cache as its KV events tell it; judges each request's routing from its record."""

    def __init__(self, block_size: int, *, max_ranks: int | None = None) -> None:
        self.core = RoutingCore(block_size=block_size, config=RouterConfig(use_kv_events=True))
        self.kv = KvIngest(self.core, zmq=True, max_ranks=max_ranks)
        self._judge = RegretJudge()
        self._seen: dict[int, set[int]] = {}  # per router replica: the workers its last view listed
        self._pending: dict[str, tuple[dict[WorkerKey, int], tuple[WorkerKey, ...]]] = {}
        """Per request sent and not judged: each rank's cached prefix blocks at the send, and the ranks then."""
        self.judged = 0

    # ------------------------------------------------------------------ workers

    def learn(self, publishers: list[Register], replica: int = 0) -> None:
        """A router replica's current registrations: subscribe to new workers, and forget a worker no replica
        lists any more (it left; its cache went with it)."""
        core = self.core
        for msg in publishers:
            if msg.worker_id not in core.registry and msg.block_size == core.block_size:
                core.add_worker(worker_spec(msg))
                self.kv.add_worker(msg)
        self._seen[replica] = {m.worker_id for m in publishers}
        listed = set().union(*self._seen.values())
        for wid in [spec.worker_id for spec in core.registry.specs() if spec.worker_id not in listed]:
            self.kv.remove_worker(wid)
            core.remove_worker(wid)

    def ranks(self) -> tuple[WorkerKey, ...]:
        """The ranks the oracle follows, in (worker, rank) order."""
        return self.core.rank_keys()

    # ------------------------------------------------------------------ requests

    def sent(self, req: ClientRequest) -> None:
        """``req`` leaves for the router: read every rank's cached prefix of its prompt now."""
        if self.kv.subscriber is not None:
            self.kv.subscriber.poll(0)  # (what has arrived counts)
        try:
            prepared = self.core.prepare(req.tokens, lora_name=req.lora_name)
        except KvemuError:  # (an empty prompt: the router fails it as invalid, there is nothing to judge)
            return
        self._pending[req.request_id] = (self.core.overlaps(prepared), self.ranks())

    def judge(self, record: RequestRecord) -> None:
        """A request's record came back: fill its ``truth_*`` and ``regret_source`` (a routed request sent
        through ``sent`` only; the first record for a request wins)."""
        seen = self._pending.pop(record.request_id, None)
        if seen is None or record.worker_id is None or record.dp_rank is None or record.routed_ns is None:
            return
        have, ranks = seen
        chosen = (record.worker_id, record.dp_rank)
        held = {key: have.get(key, 0) for key in ranks}
        record.truth_overlap_blocks, record.truth_best_overlap_blocks, record.regret_source = self._judge(
            held, ranks, chosen, have.get(chosen, 0), record.session_id)
        self.judged += 1

    def feed(self) -> dict[str, int]:
        """The oracle's own KV feed over every worker it followed: batches, gaps, replays, replayed and lost
        batches (a lost batch leaves its view, and so the truth, short of what the workers hold)."""
        out = dict.fromkeys(FEED_KEYS, 0)
        for stats in self.kv.stats.values():
            counts = stats.as_dict()
            for k in FEED_KEYS:
                out[k] += counts.get(k, 0)
        return out

    def forget(self, request_id: str) -> None:
        """A request that will not be judged (failed without an answer)."""
        self._pending.pop(request_id, None)

    async def run(self) -> None:
        """Apply the KV events as they arrive until cancelled, without blocking the loop (``KvIngest.run``)."""
        await self.kv.run()

    def close(self) -> None:
        if self.kv.subscriber is not None:
            self.kv.subscriber.close()
