"""Loading a scenario: reading its file, applying ``--set`` overrides, resolving the paths it names, and
validating it against the schema with errors that name the key path and its line."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Literal

import msgspec

from kvemu.errors import InvalidArgument, KvemuError
from workers.profile import cached_profile_timing
from harness.untrusted_files import trace_file_problem

from harness.scenario.schema import Scenario
from harness.scenario.sections import EngineSpec, TraceWorkload
from harness.scenario.known_traces import missing_trace_hint
from harness.yaml_validation import (
    MAX_LISTED_PROBLEMS,
    Problem,
    YamlError,
    floats_where_expected,
    key_location,
    load_yaml,
    problems_message,
    validation_problems,
    value_at,
)

__all__ = [
    "ScenarioError",
    "MAX_SCENARIO_BYTES",
    "PATH_KEYS",
    "POOL_KEYS",
    "load_scenario",
    "parse_scenario",
    "scenario_text",
    "apply_overrides",
    "paths_from_cwd",
    "default_scenario_text",
    "read_text_file",
    "resolve",
    "file_kind",
]


MAX_SCENARIO_BYTES = 1 << 20
"""Largest scenario file read."""


class ScenarioError(KvemuError, ValueError):
    """An invalid scenario; the message names the key path (and line, when known), of every problem found.

    ``problems``: those problems, one by one (at most ``MAX_LISTED_PROBLEMS`` of them), when the file was read and
    checked; None for an error before that (a file that cannot be read, not YAML, a bad ``--set``)."""

    attributes: ClassVar[tuple[str, ...]] = ("problems",)
    problems: tuple[Problem, ...] | None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides (values parsed as YAML scalars) to raw scenario data."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ScenarioError(f"--set {item!r}: expected key.path=value")
        try:
            value = load_yaml(raw, f"--set {key}").data if raw else ""
        except YamlError as exc:
            raise ScenarioError(str(exc)) from None
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ScenarioError(f"--set {key}: {part} is not a mapping")
            node = child
        node[parts[-1]] = value
    return data


def parse_scenario(text: str, *, base_dir: str | Path = ".", overrides: list[str] | None = None,
                   source: str = "<scenario>") -> Scenario:
    """Validate scenario YAML text; raises ``ScenarioError`` naming the key path and line."""
    try:
        document = load_yaml(text, source)
    except YamlError as exc:
        raise ScenarioError(str(exc)) from None
    raw, node = document.data or {}, document.node
    if not isinstance(raw, dict):
        raise ScenarioError(f"{source}: the scenario must be a mapping of sections, got {type(raw).__name__}")
    if file_kind(raw) == "sweep":
        raise ScenarioError(f"{source}: a sweep file (it has axes:), not a scenario: run it with kvemu sweep {source}")
    apply_overrides(raw, overrides or [])
    workload = raw.get("workload")
    if isinstance(workload, dict) and "kind" not in workload:  # after the overrides: they may add the section
        workload["kind"] = "trace" if "trace" in workload else "synthetic"
    overridden = {item.partition("=")[0] for item in overrides or []}
    floats_where_expected(raw, Scenario)
    raw["base_dir"] = str(base_dir)
    for where in _ENGINES:
        timing = value_at(raw, [*where, "timing_model"])[1]
        if isinstance(timing, dict) and isinstance(timing.get("path"), str) and timing["path"]:
            timing["path"] = str(_resolve_in(base_dir, timing["path"]))  # engines may run in another directory
    problems = _pool_key_problems(raw, node, overridden)
    total = len(problems)
    scenario: Scenario | None = None
    try:
        scenario = msgspec.convert(raw, Scenario, strict=True)
    except msgspec.ValidationError:
        found, count = validation_problems(raw, Scenario, node, overridden=overridden)
        if "workload.kind" in overridden and isinstance(workload, dict) and workload.get("kind") == "trace":
            found = _with_trace_hint(found)
        problems, total = problems + found, total + count
    except InvalidArgument as exc:
        raise ScenarioError(f"{source}: {exc}") from None
    file_problems = _file_problems(raw, node, base_dir, overridden)  # of the sections that converted
    problems, total = problems + file_problems, total + len(file_problems)
    if problems:
        raise ScenarioError(problems_message(source, problems, total),
                            problems=tuple(problems[:MAX_LISTED_PROBLEMS]))
    assert scenario is not None
    return scenario


def _with_trace_hint(problems: list[Problem]) -> list[Problem]:
    """``problems``, the first key of another workload kind's (which ``--set workload.kind=trace`` cannot remove)
    also saying that a trace can be run as it is."""
    first = next((i for i, p in enumerate(problems) if "belongs to workload.kind=" in p.message), None)
    if first is None:
        return problems
    hint = "; or give the trace itself as the scenario: kvemu run TRACE.jsonl"
    hinted = dataclasses.replace(problems[first], message=problems[first].message + hint)
    return [*problems[:first], hinted, *problems[first + 1:]]


def _pool_key_problems(raw: dict[str, Any], node: Any, overridden: set[str]) -> list[Problem]:
    """The aggregated pool's keys a disaggregated ``cluster`` gives (each pool has its own)."""
    cluster = raw.get("cluster")
    if not isinstance(cluster, dict) or ("prefill" not in cluster and "decode" not in cluster):
        return []
    return [Problem(f"cluster.{key}", key_location(node, ["cluster", key], overridden),
                    f"a disaggregated cluster sizes each pool: set cluster.prefill.{key} and cluster.decode.{key} "
                    "instead") for key in POOL_KEYS if key in cluster]


def _file_problems(raw: dict[str, Any], node: Any, base_dir: str | Path, overridden: set[str]) -> list[Problem]:
    """What is wrong with the files the scenario names (a timing profile, a trace), read now so that a bad one is
    refused before anything runs; only for the sections that convert (the others' problems are listed already)."""
    problems = []
    for where in _ENGINES:
        found, value = value_at(raw, where)
        try:
            engine = msgspec.convert(value, EngineSpec, strict=True) if found else None
        except msgspec.ValidationError:
            continue
        spec = msgspec.to_builtins(engine).get("timing_model") if engine is not None else None
        if isinstance(spec, dict) and spec.get("type") == "interpolated":
            try:
                cached_profile_timing(spec["path"])
            except InvalidArgument as exc:
                problems.append(Problem(f"{'.'.join(where)}.timing_model.path",
                                        key_location(node, [*where, "timing_model", "path"], overridden), str(exc)))
    workload = raw.get("workload")
    try:
        trace = msgspec.convert(workload, TraceWorkload, strict=True) \
            if isinstance(workload, dict) and workload.get("kind") == "trace" else None
    except msgspec.ValidationError:
        trace = None
    if trace is not None:
        path = _resolve_in(base_dir, trace.trace)
        problem = trace_file_problem(path)  # (a directory passes: a Weka corpus)
        if problem is not None:
            if not path.exists():  # (shown without its ../ steps: the curl command writes there)
                path = Path(os.path.normpath(path))
            hint = "" if path.exists() else missing_trace_hint(path, trace.format)
            problems.append(Problem("workload.trace", key_location(node, ["workload", "trace"], overridden),
                                    f"{problem}: {path}{hint}"))
    return problems


POOL_KEYS = ("workers", "dp_size", "engine")
"""The aggregated pool's keys of ``cluster``, which a disaggregated cluster must not give (each pool has its own)."""
_ENGINES: list[list[str]] = [["cluster", "engine"], ["cluster", "prefill", "engine"], ["cluster", "decode", "engine"]]
"""Where engine sections are in a scenario."""
PATH_KEYS = ("workload.trace", *(".".join(map(str, [*where, "timing_model", "path"])) for where in _ENGINES))
"""Scenario keys that name files (relative to the scenario file, or, given with ``--set``, to the working
directory)."""


def paths_from_cwd(overrides: list[str], cwd: str | Path | None = None) -> list[str]:
    """``--set`` overrides with the relative paths they give (``PATH_KEYS``, also inside a mapping value) made
    absolute against ``cwd`` (default: the working directory): a path typed on a command line means one from
    where it was typed, not from the scenario's folder."""
    base = Path.cwd() if cwd is None else Path(cwd)
    out = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if sep and key and raw:
            try:
                value = load_yaml(raw, f"--set {key}").data
            except YamlError:
                value = None  # apply_overrides reports it
            for path_key in PATH_KEYS:
                if path_key == key and isinstance(value, str) and value:
                    value = str(_resolve_in(base, value))
                    item = f"{key}={json.dumps(value)}"  # JSON is YAML: the path stays a string
                elif path_key.startswith(key + ".") and isinstance(value, dict):  # e.g. a whole timing_model
                    node: Any = value
                    *parents, leaf = path_key[len(key) + 1:].split(".")
                    for part in parents:
                        node = node.get(part) if isinstance(node, dict) else None
                    if isinstance(node, dict) and isinstance(node.get(leaf), str) and node[leaf]:
                        node[leaf] = str(_resolve_in(base, node[leaf]))
                        item = f"{key}={json.dumps(value)}"
        out.append(item)
    return out


_SCENARIO_KEYS = frozenset(("cluster", "router", "workload", "run", "chaos", "autoscaler"))
"""Top-level keys only a scenario has."""


def file_kind(raw: Any) -> Literal["scenario", "sweep"] | None:
    """What a parsed YAML file is by its top-level keys (a sweep has ``axes``, a scenario sections such as
    ``cluster``; None: cannot tell), so that a file given to the wrong command gets told which command it is for."""
    if not isinstance(raw, dict):
        return None
    scenario, sweep = bool(_SCENARIO_KEYS & raw.keys()), "axes" in raw
    return "scenario" if scenario and not sweep else "sweep" if sweep and not scenario else None


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    """Read and validate a scenario file, or a trace ``.jsonl`` (see ``scenario_text``)."""
    text, base_dir, source = scenario_text(path)
    return parse_scenario(text, base_dir=base_dir, overrides=overrides, source=source)


def scenario_text(path: str | Path | None) -> tuple[str, str, str]:
    """(scenario text, base dir, source) for what a command names: a scenario YAML file, a trace ``.jsonl``
    (replayed with KV routing on the default cluster and engine, named after the file) or nothing (the built-in
    quickstart). Every command that takes a scenario takes a trace the same way."""
    if path is None:
        return default_scenario_text(), str(Path.cwd()), "<built-in quickstart>"
    p = Path(path)
    if p.suffix == ".jsonl":
        if not p.is_file():
            raise ScenarioError(f"{p}: trace not found" + ("" if p.exists() else missing_trace_hint(p.absolute())))
        name = re.sub(r"[^A-Za-z0-9._-]", "-", p.stem).lstrip("._-")[:100] or "trace"
        text = msgspec.json.encode({"name": name, "router": {"policy": "kv"},
                                    "workload": {"kind": "trace", "trace": str(p.resolve())}}).decode()
        return text, str(p.resolve().parent), str(p)
    return read_text_file(p, "scenario"), str(p.resolve().parent), str(p)


def read_text_file(path: Path, what: str, limit: int | None = None) -> str:
    """The UTF-8 text of a small input file (a ``what``: scenario, sweep); ``ScenarioError`` past ``limit`` bytes
    (default ``MAX_SCENARIO_BYTES``)."""
    limit = MAX_SCENARIO_BYTES if limit is None else limit
    try:
        with path.open("rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read the {what}: {exc.strerror}") from None
    if len(data) > limit:
        raise ScenarioError(f"{path}: larger than {limit:,} bytes; is it a {what}?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ScenarioError(f"{path}: line {line}: not UTF-8 text") from None


def resolve(scenario: Scenario, path: str) -> Path:
    """A path from the scenario, resolved against its directory."""
    return _resolve_in(scenario.base_dir, path)


def _resolve_in(base_dir: str | Path, path: str) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(base_dir) / p


def default_scenario_text() -> str:
    """The built-in default scenario (also ``examples/quickstart.yaml``), shipped as package data."""
    return resources.files("harness").joinpath("quickstart.yaml").read_text(encoding="utf-8")
