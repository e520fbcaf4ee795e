"""A sweep: one base scenario run at every point of a grid (or zip) of ``--set`` overrides, for several seeds.

The sweep file is YAML, validated like a scenario (unknown keys and bad values are errors naming the key and
its line)::

    name: workers                      # names the default output directory out/<name> (default: file stem)
    base: quickstart.yaml              # a scenario, relative to this file; omitted: the built-in quickstart
    set: {run.duration_s: 120}         # overrides every point shares
    axes:                              # key.path: [values], each as ``kvemu run --set key.path=value``
      cluster.workers: [2, 4, 8]
    mode: grid                         # grid: every combination, last axis fastest; zip: the i-th values together
    seeds: 1                           # N: seeds s..s+N-1 (s = the point's run.seed), or an explicit list
    figures: [p99_ttft_ms, ...]        # summary.json keys to tabulate (dotted into the ``kvemu`` section)
    objective: {ttft_ms: 2000}         # sweep.md's chosen point: best throughput per GPU with p99 TTFT <= this
    objective: {goodput: 0.95}         # ... and (with a run.sla) >= 95 % of requests meeting it in every seed

A *run* is one (point, seed). ``plan_runs`` expands a sweep into ``PointSpec``s after validating every one of
them as ``kvemu validate`` would; ``run_point`` runs one anywhere kvemu imports (a local process, a Dask or a
Ray worker) and returns a ``PointResult``. Runs are deterministic: the same ``PointSpec`` gives the same figures on
any executor. Wall-clock figures stay apart from them (``wall_time_s``, ``run_wall_time_ms``).
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import math
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml
from msgspec import Meta

from kvemu.errors import KvemuError
from kvemu.limits import I64, MAX_PATH_CHARS, MAX_TEXT_CHARS, Finite, FilePath, Name, Text

from harness.scenario import (
    RunOrigin,
    Scenario,
    ScenarioError,
    default_scenario_text,
    parse_scenario,
    paths_from_cwd,
    read_text_file,
)
from harness.run.mode import MODES
from harness.yaml_validation import YamlError, describe_validation_error, floats_where_expected, line_of, load_yaml

__all__ = [
    "SweepError",
    "SweepSpec",
    "Objective",
    "Sweep",
    "PointSpec",
    "PointResult",
    "Status",
    "load_sweep",
    "parse_sweep",
    "plan_runs",
    "run_point",
    "point_key",
    "figure_value",
    "DEFAULT_FIGURES",
    "REPORT_FIGURES",
    "DERIVED_FIGURES",
    "MAX_RUNS",
    "MAX_SWEEP_BYTES",
    "DEFAULT_GOODPUT",
    "MAX_RESULT_FIGURES",
    "MAX_ERROR_CHARS",
    "MAX_WALL_S",
]

MAX_SWEEP_BYTES = 1 << 20
"""Largest sweep file read."""
MAX_RUNS = 10_000
"""Most runs (points x seeds) one sweep may plan."""
DEFAULT_GOODPUT = 0.95
"""``objective.goodput`` when the runs have an SLA and the sweep names none (``kvemu plan``'s default too)."""
MAX_AXES = 16
MAX_FIGURES = 64
MAX_TTFT_MS = 1e9
"""Largest ``objective.ttft_ms`` (about 11 days)."""

DERIVED_FIGURES = ("gpus", "output_throughput_tok_s_per_gpu")
"""Figures computed from the point, not read from summary.json: ``gpus`` is the cluster's DP ranks as started
(workers x dp_size summed over its pools; one GPU a rank), ``output_throughput_tok_s_per_gpu`` the output token
throughput divided by it."""
DEFAULT_FIGURES = ("completed_requests", "request_throughput_rps", "goodput_request_throughput_rps",
                   "output_throughput_tok_s", "gpus", "output_throughput_tok_s_per_gpu", "median_ttft_ms",
                   "p90_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "p99_e2e_latency_ms",
                   "prefix_cache_reused_ratio", "kvemu.failed_requests")
REPORT_FIGURES = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms",
                  "request_throughput_rps", "goodput_request_throughput_rps", "output_throughput_tok_s",
                  "gpus", "output_throughput_tok_s_per_gpu", "num_requests", "goodput_completed_requests")
"""What sweep.md's plots need: every run records these too (in sweep.json), whatever ``figures`` asks for."""
_CONDITIONAL = ("goodput_", "kvemu.cache_tiers.", "kvemu.disaggregated.", "kvemu.affinity.")
"""Summary keys that exist only for some scenarios (an SLA, a host tier, disaggregated pools, affinity on)."""

_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")

MAX_KEY_PATH_CHARS = 256
"""Longest dotted key (``router.replica_sync.delay_ms``) an axis or an override names."""
MAX_OVERRIDES = 1024
"""Most keys one sweep's ``set`` gives."""
KeyPath = Annotated[str, Meta(max_length=MAX_KEY_PATH_CHARS)]
Scalar = Annotated[str, Meta(max_length=MAX_PATH_CHARS)] | I64 | Finite | bool | None
"""A ``--set`` value: a string as long as a path, an int64, a finite float, a boolean or null."""


MAX_RESULT_FIGURES = MAX_FIGURES + len(REPORT_FIGURES)
"""Most figures one run records: those a sweep asks for and those sweep.md needs."""
MAX_ERROR_CHARS = 1 << 16
"""Longest error text a run records (a longer one is cut, ending in an ellipsis)."""
MAX_WALL_S = 1e9
"""Largest wall time (about 31 years) a run's result may state."""
MAX_AXIS_TEXT_CHARS = 16 * MAX_PATH_CHARS
"""Longest axis value as YAML text: a ``Scalar`` string with every character escaped and quoted."""
MAX_KEY_CHARS = 64
"""Longest ``PointSpec.key`` (``point_key`` gives 24 hex digits; ``kvemu plan``'s runs have none)."""
MAX_POINT = (1 << 32) - 1
"""Largest point index (a sweep plans at most ``MAX_RUNS``; ``kvemu plan`` numbers its runs across rounds)."""

Status = Literal["ok", "partial", "failed", "pending"]
"""A run's outcome: ``ok``; ``partial`` (stopped early, figures cover what finished); ``failed`` (no figures);
``pending`` (not finished yet: only in a sweep's outputs, never returned by ``run_point``)."""
Figure = Finite | I64 | bool | Text | None
"""A figure's value: a summary.json leaf (a finite number, a boolean, a text such as ``kvemu.mode``) or None."""
WallSeconds = Annotated[float, Meta(ge=0, le=MAX_WALL_S)]
WallMs = Annotated[float, Meta(ge=0, le=MAX_WALL_S * 1000)]


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters, ending in an ellipsis when cut."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


class SweepError(ScenarioError):
    """An invalid sweep file or sweep point; the message names the key (and line) or the point."""


class Objective(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """What sweep.md's chosen point must meet."""

    ttft_ms: Annotated[float, Meta(gt=0, le=MAX_TTFT_MS)] | None = None
    """Bound on the chosen point's p99 TTFT (ms)."""
    goodput: Annotated[float, Meta(gt=0, le=1)] | None = None
    """With a ``run.sla``: the share of its requests that must meet the SLA, in every seed of the chosen point
    (``goodput_completed_requests / num_requests``, as ``kvemu plan`` counts); default ``DEFAULT_GOODPUT``."""


class SweepSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """A whole sweep file (see the module docstring)."""

    axes: Annotated[dict[KeyPath, Annotated[list[Scalar], Meta(max_length=MAX_RUNS)]], Meta(max_length=MAX_AXES)]
    name: Name | None = None
    base: FilePath | None = None
    set: Annotated[dict[KeyPath, Scalar], Meta(max_length=MAX_OVERRIDES)] = {}
    mode: Literal["grid", "zip"] = "grid"
    seeds: Annotated[int, Meta(ge=1, le=MAX_RUNS)] | Annotated[list[I64], Meta(min_length=1, max_length=MAX_RUNS)] = 1
    figures: Annotated[list[Name], Meta(min_length=1, max_length=MAX_FIGURES)] = msgspec.field(
        default_factory=lambda: list(DEFAULT_FIGURES))
    objective: Objective = Objective()


class Sweep(msgspec.Struct, kw_only=True, frozen=True):
    """A validated sweep file with its base scenario's text."""

    spec: SweepSpec
    name: str
    source: str
    """The sweep file (for messages)."""
    base_text: str
    base_dir: str
    """Directory the base scenario's relative paths resolve against."""
    base_source: str
    sweep_dir: str = "."
    """Directory the relative paths in the sweep's own ``set`` and ``axes`` resolve against (the file's)."""

    @property
    def axes(self) -> list[str]:
        """The axis keys, in file order."""
        return list(self.spec.axes)

    @property
    def points(self) -> int:
        """How many points (axis combinations)."""
        lengths = [len(v) for v in self.spec.axes.values()]
        return math.prod(lengths) if self.spec.mode == "grid" else lengths[0]

    @property
    def seeds_per_point(self) -> int:
        return self.spec.seeds if isinstance(self.spec.seeds, int) else len(self.spec.seeds)


class PointSpec(msgspec.Struct, kw_only=True, frozen=True):
    """One run of a sweep: a scenario (YAML text plus ``key=value`` overrides) and a seed; all ``run_point`` needs.

    Plain and picklable, so any executor can ship it. ``report_dir`` (an absolute path where the run executes)
    writes the run's full report there; ``key`` identifies the resolved scenario and seed (``point_key``).
    """

    point: int
    seed: int
    scenario_text: str
    base_dir: str = "."
    overrides: list[str] = []
    axes: dict[str, str] = {}
    """Axis key -> the value's YAML text (as in ``overrides`` and sweep.csv)."""
    figures: list[str] = msgspec.field(default_factory=lambda: list(REPORT_FIGURES))
    report_dir: str | None = None
    source: str = "<scenario>"
    key: str = ""

    def scenario(self) -> Scenario:
        """The run's validated scenario (its overrides, then ``run.seed``)."""
        return parse_scenario(self.scenario_text, base_dir=self.base_dir, overrides=self._overrides(),
                              source=self.source)

    def origin(self) -> RunOrigin:
        """What ``scenario`` is built from, for the point's report."""
        return RunOrigin.of("kvemu sweep", self.source, self._overrides())

    def _overrides(self) -> list[str]:
        return [*self.overrides, f"run.seed={self.seed}"]


class PointResult(msgspec.Struct, kw_only=True, frozen=True):
    """One run's result, as ``run_point`` returns it, every executor carries it back and sweep-log.jsonl holds it.

    Every field is bounded: a result read back from an earlier sweep's files (untrusted: any program may have
    written them) is decoded against this type, and one past a bound is refused, naming the field. Field order
    is plan.json's (``kvemu plan`` embeds its runs); sweep-log.jsonl and sweep.json sort the keys.
    """

    point: Annotated[int, Meta(ge=0, le=MAX_POINT)]
    seed: I64
    axes: Annotated[dict[KeyPath, Annotated[str, Meta(max_length=MAX_AXIS_TEXT_CHARS)]], Meta(max_length=MAX_AXES)] = {}
    """Axis key -> the value's YAML text (as ``PointSpec.axes``)."""
    key: Annotated[str, Meta(max_length=MAX_KEY_CHARS)] = ""
    status: Status = "failed"
    error: Annotated[str, Meta(max_length=MAX_ERROR_CHARS)] | None = None
    figures: Annotated[dict[Name, Figure], Meta(max_length=MAX_RESULT_FIGURES)] = {}
    """Figure name -> value, None where the summary has none (every figure the run was asked for)."""
    wall_time_s: WallSeconds | None = None
    """This call's wall time (depends on the machine, as ``run_wall_time_ms``)."""
    run_wall_time_ms: WallMs | None = None
    """The run's own wall time (summary.json's ``wall_time_ms``)."""

    @classmethod
    def failed(cls, run: PointSpec, error: str) -> PointResult:
        """``run`` failed with ``error`` (cut to ``MAX_ERROR_CHARS``): no figures."""
        return cls(point=run.point, seed=run.seed, axes=dict(run.axes), key=run.key, status="failed",
                   error=clip(error), figures=dict.fromkeys(run.figures))

    @classmethod
    def pending(cls, run: PointSpec) -> PointResult:
        """``run`` has not finished (a placeholder in a sweep's outputs)."""
        return cls(point=run.point, seed=run.seed, axes=dict(run.axes), key=run.key, status="pending")

    def relabel(self, run: PointSpec) -> PointResult:
        """This result under ``run``'s numbering (a resumed sweep's file may number its points otherwise)."""
        return msgspec.structs.replace(self, point=run.point, seed=run.seed, axes=dict(run.axes))

    def checked(self) -> PointResult:
        """This result if every field is within its bounds (construction does not check them); else
        ``msgspec.ValidationError`` naming the field."""
        return msgspec.convert(msgspec.to_builtins(self), PointResult)


# ---------------------------------------------------------------------------------- loading


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> Sweep:
    """Read and validate a sweep file (its base scenario is read, not yet validated: ``plan_runs`` does that).

    ``overrides`` (``key.path=value``, as ``--set``) join the file's ``set``, replacing its values."""
    p = Path(path)
    try:
        text = read_text_file(p, "sweep", MAX_SWEEP_BYTES)
    except ScenarioError as exc:
        raise SweepError(str(exc)) from None
    return parse_sweep(text, base_dir=p.resolve().parent, source=str(p), default_name=p.stem, overrides=overrides)


def parse_sweep(text: str, *, base_dir: str | Path = ".", source: str = "<sweep>", default_name: str = "sweep",
                overrides: list[str] | None = None) -> Sweep:
    """Validate sweep YAML text (plus ``overrides`` of its ``set``); ``SweepError`` names the key and line."""
    if len(text.encode()) > MAX_SWEEP_BYTES:
        raise SweepError(f"{source}: larger than {MAX_SWEEP_BYTES:,} bytes; is it a sweep?")
    try:
        document = load_yaml(text, source)
    except YamlError as exc:
        raise SweepError(str(exc)) from None
    raw, node = document.data, document.node
    if not isinstance(raw, dict):
        raise SweepError(f"{source}: a sweep is a mapping (base, set, axes, mode, seeds, figures, objective), "
                         f"got {type(raw).__name__}")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SweepError(f"--set {item!r}: expected key.path=value")
        if not isinstance(raw.get("set"), dict):
            raw["set"] = {}
        try:
            raw["set"][key] = load_yaml(value, f"--set {key}").data if value else ""
        except YamlError as exc:
            raise SweepError(str(exc)) from None
    if isinstance(raw.get("objective"), dict):  # set and axes values reach the scenario as text, read there
        floats_where_expected(raw["objective"], Objective)
    try:
        spec = msgspec.convert(raw, SweepSpec, strict=True)
    except msgspec.ValidationError as exc:
        raise SweepError(describe_validation_error(exc, raw, node, source)) from None

    def fail(path: list[str | int], message: str) -> SweepError:
        line = line_of(node, path)
        at = f" (line {line})" if line else ""
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
        return SweepError(f"{source}: {key}{at}: {message}")

    _check_keys(spec, fail)
    if spec.mode == "zip":
        first, *rest = spec.axes.items()
        for key, values in rest:
            if len(values) != len(first[1]):
                raise fail(["axes", key], f"mode zip needs axes of equal length: {len(values)} values here, "
                                          f"{len(first[1])} for {first[0]}")
    seeds = spec.seeds if isinstance(spec.seeds, int) else len(spec.seeds)
    if not isinstance(spec.seeds, int) and len(set(spec.seeds)) != len(spec.seeds):
        raise fail(["seeds"], "a seed is listed twice")
    lengths = [len(v) for v in spec.axes.values()]
    points = math.prod(lengths) if spec.mode == "grid" else lengths[0]
    if points * seeds > MAX_RUNS:
        raise fail(["axes"], f"{points:,} points x {seeds:,} seeds = {points * seeds:,} runs, more than the "
                             f"{MAX_RUNS:,} a sweep may plan; split it")
    _check_figures(spec.figures, fail)
    name = spec.name if spec.name is not None else default_name
    if not _NAME.fullmatch(name):
        raise fail(["name"], f"{name!r} is not a plain name (letters, digits, '.', '_', '-'; it names the "
                             "output directory)" + ("" if spec.name is not None else ": set name"))
    if spec.base is None:
        base_text, base_source, base = default_scenario_text(), "<built-in quickstart>", Path(base_dir)
    else:
        path = Path(spec.base).expanduser()
        path = path if path.is_absolute() else Path(base_dir) / path
        try:
            base_text = read_text_file(path, "scenario")
        except ScenarioError as exc:
            raise fail(["base"], str(exc)) from None
        base_source, base = str(path), path.resolve().parent
    return Sweep(spec=spec, name=name, source=source, base_text=base_text, base_dir=str(base),
                 base_source=base_source, sweep_dir=str(Path(base_dir).resolve()))


Fail = Callable[[list[str | int], str], SweepError]
"""``fail(path, message)``: the error naming the sweep file's key at ``path`` (and its line)."""


def _check_keys(spec: SweepSpec, fail: Fail) -> None:
    if not spec.axes:
        raise fail(["axes"], "give at least one axis (key.path: [values])")
    if len(spec.axes) > MAX_AXES:
        raise fail(["axes"], f"{len(spec.axes)} axes, more than {MAX_AXES}")
    keys = [("axes", k) for k in spec.axes] + [("set", k) for k in spec.set]
    for key, values in spec.axes.items():
        if not values:
            raise fail(["axes", key], "give at least one value")
    for section, key in keys:
        if not _KEY.fullmatch(key):
            raise fail([section, key], "not a key path (names joined by '.', as in --set cluster.workers=8)")
    for (section, key), (other_section, other) in itertools.combinations(keys, 2):
        if key == other or other.startswith(key + ".") or key.startswith(other + "."):
            raise fail([other_section, other], f"overlaps {section}.{key}: a key may be set once")


def _check_figures(figures: list[str], fail: Fail) -> None:
    known = _summary_keys()
    for i, name in enumerate(figures):
        if figures.index(name) != i:
            raise fail(["figures", i], f"{name!r} is listed twice")
        if name in known or name in DERIVED_FIGURES or name.startswith(_CONDITIONAL):
            if known.get(name) == "section":
                raise fail(["figures", i], f"{name!r} is a section of summary.json: name one of its keys")
            continue
        close = difflib.get_close_matches(name, [*known, *DERIVED_FIGURES], n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise fail(["figures", i], f"{name!r} is not a summary.json key{hint}")


_KNOWN: dict[str, str] | None = None


def _summary_keys() -> dict[str, str]:
    """Every dotted key of an (empty) run's summary.json -> ``value`` or ``section``."""
    global _KNOWN
    if _KNOWN is None:
        from harness.report.run_data import RunData
        from harness.report.summary import summarize

        known: dict[str, str] = {}

        def walk(node: dict[str, object], prefix: str) -> None:
            for key, value in node.items():
                known[prefix + key] = "section" if isinstance(value, (dict, list)) else "value"
                if isinstance(value, dict):
                    walk(value, f"{prefix}{key}.")

        walk(summarize(RunData()).to_builtins(), "")
        _KNOWN = known
    return _KNOWN


# ---------------------------------------------------------------------------------- planning


def _yaml_text(value: Scalar) -> str:
    """A YAML scalar as ``--set`` reads it back (``8``, ``kv``, ``'8'`` for the string)."""
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 30).removesuffix("\n...\n").strip()


def point_key(scenario: Scenario) -> str:
    """A run's identity: a hash of its fully resolved scenario (seed and base directory included)."""
    return hashlib.sha256(msgspec.json.encode(scenario)).hexdigest()[:24]


def _combinations(spec: SweepSpec) -> list[dict[str, str]]:
    texts = {key: [_yaml_text(v) for v in values] for key, values in spec.axes.items()}
    rows: Iterable[tuple[str, ...]]
    if spec.mode == "zip":
        rows = zip(*texts.values())
    else:
        rows = itertools.product(*texts.values())
    return [dict(zip(texts, row)) for row in rows]


def plan_runs(sweep: Sweep, *, reports: Path | None = None) -> list[PointSpec]:
    """Every run of ``sweep`` by point then seed, each validated first as ``kvemu validate`` does.

    ``SweepError`` names the first point (and its axis values) that would fail. ``reports`` (a directory)
    makes each run write its full report to ``reports/<point>-seed<seed>/``.
    """
    spec = sweep.spec
    fixed = [f"{k}={_yaml_text(v)}" for k, v in spec.set.items()]
    checks = _Checks()
    runs: list[PointSpec] = []
    combos = _combinations(spec)
    width = len(str(len(combos) - 1))
    for index, axes in enumerate(combos):
        # a path written in the sweep file means one from the sweep file, wherever its base scenario is
        overrides = paths_from_cwd(fixed + [f"{k}={v}" for k, v in axes.items()], cwd=sweep.sweep_dir)
        where = f"{sweep.source}: point {index} ({', '.join(f'{k}={v}' for k, v in axes.items())})"
        try:
            scenario = parse_scenario(sweep.base_text, base_dir=sweep.base_dir, overrides=overrides,
                                      source=sweep.base_source)
            checks.check(scenario)
        except (KvemuError, ValueError) as exc:  # a scenario error, or a router or engine part that won't build
            raise SweepError(f"{where}: {exc}") from None
        seeds = (range(scenario.run.seed, scenario.run.seed + spec.seeds) if isinstance(spec.seeds, int)
                 else spec.seeds)
        for seed in seeds:
            resolved = msgspec.structs.replace(scenario, run=msgspec.structs.replace(scenario.run, seed=seed))
            report_dir = str((reports / f"{index:0{width}d}-seed{seed}").absolute()) if reports else None
            runs.append(PointSpec(point=index, seed=seed, scenario_text=sweep.base_text, base_dir=sweep.base_dir,
                                  overrides=overrides, axes=axes, figures=_all_figures(spec.figures),
                                  report_dir=report_dir, source=sweep.base_source, key=point_key(resolved)))
    return runs


def _all_figures(requested: list[str]) -> list[str]:
    return list(dict.fromkeys([*requested, *REPORT_FIGURES]))


class _Checks:
    """What ``kvemu validate`` checks beyond parsing, done once per distinct part of the points' scenarios."""

    def __init__(self) -> None:
        self.seen: set[bytes] = set()

    def _once(self, *parts: object) -> bool:
        key = msgspec.json.encode(parts)
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def check(self, scenario: Scenario) -> None:
        from harness.run.factories import check_buildable, make_policy
        from harness.workload.build import build_sessions

        if MODES[scenario.run.mode].shares_the_machine:
            raise SweepError("run.mode: a sweep runs virtual time only (parallel live runs would share the wall "
                             "clock and the machine's ports, and their results would depend on each other)")
        if self._once("policy", scenario.router.policy):
            make_policy(scenario.router.policy)
        if self._once("build", scenario.cluster, scenario.router):
            check_buildable(scenario)
        run = msgspec.structs.replace(scenario.run, seed=0)  # a workload's validity does not depend on the seed
        if self._once("sessions", scenario.workload, run, scenario.base_dir, scenario.cluster.workers):
            build_sessions(scenario)


# ---------------------------------------------------------------------------------- running


def figure_value(summary: dict[str, object], name: str, gpus: int | None = None) -> Figure:
    """A figure of a run: a (dotted) summary.json key, or a ``DERIVED_FIGURES`` name; None where absent (a text
    longer than a figure may hold is cut)."""
    if name == "gpus":
        return gpus
    if name == "output_throughput_tok_s_per_gpu":
        throughput = summary.get("output_throughput_tok_s")
        return float(f"{throughput / gpus:.6g}") if isinstance(throughput, (int, float)) and gpus else None
    node: object = summary
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if isinstance(node, str):
        return clip(node, MAX_TEXT_CHARS)
    return node if isinstance(node, (int, float)) else None  # (a section: None; bool is an int)


def run_point(point: PointSpec) -> PointResult:
    """Run one point in virtual time and return its ``PointResult``; a failing run does not raise.

    ``point``, ``seed``, ``axes``, ``key`` come from the spec; ``status`` is ``ok``, ``partial`` (the run stopped
    early, figures cover what finished) or ``failed`` (no figures), ``error`` the text or None, ``figures``
    every figure asked for; ``wall_time_s`` (this call) and ``run_wall_time_ms`` (the run's own wall time) are
    the only fields that depend on the machine.
    """
    from harness.run.pools import pool_sizes
    from harness.report.summary import summarize
    from harness.run.runner import RunAborted, run_scenario

    started = time.perf_counter()
    result = PointResult.failed(point, "")
    try:
        scenario = point.scenario()
        if MODES[scenario.run.mode].shares_the_machine:
            raise SweepError("run.mode: a sweep runs virtual time only")
        outcome = run_scenario(scenario, Path(point.report_dir) if point.report_dir else None, origin=point.origin())
        summary = outcome.summary if outcome.summary is not None else summarize(outcome.data)
        gpus = sum(p["workers"] * p["dp_size"] for p in pool_sizes(scenario.cluster).values())
        figures = summary.to_builtins()  # (figures are named by their dotted summary.json keys)
        result = msgspec.structs.replace(
            result, figures={name: figure_value(figures, name, gpus) for name in point.figures},
            run_wall_time_ms=summary.wall_time_ms, status="partial" if outcome.data.partial else "ok",
            error=clip(f"stopped early: {outcome.data.stop_reason}") if outcome.data.partial else None)
    except RunAborted as exc:
        result = PointResult.failed(point, str(exc))
    except Exception as exc:  # noqa: BLE001 - one point's failure is its result, not the sweep's
        result = PointResult.failed(point, f"{type(exc).__name__}: {exc}")
    return msgspec.structs.replace(result, wall_time_s=round(time.perf_counter() - started, 6))
