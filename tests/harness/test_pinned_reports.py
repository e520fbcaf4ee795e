"""Speed and structure work leave reports alone: three scenarios' reports are pinned.

The digests are of ``requests.jsonl`` as written and of ``summary.json`` without its wall-clock keys and
``kvemu.build`` (absent at eff05ba), as canonical JSON. The quickstart and the chaos scenario were taken at
eff05ba (where issue #28, speed, started), the disaggregated one at 2542e40 (where issue #29, structure,
started); whichever build this suite runs (pure in CI's first step, compiled in its fresh clone) must reproduce
them. A change meant to move a report (a fidelity fix) updates them in the same commit and says why.

Updated once since, by the routing regret (#32): ``requests.jsonl`` records gained ``truth_overlap_blocks``,
``truth_best_overlap_blocks`` and ``regret_source`` and ``summary.json`` gained ``kvemu.routing.regret``; with
those removed, the three reports were checked equal to the ones pinned before. Then the router replicas (#32):
``summary.json`` gained ``kvemu.routing.regret_ratio`` (the issue's headline key, a copy of
``kvemu.routing.regret.regret_ratio``); ``requests.jsonl`` did not move. The router replicas' own scenario
(``examples/replicas-chaos.yaml``: three replicas, sync, a fault on each) was pinned then, from the compiled build,
after checking the pure build writes the same bytes.
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
    "quickstart": ((), "65b568bfac53c8a0d67e2b0e7927acd3816b0423f0834efc95cd86ac49a3f743",
                   "9d053041fc3eb8844891f642bedfd697f1cc458642a94e451768a760f02458f5"),
    "chaos-virtual": (("examples/compose-chaos.yaml", "--set", "run.mode=virtual"),
                      "802e46b5d27db6727ee7d8e59bac9ceecb6608a851a9aaaf13d89e5c114736af",
                      "51d4b26e8cb9e5329be3df34297f18ee6ccb1b0d210bdab79063a898128fec3b"),
    "disagg-virtual": (("examples/compose-disagg.yaml", "--set", "run.mode=virtual"),
                       "765978902fa978689df3b37179a070fdc9446f6bd93e1ef7ddba42867cb26f8a",
                       "58c170b5e6a5dbe7f988d2b2688deb32b15dfb1e3335c1c34bea1647f3042d37"),
    "replicas-chaos": (("examples/replicas-chaos.yaml",),
                       "6b327752ad755087c2efb6d0f18494eaf2abdd7da038eea6dcfa442a149cdb0a",
                       "eaa5d5de6edcf5342f9cfef3550ff997825e3a677bdae899f1a20d42c740b08a"),
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
