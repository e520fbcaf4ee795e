"""``--help`` teaches: every command's help ends with examples that parse as written, and plain ``kvemu`` prints the
help (exit 0) instead of an error."""

import argparse
import shlex

from harness.cli import main
from harness.cli.parser import build_parser

from tests.harness.test_cli import kvemu


def _commands(parser, path="kvemu"):
    """Every parser of the command line with its words: ``kvemu``, ``kvemu run``, ``kvemu trace convert``..."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, f"{path} {name}")


def _examples(help_text):
    section = help_text.split("\nexamples:\n", 1)[1]
    return [line.strip() for line in section.splitlines() if line.strip()]


def test_every_command_help_ends_with_examples_that_parse():
    commands = list(_commands(build_parser()))
    assert {"kvemu run", "kvemu up", "kvemu trace convert", "kvemu scenario show", "kvemu bench-router"} <= {
        path for path, _ in commands}
    for path, parser in commands:
        text = parser.format_help()
        assert "\nexamples:\n" in text, path
        examples = _examples(text)
        assert len(examples) >= 2 and all(line.startswith("kvemu ") for line in examples), (path, examples)
        for line in examples:
            words = shlex.split(line.split("  #")[0].split(" > ")[0])[1:]
            if "COMMAND" in words:
                continue
            try:
                build_parser().parse_args(words)
            except SystemExit:
                raise AssertionError(f"{path}: its example does not parse: {line}") from None


def test_plain_kvemu_prints_the_help_and_exits_0(tmp_path, capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvemu ") and "\nexamples:\n  kvemu run " in out
    proc = kvemu(cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith("usage: kvemu ") and "\nexamples:\n  kvemu run " in proc.stdout
