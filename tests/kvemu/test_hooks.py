"""Hook kinds: a closed ``HookKind`` enum that emitters must use, while subscribers may still name kinds by string."""

from __future__ import annotations

import re
from collections import Counter
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvemu.hooks import KINDS, HookEvent, HookKind, Hooks

ROOT = Path(__file__).resolve().parents[2]


def test_a_kind_named_by_its_string_hears_the_member_events() -> None:
    hooks = Hooks()
    by_string: list[HookEvent] = []
    by_member: list[HookEvent] = []
    hooks.subscribe(by_string.append, "completed")
    hooks.subscribe(by_member.append, HookKind.COMPLETED)
    assert hooks.wants(HookKind.COMPLETED) and not hooks.wants(HookKind.FAILED)
    hooks.note(HookKind.COMPLETED, 5, "r")
    hooks.note(HookKind.FAILED, 6, "r")
    assert [e.kind for e in by_string] == [e.kind for e in by_member] == ["completed"]
    assert by_string[0].kind is HookKind.COMPLETED and f"{by_string[0].kind}" == "completed"


def test_an_unknown_kind_is_refused_and_retried_is_known() -> None:
    hooks = Hooks()
    with pytest.raises(ValueError, match="unknown hook kinds \\['complete'\\]"):
        hooks.subscribe(print, "complete")
    hooks.subscribe(print, "retried")  # emitted by the disaggregated coordinator; was missing from KINDS
    assert KINDS == frozenset(HookKind) and "retried" in KINDS and len(KINDS) == 22


def test_every_kind_is_emitted_somewhere() -> None:
    """Each member is named by an emitter in kvemu (none is reserved): a kind nobody emits is a dead subscription."""
    sources = "\n".join(p.read_text() for p in (ROOT / "kvemu").rglob("*.py") if p.name != "hooks.py")
    used = set(re.findall(r"HookKind\.([A-Z_]+)", sources))
    assert used == {k.name for k in HookKind}


@pytest.mark.skipif(shutil.which("mypy", path=str(Path(sys.executable).parent)) is None, reason="mypy not installed")
def test_mypy_refuses_an_unknown_kind_at_an_emit_site(tmp_path: Path) -> None:
    snippet = tmp_path / "emitter.py"
    snippet.write_text("from kvemu.hooks import HookKind, Hooks\n\n"
                       "Hooks().note(HookKind.COMPLETED, 0)\n"
                       "Hooks().note('complete', 0)\n")
    mypy = Path(sys.executable).parent / "mypy"
    out = subprocess.run([str(mypy), "--no-incremental", "--follow-imports=silent", "--ignore-missing-imports",
                          str(snippet)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert 'emitter.py:4: error: Argument 1 to "note" of "Hooks" has incompatible type' in out.stdout, out.stdout
    assert "emitter.py:3" not in out.stdout


def test_the_hub_counts_every_kind_and_builds_events_only_for_listeners() -> None:
    hooks = Hooks()
    heard: list[HookEvent] = []
    hooks.subscribe(heard.append, "completed")
    relayed: Counter[str] = Counter()
    hooks.count_into(relayed, [HookKind.ROUTED])
    hooks.note(HookKind.COMPLETED, 1, "a")
    hooks.note(HookKind.ROUTED, 2, "a")  # nobody listens: counted, not built
    hooks.tally(HookKind.ROUTED)
    hooks.tally(HookKind.TOKENS)
    assert [e.kind for e in heard] == ["completed"]
    assert hooks.counts == {"completed": 1, "routed": 2, "tokens": 1}
    assert relayed == {"routed": 2}  # only the relayed kinds


def test_a_run_nobody_observes_routing_in_builds_no_routed_details_yet_counts_every_decision(monkeypatch) -> None:
    """The recorder reads arrivals, failures, worker and KV events; the routing payload (every rank's cost) is
    built only for an observer of ``routed``, while ``hook_counts`` still counts each decision."""
    import kvemu.lifecycle
    from harness.run.runner import run_scenario
    from harness.scenario import parse_scenario

    built: list[object] = []
    real = kvemu.lifecycle.Routed
    monkeypatch.setattr(kvemu.lifecycle, "Routed", lambda *a: built.append(a) or real(*a))
    text = "name: q\nworkload: {kind: synthetic, rate_rps: 20}\nrun: {mode: virtual, duration_s: 1, seed: 3}\n"
    quiet = dict(run_scenario(parse_scenario(text), None).recorder.counters)
    routed = quiet["routed"]
    assert not built and routed >= 10 and quiet["request_arrived"] == routed
    heard: list[HookEvent] = []
    observed = dict(run_scenario(parse_scenario(text), None, observers=[heard.append]).recorder.counters)
    assert len(built) == routed == sum(e.kind == "routed" for e in heard)
    assert observed == quiet
