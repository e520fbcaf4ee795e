"""Workloads as sessions of turns: loaded from a Mooncake trace or generated synthetically.

A ``Session`` starts at an absolute scenario time; each later turn starts ``delay_ns`` after the previous
turn of the same session completed (closed loop), and may spawn sibling sub-agent requests. Everything
random comes from one ``random.Random(seed)``, so a scenario and a seed fix the workload exactly.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Iterator
from array import array
from itertools import repeat
from pathlib import Path
from typing import TextIO, TypeVar

from kvemu.clock import NS_PER_S
from kvemu.errors import InvalidArgument
from harness.workload.traces.mooncake import read_mooncake

from harness.memory_budget import memory_problem
from harness.scenario import (
    MAX_SCENARIO_NS,
    MAX_SCENARIO_S,
    Distribution,
    LanesSpec,
    Scenario,
    ScenarioError,
    SyntheticWorkload,
    TraceWorkload,
    resolve,
)
from harness.workload.trace_sessions import TraceSessions, TraceSessionsBuilder
from harness.workload.traces.formats import detect_format, load_graph
from harness.workload.traces.graph import TraceGraph
from harness.workload.traces.mooncake import mooncake_turns
from harness.workload.traces.rows import MAX_TRACE_ROWS, line_count
from harness.workload.forms import Sessions
from harness.workload.turns import Session, SessionList, Turn, Workload

__all__ = ["Turn", "Session", "load_trace", "synthesize", "build_sessions", "count_requests", "sample"]


PROGRESS_EVERY_ROWS = 250_000
"""On a terminal, reading a trace prints a line on stderr every this many rows (a large trace takes a while)."""
MADE_EVERY_ROWS = 1024
"""A trace's rows are counted for a progress line (``load_trace``'s ``made``) in steps of this many."""


def load_trace(workload: TraceWorkload, path: Path, max_requests: int | None = None, *,
               max_rows: int = MAX_TRACE_ROWS, progress: TextIO | None = None,
               made: Callable[[int], None] | None = None) -> TraceSessions:
    """Mooncake JSONL rows → sessions (rows with a ``session_id`` chain by ``delay``; others stand alone),
    sorted stably by start and kept column-wise (``TraceSessions``: a 10^7-row trace fits in memory).

    ``max_requests`` counts rows; a bad row is a ``ScenarioError`` naming the file, line and field, and so is
    the row past ``max_rows`` (the trace is not read further). ``progress`` (default: stderr when it is a
    terminal, unless ``made`` counts the rows instead: it is told of every ``MADE_EVERY_ROWS``) gets a line every
    ``PROGRESS_EVERY_ROWS`` rows.
    """
    if progress is None and made is None and sys.stderr is not None and sys.stderr.isatty():
        progress = sys.stderr
    store = TraceSessionsBuilder(workload.block_size)
    turns = mooncake_turns(path, store, max_requests, workload.block_size,
                           speed=workload.arrival_speedup_ratio, max_rows=max_rows)
    count = 0
    while True:
        try:
            item = next(turns, None)
        except InvalidArgument as exc:
            raise ScenarioError(str(exc)) from None
        if item is None:
            break
        lineno, row = item.line, item.row
        count += 1
        if made is not None and count % MADE_EVERY_ROWS == 0:
            made(MADE_EVERY_ROWS)
        if progress is not None and count % PROGRESS_EVERY_ROWS == 0:
            print(f"kvemu: reading {path}: {count:,} rows (line {lineno:,})", file=progress, flush=True)
        r = store.turn(row)
        if item.follows:
            _check_time(store.follow(row.session_id, r, item.time_ns), path, lineno)  # type: ignore[arg-type]
            continue
        _check_time(item.time_ns, path, lineno)
        store.open(r, lineno, item.time_ns, row.session_id)
    if made is not None:
        made(count % MADE_EVERY_ROWS)
    return store.build()


def _check_time(t_ns: int, path: Path, lineno: int) -> None:
    if t_ns > MAX_SCENARIO_NS:
        raise ScenarioError(f"{path}:{lineno}: this row arrives {t_ns / NS_PER_S:.3g} s into the run (timestamps and "
                            f"session delays, over arrival_speedup_ratio), past the {MAX_SCENARIO_S:.2g} s kvemu "
                            "simulates")


def sample(dist: Distribution, rng: random.Random) -> int:
    """A draw clamped to [low, high]."""
    if dist.kind == "constant":
        value = dist.mean
    elif dist.kind == "uniform":
        value = rng.randint(dist.low, dist.high)
    elif dist.kind == "normal":
        value = rng.gauss(dist.mean, dist.std)
    else:
        sigma = math.sqrt(math.log(1 + (dist.std / dist.mean) ** 2)) if dist.mean > 0 else 0.0
        value = rng.lognormvariate(math.log(max(dist.mean, 1e-9)) - sigma**2 / 2, sigma)
    return int(min(max(round(value), dist.low, 1), dist.high))


def synthesize(w: SyntheticWorkload, *, seed: int, duration_s: float, workers: int,
               max_sessions: int | None = None, made: Callable[[int], None] | None = None) -> list[Session]:
    """Sessions arriving over ``duration_s`` (Poisson or constant rate), growing their conversation; ``made`` is
    told of each session's requests as it is made."""
    rng = random.Random(seed)
    vocab = w.vocab_size
    prefixes = [_tokens(rng, vocab, w.system_prefix_tokens) for _ in range(max(1, w.num_prefix_groups))]
    sessions: list[Session] = []
    t = 0.0
    n = 0
    while True:
        t += rng.expovariate(w.rate_rps) if w.arrival == "poisson" else 1.0 / w.rate_rps
        if t > duration_s or (max_sessions is not None and n >= max_sessions):
            break
        sid = f"s{n}"
        n += 1
        history = list(prefixes[rng.randrange(len(prefixes))])
        pin = rng.randrange(workers) if w.pin_fraction and rng.random() < w.pin_fraction else None
        turns: list[Turn] = []
        for k in range(w.turns):
            history += _tokens(rng, vocab, sample(w.isl, rng))
            osl = sample(w.osl, rng)
            reply = _tokens(rng, vocab, osl)
            subs = tuple(
                (history + _tokens(rng, vocab, sample(w.isl, rng) // 2 + 1), sample(w.osl, rng))
                for _ in range(w.sub_agents)
            )
            delay = 0 if k == 0 else round(rng.expovariate(1.0 / w.think_time_s) * NS_PER_S) if w.think_time_s else 0
            turns.append(Turn(list(history), osl, delay, reply, subs, pin))
            history += reply
        sessions.append(Session(sid, round(t * NS_PER_S), turns, True))
        if made is not None:
            made(w.turns * (1 + w.sub_agents))
    return sessions


def _tokens(rng: random.Random, vocab: int, count: int) -> list[int]:
    """``count`` uniform token ids below ``vocab``: the values ``[rng.randrange(vocab) for ...]`` gives
    (rejection sampling on ``getrandbits``), drawn without a Python call per token."""
    k = vocab.bit_length()
    out = [r for r in map(rng.getrandbits, repeat(k, count)) if r < vocab]
    while len(out) < count:
        out += [r for r in map(rng.getrandbits, repeat(k, count - len(out))) if r < vocab]
    return out


def trace_format(workload: TraceWorkload, path: Path) -> str:
    """The workload's trace format: ``format``, or the one its file shows (``auto``)."""
    if workload.format != "auto":
        return workload.format
    try:
        return detect_format(path)
    except InvalidArgument as exc:
        raise ScenarioError(f"workload.format: {exc}") from None


def load_trace_graph(workload: TraceWorkload, path: Path, fmt: str, max_requests: int | None = None, *,
                     max_rows: int = MAX_TRACE_ROWS) -> TraceGraph:
    """A trace of any format as a graph, faster by ``arrival_speedup_ratio`` and cut to its first
    ``max_requests`` nodes (a node whose dependency was cut goes too); a bad file is a ``ScenarioError``."""
    try:
        graph = load_graph(path, fmt, workload.trace_block_size, max_rows=max_rows)
    except (InvalidArgument, OSError) as exc:
        raise ScenarioError(str(exc)) from None
    last = max(graph.not_before_ns, default=0) / workload.arrival_speedup_ratio
    if last > MAX_SCENARIO_NS:
        raise ScenarioError(f"{path}: a request is ready {last / NS_PER_S:.3g} s into the run, past the "
                            f"{MAX_SCENARIO_S:.2g} s kvemu simulates")
    graph = graph.scaled(workload.arrival_speedup_ratio)
    if max_requests is not None and max_requests < len(graph):
        graph = graph.select([i < max_requests for i in range(len(graph))])
    return graph


def count_requests(sessions: Workload) -> int:
    """How many requests the sessions will send (turns and their sub-agents; a loaded trace counts its rows, a
    graph its nodes): ``Workload.request_count``."""
    return sessions.request_count()


def build_sessions(scenario: Scenario, made: Callable[[int], None] | None = None) -> Sessions:
    """The scenario's sessions (a graph for an agentic trace), cut to ``run.duration_s`` / ``run.max_requests``
    as configured (a graph keeps the plays whose first request is ready by ``duration_s``); ``made`` is told of
    the requests as they are made (a synthetic workload's, a Mooncake trace's rows), for a progress line.

    ``ScenarioError`` when running them would not fit in memory (``memory_problem``): for a trace read whole,
    from its line count before a row is parsed; for any workload, from its requests once built; and for a workload
    of no request (an empty trace), which would run 0/0 and pass."""
    _check_rows_fit(scenario)
    sessions = _build_sessions(scenario, made)
    requests = count_requests(sessions)
    if requests == 0:  # a run of nothing would report 0/0 and pass (an empty trace is refused as it is read)
        raise ScenarioError(f"workload: no request starts within run.duration_s={scenario.run.duration_s}; raise it")
    problem = memory_problem(requests, "the workload")
    if problem is not None:
        raise ScenarioError(problem)
    return sessions


def _check_rows_fit(scenario: Scenario) -> None:
    """Refuse a trace whose rows (its lines, up to ``run.max_requests``) will not fit, before reading them: loading
    10^7 rows takes minutes. Only where every row will run (no ``run.duration_s`` cut, no lanes recycling)."""
    w, run = scenario.workload, scenario.run
    if not isinstance(w, TraceWorkload) or run.duration_s is not None or w.lanes is not None:
        return
    path = resolve(scenario, w.trace)
    if not path.is_file():
        return  # (a corpus directory is counted once built; a missing file is its reader's error)
    try:
        lines = line_count(path)
    except (OSError, InvalidArgument):
        return  # its reader says what is wrong with it
    rows = lines if run.max_requests is None else min(lines, run.max_requests)
    problem = memory_problem(rows, f"{path}: {lines:,} lines")
    if problem is not None:
        raise ScenarioError(problem)


def _build_sessions(scenario: Scenario, made: Callable[[int], None] | None) -> Sessions:
    w = scenario.workload
    run = scenario.run
    if isinstance(w, TraceWorkload):
        path = resolve(scenario, w.trace)
        fmt = trace_format(w, path)
        if w.lanes is not None and fmt in ("mooncake", "mooncake-delta"):
            raise ScenarioError(f"workload.lanes: {w.trace} is a {fmt} trace, which has no plays (each session is "
                                "its own chain) for lanes to replay; use an agentic format or drop workload.lanes")
        limit_ns = None if run.duration_s is None else round(run.duration_s * NS_PER_S)
        if fmt == "mooncake":
            trace = _some_requests(load_trace(w, path, run.max_requests, made=made), path)
            return trace if limit_ns is None else trace.starting_by(limit_ns)
        graph = _some_requests(load_trace_graph(w, path, fmt, run.max_requests), path)
        if w.lanes is not None:
            _check_lanes(w.lanes, graph)
        return graph if limit_ns is None else _plays_by(graph, limit_ns)
    duration = run.duration_s if run.duration_s is not None else 60.0
    sessions = synthesize(w, seed=run.seed, duration_s=duration, workers=scenario.cluster.workers, made=made)
    if run.max_requests is not None:
        sessions = list(_cut(sessions, run.max_requests))
    return SessionList(sessions)


_Loaded = TypeVar("_Loaded", TraceSessions, TraceGraph)


def _some_requests(loaded: _Loaded, path: Path) -> _Loaded:
    """``loaded``, refused if it holds no request: before any cut (the cut's own refusal names run.duration_s)."""
    if not loaded.request_count():
        raise ScenarioError(f"{path}: the trace has no requests")
    return loaded


def _check_lanes(lanes: LanesSpec, graph: TraceGraph) -> None:
    """Lanes that run the corpus once need a play each."""
    plays = len(graph.plays)
    if not plays:
        raise ScenarioError("workload.lanes: the trace has no requests to replay")
    if lanes.duration_s is None and lanes.snapshot_seed is None and lanes.lanes > plays:
        raise ScenarioError(f"workload.lanes.lanes: {lanes.lanes} lanes for a corpus of {plays} plays run once: "
                            "some lanes would never get a play; use at most that many lanes, or set "
                            "workload.lanes.duration_s to recycle the corpus")


def _plays_by(graph: TraceGraph, limit_ns: int) -> TraceGraph:
    """The plays whose first root is ready at or before ``limit_ns``."""
    first = [MAX_SCENARIO_NS + 1] * len(graph.plays)
    for i in graph.roots():
        p = graph.play_of(i)
        first[p] = min(first[p], graph.not_before_ns[i])
    if all(t <= limit_ns for t in first):
        return graph
    return graph.select([first[graph.play_of(i)] <= limit_ns for i in range(len(graph))])


def _cut(sessions: list[Session], limit: int) -> Iterator[Session]:
    left = limit
    for s in sessions:
        if left <= 0:
            return
        turns = s.turns[:left]
        left -= len(turns)
        yield s._replace(turns=turns)


def output_lengths(scenario: Scenario) -> Callable[[], int]:
    """Draws of the scenario's output length (seeded by ``run.seed``): its synthetic ``osl`` distribution, or
    the lengths of its trace's rows. What an HTTP front end answers when a client lets the model stop."""
    rng = random.Random(scenario.run.seed * 7919 + 17)
    w = scenario.workload
    if isinstance(w, SyntheticWorkload):
        return lambda: sample(w.osl, rng)
    path = resolve(scenario, w.trace)
    fmt = trace_format(w, path)
    if fmt != "mooncake":
        graph = load_trace_graph(w, path, fmt, scenario.run.max_requests)
        lengths = array("I", (max(1, n) for n in graph.output_length))
    else:
        lengths = array("I")  # (a 10^7-row trace: 40 MB, not a list of ints)
        for _, row in read_mooncake(path, scenario.run.max_requests, w.block_size):
            lengths.append(row.output_length)
    if not lengths:
        raise ScenarioError(f"workload.trace: {w.trace} has no rows to draw output lengths from")
    return lambda: lengths[rng.randrange(len(lengths))]
