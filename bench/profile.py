"""Where the time of a virtual-time replay goes: self time per layer of the stack, under cProfile.

Runs ``examples/mooncake-3600s.yaml`` in kvemu's virtual mode (``router.policy`` kv or round_robin, the
first N requests: ``run.max_requests``) twice in this process: first without a profiler, for the wall
time and the simulated requests per wall second (it also warms the imports), then under ``cProfile``
(deterministic: every Python call is counted, which makes the run several times slower). Each function's
self time (``tottime``: time in its own code, not in what it calls) goes to a layer chosen by its file
(``LAYERS``, first match wins, an ordered table at the top of this module). C functions have no file:
those named in ``BUILTIN_LAYERS`` (xxhash, ``struct`` packing, msgspec, heapq, the asyncio C helpers) go
to that layer, every other one to ``builtins (C)``, which is then split again by the layer of its callers
(cProfile records the self time of a C function per caller).

Prints one figure per line, ``figure name: value unit``: ``wall time``, ``simulated requests`` (per wall
second, unprofiled), ``requests completed``, ``profiled time`` (wall time of the profiled run) and
``profiled self time`` (the sum of all self times: the 100 %), then ``self time LAYER: x %`` for every
layer, largest first (they sum to 100 %), ``builtins (C) called from LAYER: x %`` (the ``builtins (C)``
share by calling layer), then ``# top K functions by self time`` with one ``# file:line function
tottime ncalls (layer)`` line each, and the counts per completed request: ``event loop iterations``
(calls of ``_run_once``), ``callbacks`` (``asyncio.events.Handle._run`` and the virtual loop's bare timers) and
``python function calls``;
``n/a`` when the profile has no such function. Shares are of profiled time, which inflates layers made of
many small Python calls relative to C-heavy ones; compare runs of the same kind with each other.
``--out FILE`` also saves the raw stats (``python -m pstats FILE``). The exit status is 0 when both runs
completed every request, 1 otherwise, 2 without a trace.

Run: python -m bench.profile [--quick] [--policy kv|round_robin] [--requests N] [--trace PATH] [--top K]
[--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import sysconfig
import time
from collections import defaultdict
from pathlib import Path, PurePath
from typing import Any

from bench.replay import incomplete
from bench.replay_inputs import ROOT, SCENARIO, existing_trace
from bench import verdict

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # (layer, file patterns): "dir/" matches any file under a folder of that name, "dir/file.py" that file
    ("event loop", ("asyncio/", "anyio/", "sniffio/", "selectors.py", "kvemu/runtime/loop.py",
                    "kvemu/runtime/wakeup.py", "kvemu/clock.py")),
    ("router actor", ("kvemu/runtime/router.py", "kvemu/lifecycle.py", "kvemu/runtime/transport.py",
                      "kvemu/hooks.py", "kvemu/messages.py")),
    ("routing policy", ("kvemu/routing_core.py", "kvemu/selector.py", "kvemu/eligibility.py", "kvemu/load.py",
                        "kvemu/queue.py", "kvemu/affinity.py", "kvemu/policy.py", "kvemu/approx.py",
                        "kvemu/registry.py")),
    ("prefix index", ("kvemu/index.py", "kvemu/router_events.py")),
    ("KV events", ("kvemu/wire/", "kvemu/runtime/kv_bus.py", "kvemu/runtime/kv_ingest.py", "workers/pass_events.py")),
    ("hashing", ("kvemu/hashing.py", "workers/hash_id_prompt.py")),
    ("engine", ("workers/vllm/engine.py", "workers/vllm/fast_forward.py", "workers/vllm/scheduler.py", "workers/blocks.py",
                "workers/sequence.py", "workers/timing.py", "workers/mock_worker.py", "workers/admission.py", "workers/request.py",
                "workers/config.py")),
    ("worker actor", ("workers/actor/",)),
    ("harness", ("harness/",)),
]
"""Python functions: the layer of the first entry with a pattern matching the function's file."""

BUILTIN_LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # (layer, substrings of pstats' name of a C function, e.g. "<built-in method _heapq.heappop>")
    ("hashing", ("xxhash", "xxh3", "xxh64", "'_struct.Struct'")),
    ("codec", ("msgspec",)),
    ("event loop", ("_heapq.", "'_contextvars.Context'", "_asyncio.", "select.epoll")),
]
"""C functions (no file): the layer of the first entry with a substring in the function's name."""

OTHER = "other"
BUILTINS = "builtins (C)"
ALL_LAYERS = list(dict.fromkeys([name for name, _ in LAYERS + BUILTIN_LAYERS] + [BUILTINS, OTHER]))
"""Every layer once, in table order (the order among equal shares)."""
QUICK_REQUESTS = 300
DEFAULT_REQUESTS = 2000

Func = tuple[str, int, str]
"""pstats' key of a function: (file, first line, name); file ``~`` for C functions."""


def emit(name: str, value: float | None, unit: str = "", digits: int = 1) -> None:
    text = "n/a" if value is None else f"{value:.{digits}f}"
    print(f"{name}: {text} {unit}".rstrip(), flush=True)


def note(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ layers


def is_builtin(func: Func) -> bool:
    return func[0] == "~"


def file_layer(path: str) -> str:
    """The layer of a Python function defined in ``path`` (``other`` when no pattern matches)."""
    p = "/" + PurePath(path).as_posix()
    for layer, patterns in LAYERS:
        for pattern in patterns:
            if (f"/{pattern}" in p) if pattern.endswith("/") else p.endswith(f"/{pattern}"):
                return layer
    return OTHER


def layer_of(func: Func) -> str:
    """The layer ``func``'s self time is charged to."""
    if not is_builtin(func):
        return file_layer(func[0])
    for layer, needles in BUILTIN_LAYERS:
        if any(needle in func[2] for needle in needles):
            return layer
    return BUILTINS


def caller_layer(func: Func) -> str:
    """A caller's layer, for splitting ``builtins (C)``: a C caller (``Context.run``, ...) by its name."""
    layer = layer_of(func)
    return OTHER if layer == BUILTINS else layer


def shares(stats: dict[Func, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """(self seconds per layer, the ``builtins (C)`` seconds per calling layer)."""
    per_layer: dict[str, float] = defaultdict(float)
    builtins_by_caller: dict[str, float] = defaultdict(float)
    for func, (_cc, _nc, tt, _ct, callers) in stats.items():
        layer = layer_of(func)
        per_layer[layer] += tt
        if layer != BUILTINS:
            continue
        # cProfile keeps, per caller, (ncalls, primitive calls, tottime, cumtime) of the call edge
        split = {caller: float(edge[2]) for caller, edge in callers.items() if isinstance(edge, tuple)}
        edge_total = sum(split.values())
        if edge_total <= 0:
            builtins_by_caller[OTHER] += tt
            continue
        for caller, edge_tt in split.items():
            builtins_by_caller[caller_layer(caller)] += tt * edge_tt / edge_total
    return dict(per_layer), dict(builtins_by_caller)


# ------------------------------------------------------------------------------------------ counts


def ncalls_named(stats: dict[Func, Any], name: str, file_suffix: str | None = None) -> int | None:
    """The calls of the function ``name`` (in a file ending with ``file_suffix``); the most called one
    when several match (a subclass's override that calls ``super()`` would otherwise count twice)."""
    found = [nc for (path, _line, fname), (_cc, nc, *_rest) in stats.items()
             if fname == name and (file_suffix is None or PurePath(path).as_posix().endswith(file_suffix))]
    return max(found) if found else None


def per_request(count: int | None, requests: int) -> float | None:
    return None if count is None or requests <= 0 else count / requests


# ------------------------------------------------------------------------------------------ output


_PREFIXES = sorted({str(Path(p)) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                           sysconfig.get_paths()["stdlib"], str(ROOT))}, key=len, reverse=True)


def short_path(path: str) -> str:
    """``path`` relative to the repository, site-packages or the standard library, where it is in one."""
    for prefix in _PREFIXES:
        if path.startswith(prefix + "/"):
            return path[len(prefix) + 1:]
    return path


def describe(func: Func) -> str:
    path, line, name = func
    if is_builtin(func):
        return name.replace("<", "{", 1)[:-1] + "}" if name.startswith("<") and name.endswith(">") else name
    return f"{short_path(path)}:{line} {name}"


# ------------------------------------------------------------------------------------------ the run


def load(policy: str, trace: Path | None, requests: int) -> Any:
    """The example scenario with the same overrides as ``bench.replay_runs.run_kvemu``."""
    from harness.scenario import load_scenario

    overrides = [f"router.policy={policy}", "run.mode=virtual", f"run.max_requests={requests}"]
    if trace is not None:
        overrides.append(f"workload.trace={trace}")
    return load_scenario(SCENARIO, overrides)


def run(scenario: Any, profiler: cProfile.Profile | None) -> tuple[dict[str, Any], float]:
    """One run of ``scenario``, under ``profiler`` if given: (summary, wall seconds of ``run_scenario``)."""
    from harness.report.summary import summarize
    from harness.run.runner import run_scenario

    t0 = time.perf_counter()
    if profiler is None:
        outcome = run_scenario(scenario, None)
    else:
        profiler.enable()
        try:
            outcome = run_scenario(scenario, None)
        finally:
            profiler.disable()
    wall = time.perf_counter() - t0
    return summarize(outcome.data).to_builtins(), wall  # (checked key by key, as the reference's)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", choices=("kv", "round_robin"), default="kv", help="router.policy (default kv)")
    ap.add_argument("--requests", type=int, help=f"replay the first N requests (default {DEFAULT_REQUESTS:,}, "
                                                 f"{QUICK_REQUESTS} with --quick)")
    ap.add_argument("--quick", action="store_true", help=f"replay the first {QUICK_REQUESTS} requests")
    ap.add_argument("--trace", type=Path, help="the Mooncake trace (default: the example's workload.trace)")
    ap.add_argument("--top", type=int, default=15, metavar="K", help="functions listed by self time (default 15)")
    ap.add_argument("--out", type=Path, metavar="FILE", help="also save the raw cProfile stats to FILE")
    args = ap.parse_args(argv)
    requests = args.requests if args.requests is not None else QUICK_REQUESTS if args.quick else DEFAULT_REQUESTS
    if requests <= 0:
        ap.error("--requests must be positive")

    trace = existing_trace("bench.profile", args.trace)
    if trace is None:
        return 2
    note(f"scenario {SCENARIO.relative_to(ROOT)}, trace {trace}, policy {args.policy}, "
         f"first {requests:,} requests")
    scenario = load(args.policy, args.trace, requests)

    note("run without the profiler ...")
    plain, wall = run(scenario, None)
    note("run under cProfile ...")
    profiler = cProfile.Profile()
    profiled, profiled_wall = run(scenario, profiler)
    if args.out is not None:
        profiler.dump_stats(args.out)
        note(f"raw stats saved to {args.out} (python -m pstats {args.out})")

    st = pstats.Stats(profiler)
    stats: dict[Func, Any] = st.stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in stats.values())
    done = int(profiled.get("completed_requests") or 0)
    emit("wall time", wall, "s", 2)
    emit("simulated requests", (plain.get("completed_requests") or 0) / wall if wall > 0 else None, "per s", 0)
    emit("requests completed", done, "", 0)
    emit("profiled time", profiled_wall, "s", 2)
    emit("profiled self time", total, "s", 2)

    per_layer, builtins_by_caller = shares(stats)
    for layer in sorted(ALL_LAYERS, key=lambda name: (-per_layer.get(name, 0.0), ALL_LAYERS.index(name))):
        emit(f"self time {layer}", 100.0 * per_layer.get(layer, 0.0) / total if total else None, "%")
    for layer, secs in sorted(builtins_by_caller.items(), key=lambda kv: -kv[1]):
        emit(f"{BUILTINS} called from {layer}", 100.0 * secs / total if total else None, "%")

    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:max(args.top, 0)]
    print(f"# top {len(top)} functions by self time", flush=True)
    for func, (_cc, nc, tt, _ct, _callers) in top:
        print(f"# {describe(func)}  {tt:.3f} s  {nc} calls  ({layer_of(func)})", flush=True)

    emit("event loop iterations per request", per_request(ncalls_named(stats, "_run_once"), done))
    handles = ncalls_named(stats, "_run", "asyncio/events.py")
    bare = ncalls_named(stats, "_run", "kvemu/runtime/loop.py")  # VirtualTimer: the actors' wake-ups
    emit("callbacks per request", per_request(None if handles is None else handles + (bare or 0), done))
    emit("python function calls per request",
         per_request(sum(nc for func, (_cc, nc, *_r) in stats.items() if not is_builtin(func)), done), "", 0)

    problems = [p for label, summary in (("unprofiled run", plain), ("profiled run", profiled))
                if (p := incomplete(f"{args.policy} {label}", summary))]
    return verdict("profile", problems)


if __name__ == "__main__":
    sys.exit(main())
