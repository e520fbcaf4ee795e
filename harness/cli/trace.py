"""``kvemu trace validate``, ``kvemu trace convert`` and ``kvemu trace synth``: read any trace format, check it,
write it as another, or generate a Mooncake-format stand-in."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["trace_command"]


def trace_command(args: argparse.Namespace) -> int:
    """Runs ``kvemu trace validate|convert|synth``; a bad file prints ``invalid: FILE:LINE: FIELD: ...`` and gives
    2."""
    if args.trace_command == "synth":
        return _synth(Path(args.output), args.rows, args.seed, args.force)
    from kvemu.errors import InvalidArgument

    from harness.workload.traces.convert import convert_trace
    from harness.workload.traces.formats import detect_format, load_graph

    from harness.untrusted_files import trace_file_problem

    source = Path(args.input)
    problem = trace_file_problem(source)
    if problem is not None:
        print(f"invalid: {source}: {problem}", file=sys.stderr)
        return 2
    if args.block_size is not None and args.block_size < 1:
        print("invalid: --block-size must be >= 1", file=sys.stderr)
        return 2
    try:
        fmt = args.from_format if args.from_format != "auto" else detect_format(source)
        graph = load_graph(source, fmt, args.block_size)
    except (InvalidArgument, OSError) as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 2
    roots = sum(1 for _ in graph.roots())
    summary = (f"{fmt}, {len(graph):,} requests, {graph.edge_count():,} edges, {roots:,} roots, "
               f"{len(graph.sessions):,} sessions, {len(graph.plays):,} plays, block size {graph.block_size}")
    if args.trace_command == "validate":
        print(f"ok: {source}: {summary}")
        return 0
    try:
        done = convert_trace(graph, Path(args.output), args.to, allow_lossy=args.allow_lossy)
    except InvalidArgument as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvemu trace convert: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {done.rows:,} rows as {args.to} (read {summary})")
    for line in done.dropped:
        print(f"dropped: {line}", file=sys.stderr)
    for line in done.renamed:
        print(f"not kept: {line}", file=sys.stderr)
    return 0


def _synth(output: Path, rows: int, seed: int, force: bool) -> int:
    """``kvemu trace synth OUT --rows N [--seed S]``: ``harness.workload.synthetic_trace``'s rows written to ``OUT``; an
    existing file (perhaps the real trace) is kept unless ``force``."""
    from harness.workload.synthetic_trace import TRACE_BLOCK_SIZE, write_synthetic_trace

    if output.exists() and not force:
        print(f"kvemu trace synth: {output} exists: choose another OUT, or pass --force to write over it",
              file=sys.stderr)
        return 2
    try:
        write_synthetic_trace(output, rows, seed=seed)
    except OSError as exc:
        print(f"kvemu trace synth: cannot write {output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote {output}: {rows:,} generated rows in the Mooncake format (seed {seed}, {TRACE_BLOCK_SIZE} tokens "
          f"per hash id); run a scenario on it with --set workload.trace={output}")
    return 0
