"""Every shell and Python block of the README, CONTRIBUTING.md and docs/ runs as written, so a recipe cannot rot.

A block runs in a fresh folder holding links to the checkout's ``examples/`` and ``bench/``, with this
interpreter's ``kvemu`` first on the PATH. A comment on the line before a block's fence changes how it runs:

- ``<!-- docs-test: server CMD -->``: CMD (a server) is started first, and the block runs once CMD printed its
  first line; CMD is stopped with Ctrl-C (SIGINT to its process group) afterwards.
- ``<!-- docs-test: setup CMD -->``: CMD runs first, in the same folder (``$KVEMU_CHECKOUT`` is the checkout).
- ``<!-- docs-test: timeout N -->``: the block may take N seconds (default 120).
- ``<!-- docs-test: run-by PATH -->``: run verbatim elsewhere, by PATH: a ``.ci/`` script that runs the block
  it prints with ``--print-command`` (the README's two commands), or a test file that holds the block's command
  (the docker-compose line); a test here holds the two equal.
- ``<!-- docs-test: skip REASON -->``: not run anywhere, for the reason given (it needs a GPU, or clients this
  project does not install); the reason shows in pytest's summary.

Every fence must name its language, so no shell block hides as plain text. These tests start servers and
processes: like the process supervision tests they run once, on ``.ci/run``'s first step.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/api/ too
RUN = {"sh": "shell", "bash": "shell", "shell": "shell", "python": "python", "py": "python"}
DIRECTIVE = re.compile(r"^<!-- docs-test: (server|setup|timeout|run-by|skip) (.+?) -->$")
DEFAULT_TIMEOUT_S = 120.0
SERVER_START_S = 90.0


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    directive: tuple[str, str] | None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` (language, code, the directive on the line before the fence)."""
    lines = page.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
        before = lines[i - 1] if i else ""
        d = DIRECTIVE.match(before)
        out.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1:j]) + "\n",
                         (d.group(1), d.group(2)) if d else None))
        i = j + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]
RUNNABLE = [b for b in ALL if b.lang in RUN]


def test_every_fence_names_its_language():
    unnamed = [b.name for b in ALL if not b.lang]
    assert not unnamed, f"fences without a language (```text for output, ```sh for commands): {unnamed}"


def test_every_directive_is_on_a_runnable_block_and_every_skip_says_why():
    for b in ALL:
        if b.directive is not None:
            assert b.lang in RUN, f"{b.name}: a docs-test directive on a {b.lang!r} block"
            if b.directive[0] == "skip":
                assert len(b.directive[1]) >= 20, f"{b.name}: a skip must say why"


def _command_lines(code: str) -> list[str]:
    """A shell block's lines without their trailing comments and blank lines."""
    return [line.split("  #")[0].rstrip() for line in code.splitlines() if line.strip()]


RUN_ELSEWHERE = [b for b in RUNNABLE if b.directive is not None and b.directive[0] == "run-by"]


@pytest.mark.parametrize("block", RUN_ELSEWHERE, ids=[b.name for b in RUN_ELSEWHERE])
def test_a_block_run_elsewhere_is_run_there_verbatim(block: Block) -> None:
    where = ROOT / block.directive[1]  # type: ignore[index]
    assert where.is_file(), f"{block.name}: {where} does not exist"
    if where.parent.name == ".ci":
        printed = subprocess.run(["bash", str(where), "--print-command"], capture_output=True, text=True, check=True,
                                 timeout=30).stdout
        assert _command_lines(printed) == _command_lines(block.code), f"{where.name} runs another command"
    else:
        text = where.read_text()
        missing = [line for line in _command_lines(block.code) if line not in text]
        assert not missing, f"{block.name}: {where.name} does not hold {missing}"


def test_the_blocks_run_elsewhere_are_the_readmes_two_commands_and_the_compose_line() -> None:
    assert {b.name: b.directive[1] for b in RUN_ELSEWHERE} == {  # type: ignore[index]
        "README.md:12": ".ci/check-installed", "README.md:17": ".ci/fresh-clone",
        "CONTRIBUTING.md:8": ".ci/fresh-clone", "docs/live.md:33": "tests/end_to_end/test_compose.py"}


def _env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVEMU_SECRET", "KVEMU_HANDOFF"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    env["HOME"] = str(work)  # tools that write caches write them here
    env["KVEMU_CHECKOUT"] = str(ROOT)
    return env


def _workdir(tmp_path: Path) -> Path:
    for name in ("examples", "bench"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _start_server(cmd: str, work: Path, env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        if not sel.select(SERVER_START_S):
            _stop(proc)
            pytest.fail(f"{cmd!r} printed nothing in {SERVER_START_S:g} s")
    first = proc.stdout.readline()  # type: ignore[union-attr]
    if proc.poll() is not None:
        pytest.fail(f"{cmd!r} exited {proc.returncode}: {first}{proc.stdout.read()}")  # type: ignore[union-attr]
    return proc


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
            return out or ""
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    return out or ""


@pytest.mark.process_supervision
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_the_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    kind, arg = block.directive or ("", "")
    if kind == "skip":
        pytest.skip(f"{block.name}: {arg}")
    if kind == "run-by":
        pytest.skip(f"{block.name}: run verbatim by {arg}")
    timeout_s = float(arg) if kind == "timeout" else DEFAULT_TIMEOUT_S
    work = _workdir(tmp_path)
    env = _env(work)
    if kind == "setup":
        subprocess.run(["bash", "-euo", "pipefail", "-c", arg], cwd=work, env=env, check=True, timeout=60)
    server = _start_server(arg, work, env) if kind == "server" else None
    try:
        argv = ["bash", "-euo", "pipefail", "-c", block.code] if RUN[block.lang] == "shell" else \
            [sys.executable, "-c", block.code]
        proc = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{block.name} took over {timeout_s:g} s\n{out[-2000:]}\n{err[-2000:]}")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever the block left running in the background
            except ProcessLookupError:
                pass
    finally:
        server_out = _stop(server) if server is not None else ""
    assert proc.returncode == 0, (f"{block.name} exited {proc.returncode}\n--- stdout\n{out[-3000:]}\n"
                                  f"--- stderr\n{err[-3000:]}\n--- server\n{server_out[-2000:]}")
