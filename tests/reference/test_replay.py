"""Replay fidelity: kvemu's virtual replay of a Mooncake slice against Dynamo's offline replay (1.6.1).

Both sides replay the first ``ROWS`` rows of the one-hour Mooncake conversation trace with the engine of
``examples/mooncake-3600s.yaml`` (Dynamo mocker defaults, ``trace_block_size`` 512): kvemu through
``harness.run.runner.run_scenario``, the reference through ``dynamo._core.run_mocker_trace_replay`` in
offline mode, as ``python -m bench.replay`` does. Each figure (mean/p50/p99 TTFT, mean ITL, mean E2E,
prefix-cache reuse ratio) must be within ``TOLERANCE`` (2 %) of the reference's.

Which cluster, and why (measured on this slice with ai-dynamo-runtime 1.6.1):

* **Round robin on 16 workers** (the example): the reference is deterministic; every figure is compared.
* **KV routing on 16 workers**: the reference is *not* deterministic. Its selector breaks exact cost
  ties uniformly at random from an unseeded generator (spec §6.4); with 16 mostly idle workers ties are
  frequent, and no knob seeds the draw or removes the ties. Over 80 runs of this slice its prefix-cache
  reuse ranged 0.0625-0.0785 (about ±11 %), p50 TTFT 169.1-178.1 ms, mean TTFT 281.9-287.1 ms: one run
  cannot hold those to 2 %. (kvemu's own tie-breaks are seeded; the means of 20 kvemu seeds were within
  0.8 % of the means of 40 reference runs on every figure, on this slice and on the first 1,000 rows.)
  p99 TTFT (the same in every run), mean ITL (range 0.5 %) and mean E2E (range 0.5 %) do not depend
  on the ties, and are compared here.
* **KV routing on 2 workers**: under the sustained load two workers carry, no asymmetric tie arises (the
  first request's tie is between two identical idle workers and only relabels them): 10 runs gave
  identical figures, and per-request placements were identical up to that relabelling. Every figure is
  compared, so this is where the routing decisions (reuse, TTFT) are held to the reference's. Two runs
  of the reference must agree exactly, or the test says the premise broke.

* **TRT-LLM flavour, round robin on 16 workers** (``backend: trtllm``, block size 32): deterministic too;
  every figure is compared.

300 rows are the first 102 s of the trace (about 3 requests/s of ~12k-token prompts that share a
512-token system prefix and multi-turn histories): enough for KV routing to matter (on 2 workers it
lowers the reference's mean TTFT from 1,069 to 953 ms and p99 from 4,157 to 2,766 ms) while the whole
module takes about 8 s on 2 cores. The trace is read where the example points (``workload.trace``);
without it the tests skip (fail under ``KVEMU_REQUIRE_REFERENCE=1``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.reference

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "examples" / "mooncake-3600s.yaml"
ROWS = 300
TOLERANCE = 0.02
TRACE_BLOCK_SIZE = 512

FIGURES = {  # label: summary key (the same key on both sides)
    "mean ttft": "mean_ttft_ms",
    "p50 ttft": "median_ttft_ms",
    "p99 ttft": "p99_ttft_ms",
    "mean itl": "mean_itl_ms",
    "mean e2e": "mean_e2e_latency_ms",
    "prefix-cache reuse ratio": "prefix_cache_reused_ratio",
}
ALL = tuple(FIGURES)
TIE_INSENSITIVE = ("p99 ttft", "mean itl", "mean e2e")

# (kvemu router.policy, workers, figures compared, whether the reference is deterministic there, engine knobs)
CASES = {
    "round_robin-16": ("round_robin", 16, ALL, True, {}),
    "kv-16": ("kv", 16, TIE_INSENSITIVE, False, {}),
    "kv-2": ("kv", 2, ALL, True, {}),
    "trtllm-round_robin-16": ("round_robin", 16, ALL, True, {"backend": "trtllm", "block_size": 32}),
}


@pytest.fixture(scope="module")
def trace_slice(mooncake_trace, tmp_path_factory) -> Path:
    """The first ``ROWS`` rows of the Mooncake trace (or its generated stand-in), copied to a temporary file."""
    from harness.reference import trace_head

    return trace_head(mooncake_trace, ROWS, tmp_path_factory.mktemp("mooncake"))


def run_kvemu(trace: Path, policy: str, workers: int, engine: dict[str, Any]) -> dict[str, Any]:
    from harness.report.summary import summarize
    from harness.run.runner import run_scenario
    from harness.scenario import load_scenario

    scenario = load_scenario(SCENARIO, [f"router.policy={policy}", f"cluster.workers={workers}",
                                        f"workload.trace={trace}", "run.mode=virtual",
                                        *(f"cluster.engine.{k}={v}" for k, v in engine.items())])
    return summarize(run_scenario(scenario, None).data).to_builtins()


def run_reference(core, trace: Path, policy: str, workers: int, engine: dict[str, Any]) -> dict[str, Any]:
    from harness.reference import run_reference as replay

    return replay(core.run_mocker_trace_replay, trace, policy, workers=workers, trace_block_size=TRACE_BLOCK_SIZE,
                  engine=engine)


@pytest.fixture(scope="module")
def replays(dynamo_core, trace_slice):
    """``replays(case)`` -> (kvemu summary, reference summary), each replay run once per module."""
    done: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}

    def get(case: str) -> tuple[dict[str, Any], dict[str, Any]]:
        if case not in done:
            policy, workers, _, deterministic, engine = CASES[case]
            ref = run_reference(dynamo_core, trace_slice, policy, workers, engine)
            if deterministic:  # the premise of comparing with one run
                again = run_reference(dynamo_core, trace_slice, policy, workers, engine)
                changed = {k: (ref[k], again[k]) for k in FIGURES.values() if ref[k] != again[k]}
                assert not changed, f"the reference's {case} replay is not deterministic: {changed}"
            done[case] = (run_kvemu(trace_slice, policy, workers, engine), ref)
        return done[case]

    return get


def _table(ours: dict[str, Any], ref: dict[str, Any]) -> str:
    return "\n".join(f"  {label:26s} kvemu {ours[key]:12.4f}  reference {ref[key]:12.4f}  "
                     f"{100 * (ours[key] / ref[key] - 1):+6.2f} %" for label, key in FIGURES.items())


@pytest.mark.parametrize("case, figure", [(c, f) for c, spec in CASES.items() for f in spec[2]])
def test_figure_within_tolerance_of_the_reference(replays, case, figure):
    ours, ref = replays(case)
    key = FIGURES[figure]
    assert ours["completed_requests"] == ref["completed_requests"] == ROWS
    deviation = ours[key] / ref[key] - 1
    assert abs(deviation) <= TOLERANCE, (
        f"{case} {figure}: kvemu {ours[key]:.4f} vs reference {ref[key]:.4f} ({100 * deviation:+.2f} %, "
        f"tolerance ±{100 * TOLERANCE:.0f} %)\n{_table(ours, ref)}")
