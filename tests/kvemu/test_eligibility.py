"""Eligibility: check order, pins, affinity narrowing under the final availability, typed errors."""

import pytest

from kvemu.config import BusyThresholds
from kvemu.eligibility import AffinityTarget, EligibilityBuilder, Ineligible
from kvemu.errors import (
    AllEligibleWorkersOverloaded,
    InvalidArgument,
    NoEndpoints,
    PinnedWorkerNotAllowed,
    PinnedWorkerOverloaded,
    SchedulerError,
)
from kvemu.registry import WorkerRegistry, WorkerSpec
from kvemu.routing_core import RoutingCore


def registry() -> WorkerRegistry:
    return WorkerRegistry(
        [
            WorkerSpec(worker_id=1, dp_size=2),
            WorkerSpec(worker_id=2, dp_size=2, taints=frozenset({"gpu:h100"})),
            WorkerSpec(worker_id=3, dp_start=4, dp_size=2),
        ]
    )


def test_all_ranks_of_all_workers_are_candidates_by_default():
    c = EligibilityBuilder(registry()).build()
    assert c.ranks == ((1, 0), (1, 1), (2, 0), (2, 1), (3, 4), (3, 5))
    assert c.pinned is None and c.affinity_ranks == ()
    assert c.for_default_selector() == c.ranks


def test_check_order_first_failure_wins():
    reg = registry()
    reg.fence(2)
    b = EligibilityBuilder(reg, overloaded=lambda k: True).allow([2, 3]).require_taints({"gpu:h100"})
    assert b.check((1, 0)) is Ineligible.WORKER_NOT_ALLOWED  # allow-list before everything
    assert b.check((2, 0)) is Ineligible.WORKER_FENCED  # fenced before taints/overload
    assert b.check((3, 0)) is Ineligible.DP_RANK_UNAVAILABLE  # rank 0 outside [4, 6)
    assert b.check((3, 4)) is Ineligible.CONSTRAINTS_UNSATISFIED  # taints before overload
    b.allow([3, 9])
    assert b.check((9, 0)) is Ineligible.WORKER_UNAVAILABLE  # unknown worker
    b.require_taints(())
    assert b.check((3, 4)) is Ineligible.WORKER_OVERLOADED


@pytest.mark.parametrize("order", ["availability_first", "affinity_first"])
def test_affinity_narrows_only_under_final_availability(order):
    reg = registry()

    def build(steps):
        b = EligibilityBuilder(reg)
        for step in steps:
            step(b)
        return b.build()

    down = lambda b: b.set_available(2, False)  # noqa: E731
    target = lambda b: b.affinity(AffinityTarget(2, 1))  # noqa: E731
    steps = [down, target] if order == "availability_first" else [target, down]
    c = build(steps)
    assert c.affinity_ranks == ()  # target unavailable: ignored, not exclusive
    assert (2, 0) not in c.ranks and (2, 1) not in c.ranks
    assert c.for_default_selector() == ((1, 0), (1, 1), (3, 4), (3, 5))
    # restoring availability re-activates the target, whatever the order
    up = lambda b: b.set_available(2, True)  # noqa: E731
    c2 = build(steps + [up])
    assert c2.affinity_ranks == ((2, 1),)
    assert c2.for_default_selector() == ((2, 1),)


def test_availability_list_and_rank_marks():
    b = EligibilityBuilder(registry()).available([1, (3, 5)])
    assert b.build().ranks == ((1, 0), (1, 1), (3, 5))
    b.set_available(1, False, dp_rank=1).set_available(2, True)
    assert b.build().ranks == ((1, 0), (2, 0), (2, 1), (3, 5))


def test_worker_only_target_keeps_all_its_eligible_ranks():
    c = EligibilityBuilder(registry()).affinity((1, None)).build()
    assert c.affinity_ranks == ((1, 0), (1, 1))


def test_pin_outside_allow_list_is_rejected():
    with pytest.raises(PinnedWorkerNotAllowed, match="pinned worker 2 .*allow-list"):
        EligibilityBuilder(registry()).allow([1]).pin(2, 0).build()


def test_pin_overloaded():
    with pytest.raises(PinnedWorkerOverloaded, match="pinned worker 1 rank 0"):
        EligibilityBuilder(registry(), overloaded=lambda k: k == (1, 0)).pin(1, 0).build()
    # a worker-level pin falls back to its ranks that are not overloaded
    c = EligibilityBuilder(registry(), overloaded=lambda k: k == (1, 0)).pin(1).build()
    assert c.ranks == ((1, 1),)


@pytest.mark.parametrize(
    "pin, match",
    [((7, 0), "pinned worker 7 rank 0 is not eligible: worker_unavailable"), ((3, 0), "valid ranks 4..5")],
)
def test_pin_unknown_or_out_of_range_is_no_endpoints(pin, match):
    with pytest.raises(NoEndpoints, match=match):
        EligibilityBuilder(registry()).pin(*pin).build()


def test_fenced_pin_is_never_eligible():
    reg = registry()
    reg.fence(1)
    with pytest.raises(NoEndpoints, match="worker_fenced"):
        EligibilityBuilder(reg).pin(1, 0).build()


def test_conflicting_pin_and_affinity_are_rejected_and_matching_accepted():
    with pytest.raises(PinnedWorkerNotAllowed, match="pin worker 1 rank 0 disagrees with the affinity target worker 2") as e:
        EligibilityBuilder(registry()).pin(1, 0).affinity((2, 0)).build()
    assert (e.value.worker_id, e.value.dp_rank, e.value.affinity_target) == (1, 0, AffinityTarget(2, 0))
    assert isinstance(e.value, SchedulerError)  # a host catching the scheduler's errors gets it
    with pytest.raises(PinnedWorkerNotAllowed, match="rank 1"):
        EligibilityBuilder(registry()).pin(1, 0).affinity((1, 1)).build()
    c = EligibilityBuilder(registry()).pin(1, 0).affinity((1, None)).build()
    assert c.ranks == ((1, 0),) and c.pinned == AffinityTarget(1, 0) and c.affinity_ranks == ((1, 0),)


def test_empty_candidates_errors_name_the_reason():
    with pytest.raises(NoEndpoints, match="no workers are registered"):
        EligibilityBuilder(WorkerRegistry()).build()
    with pytest.raises(NoEndpoints, match="1/0: worker_not_allowed"):
        EligibilityBuilder(registry()).allow([42]).build()
    with pytest.raises(AllEligibleWorkersOverloaded, match="busy threshold"):
        EligibilityBuilder(registry(), overloaded=lambda k: True).build()


def test_dp_rank_without_worker_is_invalid():
    with pytest.raises(InvalidArgument, match="dp_rank 1 was pinned without a worker_id"):
        EligibilityBuilder(registry()).pin(None, 1)


def test_core_busy_thresholds_drive_overload():
    core = RoutingCore(block_size=16, busy=BusyThresholds(active_prefill_tokens=100))
    core.add_worker(WorkerSpec(worker_id=1))
    core.add_worker(WorkerSpec(worker_id=2, max_num_batched_tokens=1000))
    core.load.add("r1", (1, 0), [], 101)
    assert core.eligibility().build().ranks == ((2, 0),)
    core.load.add("r2", (2, 0), [], 101)
    with pytest.raises(AllEligibleWorkersOverloaded):
        core.eligibility().build()
    core.load.mark_prefill_completed("r1")
    assert core.eligibility().build().ranks == ((1, 0),)
    frac = RoutingCore(block_size=16, busy=BusyThresholds(active_prefill_tokens_frac=0.5))
    frac.add_worker(WorkerSpec(worker_id=2, max_num_batched_tokens=1000))
    frac.load.add("r", (2, 0), [], 501)
    with pytest.raises(AllEligibleWorkersOverloaded):
        frac.eligibility().build()


def test_pin_disagreeing_with_an_ineligible_affinity_target_is_routed_to_the_pin():
    """Dynamo attaches the affinity target only when it is eligible; an ineligible one cannot veto a pin."""
    c = EligibilityBuilder(registry()).set_available(2, False).pin(1, 0).affinity((2, 0)).build()
    assert c.ranks == ((1, 0),) and c.affinity_ranks == ()
    # the allow-list verdict comes first, as in Dynamo's check order
    with pytest.raises(PinnedWorkerNotAllowed, match="not in the request's allow-list") as e:
        EligibilityBuilder(registry()).allow([2]).pin(1, 0).affinity((2, 0)).build()
    assert (e.value.worker_id, e.value.affinity_target) == (1, None)


def test_scheduler_errors_carry_the_rank_and_reason_they_name():
    with pytest.raises(NoEndpoints) as e:
        EligibilityBuilder(registry()).pin(3, 0).build()
    assert (e.value.worker_id, e.value.dp_rank, e.value.reason) == (3, 0, "dp_rank_unavailable")
    assert (e.value.dp_start, e.value.dp_end) == (4, 6)  # end exclusive, as Dynamo's DpRankUnavailable
    with pytest.raises(NoEndpoints) as e:
        EligibilityBuilder(registry()).pin(7, 1).build()
    assert (e.value.worker_id, e.value.dp_rank, e.value.reason, e.value.dp_start) == (7, 1, "worker_unavailable", None)
    with pytest.raises(PinnedWorkerOverloaded) as e:
        EligibilityBuilder(registry(), overloaded=lambda k: True).pin(2, 1).build()
    assert (e.value.worker_id, e.value.dp_rank) == (2, 1)
    with pytest.raises(PinnedWorkerNotAllowed) as e:
        EligibilityBuilder(registry()).allow([2]).pin(1).build()
    assert (e.value.worker_id, e.value.dp_rank) == (1, None)
    with pytest.raises(AllEligibleWorkersOverloaded) as e:
        EligibilityBuilder(registry(), overloaded=lambda k: k[0] != 2).allow([1, 3]).build()
    assert e.value.ranks == ((1, 0), (1, 1), (3, 4), (3, 5))
    with pytest.raises(NoEndpoints) as e:
        EligibilityBuilder(WorkerRegistry()).build()
    assert e.value.reason == "no_workers" and e.value.worker_id is None
    with pytest.raises(InvalidArgument) as e:
        EligibilityBuilder(registry()).pin(None, 1)
    assert (e.value.field, e.value.dp_rank) == ("dp_rank", 1)
