"""Dynamo's offline trace replay as a comparison point (bench.replay and the fidelity tests use it).

The reference is ``ai-dynamo-runtime`` (1.6.1), an optional dependency: ``replay_entry`` returns None
when it is not installed. Its replay has no row limit, so a slice of a trace is copied to a file first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["REFERENCE_MODE", "replay_entry", "run_reference", "run_reference_disagg", "trace_head",
           "reference_engine"]

REFERENCE_MODE = {"round_robin": "round_robin", "kv": "kv_router"}
"""kvemu's ``router.policy`` → the reference's ``router_mode``."""


def replay_entry() -> tuple[str, Callable[..., Any]] | None:
    """(name, function) of the reference's offline trace replay, or None when it is not installed."""
    try:
        from dynamo.replay.api import run_trace_replay

        return "dynamo.replay.api.run_trace_replay", run_trace_replay
    except ImportError:
        pass
    try:
        from dynamo._core import run_mocker_trace_replay
    except ImportError:
        return None
    return "dynamo._core.run_mocker_trace_replay", run_mocker_trace_replay


def run_reference(replay: Callable[..., Any], trace: Path, policy: str, *, workers: int = 16,
                  trace_block_size: int = 512, engine: dict[str, Any] | None = None,
                  **options: Any) -> dict[str, Any]:
    """The reference's summary of an offline replay of ``trace``.

    ``engine`` holds engine knobs (kvemu's ``cluster.engine`` names, which are the reference's), default
    engine arguments otherwise; ``options`` go to the replay as they are (e.g. ``arrival_speedup_ratio``).
    """
    if engine:
        options["extra_engine_args"] = {"engine": reference_engine(engine, Path(trace).parent)}
    result = replay([str(trace)], num_workers=workers, trace_block_size=trace_block_size, replay_mode="offline",
                    router_mode=REFERENCE_MODE[policy], **options)
    return dict(result.summary if hasattr(result, "summary") else result)


def run_reference_disagg(replay: Callable[..., Any], trace: Path, policy: str, *, prefill: dict[str, Any],
                         decode: dict[str, Any], trace_block_size: int = 512, **options: Any) -> dict[str, Any]:
    """The reference's summary of a disaggregated offline replay: ``prefill`` and ``decode`` are kvemu pool
    sections (``workers``, ``dp_size``, ``engine``)."""
    def args(pool: dict[str, Any], worker_type: str) -> dict[str, Any]:
        engine = reference_engine(pool.get("engine", {}), Path(trace).parent)
        out: dict[str, Any] = {"engine": {**engine, "worker_type": worker_type}}
        if pool.get("dp_size", 1) != 1:
            out["dp_size"] = pool["dp_size"]
        return out

    result = replay([str(trace)], num_prefill_workers=prefill.get("workers", 1),
                    num_decode_workers=decode.get("workers", 1), prefill_engine_args=args(prefill, "prefill"),
                    decode_engine_args=args(decode, "decode"), trace_block_size=trace_block_size,
                    replay_mode="offline", router_mode=REFERENCE_MODE[policy], **options)
    return dict(result.summary if hasattr(result, "summary") else result)


def reference_engine(engine: dict[str, Any], directory: Path | str) -> dict[str, Any]:
    """kvemu's engine knobs as the reference's ``extra_engine_args["engine"]``: the same names, except an
    interpolated timing model, which the reference names ``external``/``dynamo_profile`` and reads from an
    ``.npz`` only (a CSV profile is converted into ``directory``)."""
    out = dict(engine)
    timing = out.get("timing_model")
    if isinstance(timing, dict) and timing.get("type") == "interpolated":
        path = Path(timing["path"])
        if path.suffix.lower() != ".npz":
            from workers.profile import load_profile, save_profile

            npz = Path(directory) / f"{path.stem}.npz"
            save_profile(load_profile(path), npz)
            path = npz
        out["timing_model"] = {"type": "external", "provider": "dynamo_profile", "config": {"path": str(path)}}
    sglang = out.get("sglang")
    if isinstance(sglang, dict) and "prefill_decode_interval" in sglang:  # an engine-level key in the reference
        sglang = out["sglang"] = dict(sglang)
        out["prefill_decode_interval"] = sglang.pop("prefill_decode_interval")
    return out


def trace_head(trace: Path, rows: int, directory: Path | str) -> Path:
    """The first ``rows`` lines of ``trace``, copied to a file in ``directory``."""
    out = Path(directory) / f"first-{rows}.jsonl"
    with trace.open() as src, out.open("w") as dst:
        for i, line in enumerate(src):
            if i >= rows:
                break
            dst.write(line)
    return out
