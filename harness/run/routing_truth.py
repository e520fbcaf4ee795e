"""The routing truth's probe: at each routing decision, what the eligible ranks' engines really hold of the prompt.

A host that runs the engines in its own process (virtual time, or live in one process) can read them at the very
instant the router decides; the router's lifecycle asks (``Lifecycle.truth``) and records on the request the
chosen rank's cached blocks, the most any eligible rank had, and where the lost blocks were, in the classes of
Dynamo's locality-metrics proposal (``lib/kv-router/src/scheduling/DESIGN-kv-locality-metrics.md``):

* ``peer``: another DP rank of the chosen worker had them;
* ``cache_owner``: the rank the request's session last ran on had them;
* ``shared``: some other rank had them (a prefix shared across sessions).

Regret is then ``lost / (novel + lost)`` with ``lost = best - chosen`` and ``novel = prompt blocks - best``.
Reading an engine changes nothing in it (``RankCore.cached_prefix_blocks``). The classification (``RegretJudge``)
is shared with the event-derived truth of separate processes (``harness.procs.truth_oracle``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from workers.engine_base import RankCore

__all__ = ["RoutingTruth", "RegretJudge", "MAX_SESSIONS"]

MAX_SESSIONS = 1 << 16
"""Sessions whose last rank is remembered (the oldest is forgotten first)."""

RankKey = tuple[int, int]


class RegretJudge:
    """Classifies a decision's lost blocks from what each rank held, remembering the rank each session last ran on
    (the ``cache_owner`` class); told the decisions in order."""

    def __init__(self) -> None:
        self._last: dict[str, RankKey] = {}

    def __call__(self, have: Mapping[RankKey, int], ranks: tuple[RankKey, ...], chosen: RankKey, mine: int,
                 session: str | None) -> tuple[int, int, str | None]:
        """(``mine``, the best of ``mine`` and the eligible ranks' ``have``, where the lost blocks were) for a
        decision that chose ``chosen``; then ``session`` last ran on ``chosen``."""
        best = max(mine, max((have[key] for key in ranks), default=0))
        source: str | None = None
        if best > mine:
            holders = [key for key in ranks if have[key] == best]
            if any(key[0] == chosen[0] for key in holders):
                source = "peer"
            elif session is not None and self._last.get(session) in holders:
                source = "cache_owner"
            else:
                source = "shared"
        if session is not None:
            last = self._last
            last.pop(session, None)  # (re-inserted last: the dict's order is the sessions' recency)
            last[session] = chosen
            if len(last) > MAX_SESSIONS:
                del last[next(iter(last))]
        return mine, best, source


class RoutingTruth:
    """``Lifecycle.truth`` over engines the host can read: ``core(worker_id, dp_rank)`` (None: gone)."""

    def __init__(self, core: Callable[[int, int], RankCore | None]) -> None:
        self._core = core
        self._judge = RegretJudge()

    def __call__(self, hashes: list[int], ranks: tuple[RankKey, ...], chosen: RankKey,
                 session: str | None) -> tuple[int, int, str | None]:
        rank_core = self._core
        have: dict[RankKey, int] = {}
        for key in (*ranks, chosen) if chosen not in ranks else ranks:
            core = rank_core(*key)
            have[key] = core.cached_prefix_blocks(hashes) if core is not None else 0
        return self._judge(have, ranks, chosen, have[chosen], session)
