"""The ``kvemu`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvemu`` console script."""
    parser = argparse.ArgumentParser(prog="kvemu", description="Emulator of KV-cache-aware LLM serving clusters.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="route a few multi-turn sessions on virtual time and show the decisions")
    demo.add_argument("--workers", type=int, default=4)
    demo.add_argument("--dp-size", type=int, default=2)
    demo.add_argument("--sessions", type=int, default=6)
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from harness.demo import run_demo

        for name in ("workers", "dp_size", "sessions", "turns"):
            if getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be >= 1")
        run_demo(
            sys.stdout,
            workers=args.workers,
            dp_size=args.dp_size,
            sessions=args.sessions,
            turns=args.turns,
            seed=args.seed,
        )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
