"""The README is a door: its two commands first (the second is exactly what CI runs), then links. Every shell and
Python block in it and in docs/ runs in tests/test_docs.py."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
PAGES = [README, *sorted((README.parent / "docs").glob("*.md"))]


def test_readme_starts_with_the_two_commands():
    text = README.read_text()
    commands = re.findall(r"```sh\n(.*?)\n```", text, flags=re.S)[:2]
    assert commands[0].endswith("kvemu run")
    assert "pytest" in commands[1]
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci, ".ci/run must run exactly the README's test command"
    assert "\nbash .ci/fresh-clone\n" in ci, ".ci/run must also run it in a clone with nothing beside it"
    fresh = subprocess.run(["bash", str(README.parent / ".ci" / "fresh-clone"), "--print-command"],
                           capture_output=True, text=True, check=True)
    assert fresh.stdout == commands[1] + "\n", "the fresh clone must run the README's command verbatim"


def test_demo_command_prints_decisions():
    out = subprocess.run(
        [sys.executable, "-m", "harness.cli", "demo", "--sessions", "3", "--turns", "2"],
        capture_output=True, text=True, check=True, cwd=README.parent,
    ).stdout
    assert "6 requests routed on 4 workers x 2 DP ranks" in out
    assert re.search(r"prefix blocks found cached at routing time: \d+/\d+", out)
    # same seed, same decisions
    again = subprocess.run(
        [sys.executable, "-m", "harness.cli", "demo", "--sessions", "3", "--turns", "2"],
        capture_output=True, text=True, check=True, cwd=README.parent,
    ).stdout
    assert out == again


def test_the_readme_is_a_door_not_a_manual():
    """What kvemu is, the two commands, what you get and links: the manual lives in docs/ (a 968-line README lost
    newcomers), and every page it links to exists."""
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    for link in re.findall(r"\]\(((?:docs/)?[A-Za-z-]+\.md)(?:#[^)]*)?\)", text):
        assert (README.parent / link).is_file(), link


def test_docs_separate_processes_read_one_scenario():
    """Each ``kvemu router``/``worker``/``loadgen`` line of a shell block names the scenario: a worker without it ran
    the default engine (mean E2E 413 ms where examples/compose.yaml gives 37 ms; the router now refuses it)."""
    lines = [line.strip() for page in PAGES for block in re.findall(r"```sh\n(.*?)```", page.read_text(), flags=re.S)
             for line in block.splitlines() if re.match(r"kvemu (router|worker|loadgen) ", line.strip())]
    assert any(line.startswith("kvemu worker ") for line in lines)
    for line in lines:
        words = line.split("#")[0].split()
        named = [w for w in words if w.endswith(".yaml")]
        assert named, f"the README's {line!r} names no scenario"
        if words[1] in ("router", "worker"):
            assert words[words.index(named[0]) - 1] == "--config", line


def test_the_scenario_reference_is_what_kvemu_scenario_show_prints():
    """docs/scenario-reference.md is generated from the schema: a knob added, renamed or rebounded changes it."""
    page = (README.parent / "docs" / "scenario-reference.md").read_text()
    shown = page.split("```yaml\n", 1)[1].rsplit("```", 1)[0]
    out = subprocess.run([sys.executable, "-m", "harness.cli", "scenario", "show"], capture_output=True, text=True,
                         check=True, cwd=README.parent).stdout
    assert shown == out, "regenerate docs/scenario-reference.md's yaml block with `kvemu scenario show`"


def test_the_first_screen_the_readme_shows_is_what_kvemu_run_prints(tmp_path):
    """The README shows the built-in scenario's answer: every figure as printed (the wall time aside)."""
    shown = re.findall(r"```text\n(kvemu run: .*?)```", README.read_text(), flags=re.S)[0].splitlines()
    out = subprocess.run([sys.executable, "-m", "harness.cli", "run", "-o", str(tmp_path / "q")], capture_output=True,
                         text=True, check=True, cwd=README.parent).stdout.splitlines()
    skip = ("  virtual clock", "  report")
    assert [line for line in out if not line.startswith(skip)] == [line for line in shown if not line.startswith(skip)]
    assert out[-1].split() == ["report", str(tmp_path / "q" / "report.md")]
