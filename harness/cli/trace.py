"""``kvemu trace validate`` and ``kvemu trace convert``: read any trace format, check it, write it as another."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["trace_command"]


def trace_command(args: argparse.Namespace) -> int:
    """Runs ``kvemu trace validate|convert``; a bad file prints ``invalid: FILE:LINE: FIELD: ...`` and gives 2."""
    from kvemu.errors import InvalidArgument

    from harness.traces.convert import convert_trace
    from harness.traces.formats import detect_format, load_graph

    from workers.trace import trace_file_problem

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
