"""Per-request differential replays of tiny hand-written traces: kvemu's virtual replay against Dynamo's.

A case is a list of Mooncake rows (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``)
and engine knobs named as in kvemu's ``cluster.engine`` (the reference receives the same knobs under
``extra_engine_args["engine"]``). Both sides replay the trace on ``workers`` workers with round robin; the
result is one ``(arrival_ms, input_length, output_length, ttft_ms, e2e_ms, reused_tokens)`` per request,
sorted (the reference reports requests in no fixed order; rows of a case differ in arrival or lengths), so a
test can compare them exactly (to 1 µs: kvemu keeps integer nanoseconds).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

Row = dict[str, Any]
Outcome = tuple[float, int, int, float, float, int]
"""(arrival ms, input length, output length, TTFT ms, E2E ms, reused prompt tokens) of one request."""


def write_trace(directory: Path, rows: list[Row], name: str = "trace.jsonl") -> Path:
    path = directory / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def kvemu_run(trace: Path, engine: dict[str, Any], *, workers: int = 1, trace_block_size: int = 512,
              policy: str = "round_robin", pools: dict[str, Any] | None = None, concurrency: int | None = None,
              sla: dict[str, float] | None = None) -> Any:
    """kvemu's ``RunData`` of a virtual replay of ``trace`` (``pools``: a disaggregated cluster)."""
    from harness.run.runner import run_scenario
    from harness.scenario import parse_scenario

    text = json.dumps({
        "name": "differential", "cluster": pools if pools else {"workers": workers, "engine": engine},
        "router": {"policy": policy},
        "workload": {"kind": "trace", "trace": str(trace), "trace_block_size": trace_block_size,
                     "concurrency": concurrency},
        "run": {"mode": "virtual", "seed": 0, "sla": sla},
    })
    return run_scenario(parse_scenario(text), None).data


def kvemu_outcomes(trace: Path, engine: dict[str, Any], *, workers: int = 1, trace_block_size: int = 512,
                   policy: str = "round_robin", pools: dict[str, Any] | None = None,
                   concurrency: int | None = None) -> list[Outcome]:
    """kvemu's per-request outcomes of a virtual replay of ``trace`` (``pools``: a disaggregated cluster)."""
    data = kvemu_run(trace, engine, workers=workers, trace_block_size=trace_block_size, policy=policy, pools=pools,
                     concurrency=concurrency)
    out = []
    for r in data.records:
        assert r.failure is None, f"{r.request_id} failed: {r.failure}"
        out.append((r.arrival_ns / 1e6, r.isl, r.max_tokens, (r.first_token_ns - r.arrival_ns) / 1e6,
                    (r.completion_ns - r.arrival_ns) / 1e6,
                    r.engine.cached_tokens if r.engine.reused_tokens is None else r.engine.reused_tokens))
    return sorted(out)


def reference_run(core: ModuleType, trace: Path, engine: dict[str, Any], *, workers: int = 1,
                  trace_block_size: int = 512, policy: str = "round_robin", pools: dict[str, Any] | None = None,
                  **options: Any) -> Any:
    """The reference's offline replay of ``trace`` with per-request rows (``options``: e.g.
    ``replay_concurrency``, ``sla_ttft_ms``)."""
    from harness.reference import REFERENCE_MODE, reference_engine

    if pools:
        def args(pool: dict[str, Any], kind: str) -> dict[str, Any]:
            return {"engine": {**reference_engine(pool.get("engine", {}), trace.parent), "worker_type": kind},
                    **({"dp_size": pool["dp_size"]} if pool.get("dp_size", 1) != 1 else {})}

        shape: dict[str, Any] = dict(num_prefill_workers=pools["prefill"].get("workers", 1),
                                     num_decode_workers=pools["decode"].get("workers", 1),
                                     prefill_engine_args=args(pools["prefill"], "prefill"),
                                     decode_engine_args=args(pools["decode"], "decode"))
    else:
        shape = dict(extra_engine_args={"engine": reference_engine(engine, trace.parent)}, num_workers=workers)
    return core.run_mocker_trace_replay([str(trace)], **shape, trace_block_size=trace_block_size,
                                        replay_mode="offline", router_mode=REFERENCE_MODE[policy],
                                        capture_per_request=True, **options)


def reference_outcomes(core: ModuleType, trace: Path, engine: dict[str, Any], *, workers: int = 1,
                       trace_block_size: int = 512, policy: str = "round_robin",
                       pools: dict[str, Any] | None = None, **options: Any) -> list[Outcome]:
    """The reference's per-request outcomes of its offline replay of ``trace``."""
    result = reference_run(core, trace, engine, workers=workers, trace_block_size=trace_block_size, policy=policy,
                           pools=pools, **options)
    rows = result["per_request"] if isinstance(result, dict) else result.per_request
    return sorted((r["arrival_time_ms"], r["input_length"], r["requested_output_length"], r["ttft_ms"],
                   r["e2e_latency_ms"], r["reused_input_tokens"] or 0) for r in rows)


def assert_same(ours: list[Outcome], ref: list[Outcome], tol_ms: float = 1e-3, same_reuse: bool = True) -> None:
    """Every request's TTFT and E2E within ``tol_ms`` and the same reuse, with a table on failure."""
    table = "\n".join(f"  at {a[0]:.3f} ms, {a[1]} in / {a[2]} out: kvemu ttft {a[3]:.6f} e2e {a[4]:.6f} reused {a[5]} | "
                      f"reference ttft {b[3]:.6f} e2e {b[4]:.6f} reused {b[5]}" for a, b in zip(ours, ref))
    assert len(ours) == len(ref), f"{len(ours)} vs {len(ref)} requests\n{table}"
    for a, b in zip(ours, ref):
        assert abs(a[0] - b[0]) <= 1e-6 and a[1:3] == b[1:3], f"not the same requests\n{table}"
        assert abs(a[3] - b[3]) <= tol_ms and abs(a[4] - b[4]) <= tol_ms and (a[5] == b[5] or not same_reuse), table
