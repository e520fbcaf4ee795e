"""The small commands: ``kvemu tokenizer export``, ``kvemu compare`` and ``kvemu demo``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["compare_command", "demo_command", "tokenizer_command"]


def tokenizer_command(args: argparse.Namespace) -> int:
    from kvemu.http.tokenizer import export_builtin

    files = export_builtin(args.directory)
    print(f"wrote kvemu's built-in tokenizer to {args.directory}: {', '.join(f.name for f in files)}")
    print(f"use it with: --tokenizer {args.directory} (aiperf, vllm bench serve, transformers.AutoTokenizer)")
    return 0


def compare_command(args: argparse.Namespace) -> int:
    from harness.report.compare import main as compare_main

    return compare_main([args.a, args.b])


def demo_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from harness.demo import run_demo

    for name in ("workers", "dp_size", "sessions", "turns"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    run_demo(sys.stdout, workers=args.workers, dp_size=args.dp_size, sessions=args.sessions, turns=args.turns,
             seed=args.seed)
    return 0
