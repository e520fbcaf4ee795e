"""Speed and structure work leave reports alone: three scenarios' reports are pinned.

The digests are of ``requests.jsonl`` as written and of ``summary.json`` without its wall-clock keys and
``kvemu.build`` (absent at eff05ba), as canonical JSON. The quickstart and the chaos scenario were taken at
eff05ba (where issue #28, speed, started), the disaggregated one at 2542e40 (where issue #29, structure,
started); whichever build this suite runs (pure in CI's first step, compiled in its fresh clone) must reproduce
them. A change meant to move a report (a fidelity fix) updates them in the same commit and says why.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.report.summary import WALL_CLOCK_KEYS

ROOT = Path(__file__).resolve().parents[2]

PINNED = {
    "quickstart": ((), "1ae6191040938352988cf0f4a61bdba06f480f70569348944bf0cb8590a447bb",
                   "fd1bf228547a4ed12db4c086410c63cc00afbe07caf2bf197a47b07e7df4b999"),
    "chaos-virtual": (("examples/compose-chaos.yaml", "--set", "run.mode=virtual"),
                      "74cd34353ad9e06b517bbfa18be137cde8dafbcd65c97004cf7a346d1058503f",
                      "b56e6001e862a6f6cd50f8915b9c402b318145570695b3b5995df064a1653316"),
    "disagg-virtual": (("examples/compose-disagg.yaml", "--set", "run.mode=virtual"),
                       "cd779eccf6ba06c231291563afcd55a015a859f1df550714db536a1efd2cde1a",
                       "5f4357514a7c52d84639591049bbbb7609f0b58525ee4b6230bb4191d50ddd06"),
}
"""Scenario → (``kvemu run`` arguments, summary digest, requests.jsonl digest)."""


def summary_digest(summary: dict) -> str:
    """sha256 of the summary as canonical JSON, minus the keys a run may differ in (wall clock, build)."""
    kept = {k: v for k, v in summary.items() if k not in WALL_CLOCK_KEYS}
    kept["kvemu"] = {k: v for k, v in kept["kvemu"].items() if k != "build"}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("name", sorted(PINNED))
def test_reports_match_the_pinned_digests(tmp_path, name):
    args, want_summary, want_requests = PINNED[name]
    run = subprocess.run([sys.executable, "-m", "harness.cli", "run", *args, "--quiet", "-o", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary_digest(summary) == want_summary, f"{name}: summary.json moved ({summary['kvemu'].get('build')})"
    got = hashlib.sha256((tmp_path / "requests.jsonl").read_bytes()).hexdigest()
    assert got == want_requests, f"{name}: requests.jsonl moved"
