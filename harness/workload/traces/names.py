"""The trace formats' names, without their loaders (the command line's parser lists them and stays light)."""

from __future__ import annotations

__all__ = ["FORMATS", "WRITABLE", "EMBEDDED_BLOCK_SIZE"]

FORMATS = ("mooncake", "mooncake-delta", "agentic_mooncake", "agentic_mooncake_legacy", "applied_compute_agentic",
           "weka", "dynamo")
"""Every format kvemu reads. ``agentic_mooncake`` reads v2 (a header line) or, without one, the legacy rows;
``agentic_mooncake_legacy`` names the legacy rows alone (to write them, or to refuse a v2 file)."""
WRITABLE = ("mooncake", "mooncake-delta", "agentic_mooncake", "agentic_mooncake_legacy")
"""The formats ``kvemu trace convert`` writes (the others are recordings a graph cannot be turned back into)."""
EMBEDDED_BLOCK_SIZE = ("agentic_mooncake", "weka", "dynamo")
"""Formats whose files say their block size (a block size given must agree); the others default to 512."""
