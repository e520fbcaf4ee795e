"""The routing truth's probe: the chosen rank's cached prefix, the best, and where the lost blocks were."""

from __future__ import annotations

from harness.run.routing_truth import MAX_SESSIONS, RoutingTruth


class _Core:
    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.asked = 0

    def cached_prefix_blocks(self, hashes: list[int]) -> int:
        self.asked += 1
        return min(self.blocks, len(hashes))


def _truth(held: dict[tuple[int, int], int]) -> tuple[RoutingTruth, dict[tuple[int, int], _Core]]:
    cores = {key: _Core(n) for key, n in held.items()}
    return RoutingTruth(lambda w, r: cores.get((w, r))), cores  # type: ignore[arg-type,return-value]


H = list(range(10))


def test_no_loss_when_the_chosen_rank_has_the_most():
    truth, _ = _truth({(0, 0): 4, (1, 0): 4, (2, 0): 1})
    assert truth(H, ((0, 0), (1, 0), (2, 0)), (1, 0), "s") == (4, 4, None)


def test_a_peer_rank_of_the_chosen_worker_comes_first():
    truth, _ = _truth({(0, 0): 1, (0, 1): 6, (1, 0): 6})
    assert truth(H, ((0, 0), (0, 1), (1, 0)), (0, 0), None) == (1, 6, "peer")


def test_the_sessions_last_rank_is_the_cache_owner_else_shared():
    truth, _ = _truth({(0, 0): 5, (1, 0): 0, (2, 0): 5})
    ranks = ((0, 0), (1, 0), (2, 0))
    assert truth(H, ranks, (0, 0), "s") == (5, 5, None)  # the session's first turn ran on (0, 0)
    assert truth(H, ranks, (1, 0), "s") == (0, 5, "cache_owner")  # its next turn went elsewhere
    assert truth(H, ranks, (2, 0), "t") == (5, 5, None)
    assert truth(H, ranks, (1, 0), "u") == (0, 5, "shared")  # a new session: someone else's prefix


def test_a_gone_rank_holds_nothing_and_the_chosen_rank_is_read_even_if_not_listed():
    truth, cores = _truth({(3, 0): 2})
    assert truth(H, ((0, 0), (3, 0)), (3, 0), None) == (2, 2, None)
    assert truth(H, ((0, 0),), (3, 0), None) == (2, 2, None) and cores[(3, 0)].asked == 2


def test_sessions_remembered_are_bounded():
    truth, _ = _truth({(0, 0): 1})
    for i in range(MAX_SESSIONS + 5):
        truth(H, ((0, 0),), (0, 0), f"s{i}")
    last = truth._judge._last  # (the judge remembers them)
    assert len(last) == MAX_SESSIONS and "s0" not in last and f"s{MAX_SESSIONS + 4}" in last


def test_the_cluster_gives_the_probe_each_running_ranks_engine_and_none_for_a_gone_one():
    """``Cluster.core``, what the probe reads: the engine of a running rank, None for a gone worker or a dead
    rank, and the worker's own refusal for a rank it does not have."""
    from types import SimpleNamespace

    import pytest

    from harness.run.cluster import Cluster
    from harness.scenario import default_scenario_text, parse_scenario
    from kvemu.clock import ManualClock
    from kvemu.errors import InvalidArgument
    from kvemu.hooks import Hooks
    from workers.config import EngineConfig
    from workers.mock_worker import MockWorker

    cluster = Cluster(parse_scenario(default_scenario_text()), ManualClock(), Hooks())
    worker = MockWorker(EngineConfig(dp_size=2, num_gpu_blocks=64, block_size=16), worker_id=5, dp_start_rank=2)
    cluster.workers[5] = SimpleNamespace(worker=worker, dead_ranks={3})  # type: ignore[assignment]
    assert cluster.core(5, 2) is worker.cores[0]
    assert cluster.core(5, 3) is None and cluster.core(6, 2) is None
    for rank in (1, 4):
        with pytest.raises(InvalidArgument, match=f"dp_rank {rank} does not exist on worker 5"):
            cluster.core(5, rank)
