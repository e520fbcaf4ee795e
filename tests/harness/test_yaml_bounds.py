"""YAML files (scenarios, sweeps) are parsed once, with libyaml where present, and refused before being built when
their aliases or merge keys would expand past declared limits; errors name the file."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
import yaml

from harness.scenario import ScenarioError, load_scenario, parse_scenario
from harness.sweep.spec import SweepError, parse_sweep
from harness.yaml_validation import MAX_YAML_ALIASES, MAX_YAML_VALUES, YamlError, load_yaml

REPO = Path(__file__).resolve().parents[2]


def merge_key_bomb(levels: int = 9, fan: int = 9) -> str:
    """Each level's mapping merges the one before ``fan`` times: PyYAML 6.0.3 copies fan**levels pairs."""
    lines = ["a0: &a0 {k0: 0}"]
    for i in range(1, levels + 1):
        refs = ", ".join([f"*a{i - 1}"] * fan)
        lines.append(f"a{i}: &a{i} {{<<: [{refs}], k{i}: {i}}}")
    return "\n".join([*lines, "name: *a9", ""])


def billion_laughs(levels: int = 9) -> str:
    """Ten lists of ten aliases of the list before, nine deep: 10**10 strings from 500 bytes."""
    lines = ["l0: &l0 [" + ",".join(['"lol"'] * 10) + "]"]
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return "\n".join([*lines, f"run: {{seed: *l{levels}}}", ""])


@pytest.mark.parametrize("text", [merge_key_bomb(), billion_laughs()], ids=["merge-keys", "billion-laughs"])
def test_alias_and_merge_key_bombs_are_refused_quickly_naming_the_limit(tmp_path, text):
    assert len(text) < 1000
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    start = time.perf_counter()
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert time.perf_counter() - start < 1.0
    assert str(info.value).startswith(f"{path}: line ")
    assert f"more than {MAX_YAML_VALUES:,} values" in str(info.value)
    with pytest.raises(SweepError, match=f"more than {MAX_YAML_VALUES:,} values"):
        parse_sweep(text, source="bomb.yaml")


def test_many_aliases_are_refused_at_the_alias_limit():
    text = "a: &a 1\nb: [" + ", ".join(["*a"] * (MAX_YAML_ALIASES + 1)) + "]\n"
    start = time.perf_counter()
    with pytest.raises(YamlError, match=f"more than {MAX_YAML_ALIASES:,} aliases"):
        load_yaml(text, "many.yaml")
    assert time.perf_counter() - start < 5.0  # (0.1 s idle; the limit bounds the work, the margin a busy CI)
    assert load_yaml("a: &a 1\nb: [" + ", ".join(["*a"] * 100) + "]\n", "few.yaml").data["b"] == [1] * 100


def test_a_recursive_alias_is_refused():
    with pytest.raises(YamlError, match="recursive"):
        load_yaml("a: &a [1, *a]\n", "loop.yaml")


def test_a_scenario_is_parsed_once(monkeypatch):
    """The line of a bad key comes from the one parse (re-parsing a large file doubled its cost)."""
    def refuse(*args, **kwargs):
        raise AssertionError("parsed a second time")

    for name in ("compose", "safe_load", "load", "compose_all"):
        monkeypatch.setattr(yaml, name, refuse)
    with pytest.raises(ScenarioError, match=r"s.yaml: cluster.workers \(line 3\): expected an integer"):
        parse_scenario("name: x\ncluster:\n  workers: many\n", source="s.yaml")


def test_yaml_errors_name_the_file():
    with pytest.raises(ScenarioError) as info:
        parse_scenario("cluster: [\n", source="examples/broken.yaml")
    assert 'in "examples/broken.yaml", line' in str(info.value)
    assert "<unicode string>" not in str(info.value)


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")) + [REPO / "harness" / "quickstart.yaml"],
                         ids=lambda p: p.name)
def test_shipped_files_load_as_pure_python_pyyaml_loads_them(path):
    text = path.read_text()
    assert load_yaml(text, str(path)).data == yaml.load(text, Loader=yaml.SafeLoader)


_PARSERS = {"load", "safe_load", "full_load", "unsafe_load", "load_all", "safe_load_all", "compose", "compose_all",
            "parse"}


def test_yaml_is_parsed_only_through_load_yaml():
    """Every file kvemu reads as YAML goes through ``load_yaml`` and its bounds: a direct ``yaml.safe_load``
    (whose aliases and merge keys nothing bounds) anywhere else fails here."""
    direct = []
    for root in ("harness", "kvemu", "workers"):
        for path in (REPO / root).rglob("*.py"):
            if path == REPO / "harness" / "yaml_validation.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _PARSERS
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "yaml"):
                    direct.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not direct
