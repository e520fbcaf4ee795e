"""What a report ran: the resolved scenario written beside it (scenario.yaml, which ``kvemu run`` and ``validate``
load again), its "What ran" lines in report.md (workload, engines, timing source, overrides), and what differs
between two reports' scenarios (``kvemu compare``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import yaml

from workers.config import EngineConfig, InterpolatedTimingSpec

from harness.scenario import BUILT_IN, RunOrigin, Scenario, TraceWorkload, read_text_file, resolve
from harness.text import counted

__all__ = ["SCENARIO_FILE", "scenario_document", "scenario_yaml", "what_ran_lines", "timing_source",
           "read_scenario_document", "scenario_differences", "decisions_as"]

SCENARIO_FILE = "scenario.yaml"
"""The resolved scenario's file in a report's directory."""


def _plain(value: Any) -> Any:
    """A scenario part as YAML data: every field (defaults filled), a tagged section's tag, and no optional part
    that is left out (a None whose default is None: the loader reads its absence the same way, while some refuse
    it written, e.g. ``cluster.prefill: null`` beside ``cluster.workers``)."""
    if isinstance(value, msgspec.Struct):
        out: dict[str, Any] = {}
        config = value.__struct_config__
        if config.tag_field is not None:
            out[config.tag_field] = config.tag
        for field in msgspec.structs.fields(value):
            item = getattr(value, field.name)
            if item is None and field.default is None:
                continue
            out[field.encode_name] = _plain(item)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return msgspec.to_builtins(value)


def scenario_document(scenario: Scenario) -> dict[str, Any]:
    """``scenario`` as the YAML mapping that loads back to it from any directory: every default filled, the trace
    path absolute, no ``base_dir`` (the loader sets it), and a disaggregated cluster without the aggregated pool's
    keys (the loader refuses them beside ``prefill`` and ``decode``)."""
    doc: dict[str, Any] = _plain(scenario)
    doc.pop("base_dir", None)
    if isinstance(scenario.workload, TraceWorkload):
        doc["workload"]["trace"] = os.path.abspath(resolve(scenario, scenario.workload.trace))
    if scenario.cluster.disaggregated:
        for key in ("workers", "dp_size", "engine"):
            doc["cluster"].pop(key, None)
    return doc


def scenario_yaml(scenario: Scenario, origin: RunOrigin | None) -> str:
    """scenario.yaml: a comment saying what it is and how to run it again, then ``scenario_document``."""
    source = _comment(origin.source) if origin is not None else "a scenario given in Python"
    sets = "".join(f"\n#   --set {_comment(str(o))}" for o in origin.overrides) if origin is not None else ""
    head = (f"# The scenario this report ran, resolved: {source}"
            + (f", with these overrides applied:{sets}\n# " if sets else ", ")
            + "and every default filled in.\n"
            f"# Run it again: {_rerun(origin)} {SCENARIO_FILE} -o OUTDIR (kvemu validate checks it).\n")
    return head + yaml.safe_dump(scenario_document(scenario), sort_keys=False, allow_unicode=True, width=100)


def _comment(text: str) -> str:
    """``text`` for one YAML comment line: a line break or other control character in a file name or a ``--set``
    value is escaped, so it cannot end the comment and add keys to the scenario."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _rerun(origin: RunOrigin | None) -> str:
    """The command that runs a report's scenario.yaml again as it ran: ``kvemu up`` for its processes, else
    ``kvemu run`` (a load generator's or a router bench's needs their servers)."""
    return "kvemu up" if origin is not None and origin.command == "kvemu up" else "kvemu run"


def timing_source(engine: Any) -> str:
    """Where an engine's pass times come from, in words a reader of the report takes at their worth."""
    spec = engine.timing_model
    if isinstance(spec, InterpolatedTimingSpec):
        text = (f"the profile `{spec.path}`: measured points, interpolated as Dynamo's mocker does "
                "(docs/profiles.md)")
    else:
        text = ("a polynomial from Dynamo's mocker (prefill quadratic in new tokens, decode in KV occupancy), not a "
                "measured GPU")
    if engine.speedup_ratio == 0:
        return text + "; speedup_ratio 0: passes take no time"
    if engine.speedup_ratio != 1 or engine.decode_speedup_ratio != 1:
        text += f"; every pass {engine.speedup_ratio:g}× faster"
        if engine.decode_speedup_ratio != 1:
            text += f", decode another {engine.decode_speedup_ratio:g}×"
    return text


def _params(doc: dict[str, Any]) -> str:
    """``key value, key value`` of a mapping, nested mappings in braces."""
    parts = []
    for key, value in doc.items():
        shown = "{" + _params(value) + "}" if isinstance(value, dict) else f"`{value}`" if key == "trace" else value
        parts.append(f"{key} {shown}")
    return ", ".join(parts)


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def what_ran_lines(scenario: Scenario, origin: RunOrigin | None) -> list[str]:
    """report.md's "What ran" beyond the run's shape: where the scenario came from and its overrides, the workload
    and its parameters, the router's policy, each pool's engine and its timing source."""
    out = []
    if origin is not None:
        source = "the built-in quickstart" if origin.source == BUILT_IN else f"`{origin.source}`"
        out.append(f"- `{origin.command}` on {source}; the scenario as it ran, overrides applied and defaults filled: "
                   f"[{SCENARIO_FILE}]({SCENARIO_FILE}) (`{_rerun(origin)} {SCENARIO_FILE}` runs it again)")
        given = ", ".join(f"`{o}`" for o in origin.overrides)
        out.append(f"- overrides (`--set`): {given or 'none'}")
    workload = scenario_document(scenario)["workload"]
    kind = workload.pop("kind")
    out.append(f"- workload: {kind}: {_params(workload)}")
    router = scenario.router
    out.append(f"- router: policy `{router.policy}`" + (f", {router.replicas} replicas ({router.replica_front})"
                                                        if router.replicas > 1 else ""))
    run = scenario.run
    stops = [f"after {run.duration_s:g} s of arrivals" if run.duration_s is not None else "",
             f"after {counted(run.max_requests, 'request')}" if run.max_requests is not None else ""]
    out.append(f"- run: {run.mode} time, seed {run.seed}" + "".join(f", stops {s}" for s in stops if s))
    out += ["", "Engines:", "", "| pool | workers | dp_size | backend | decisions as | block_size | num_gpu_blocks | "
            "speedup (all, decode) | pass timing |", "|---|---|---|---|---|---|---|---|---|"]
    for pool, (workers, dp_size, engine) in scenario.cluster.pools().items():
        out.append(f"| {pool} | {workers} | {dp_size} | {engine.backend} | {decisions_as(engine)} | "
                   f"{engine.block_size} | {engine.num_gpu_blocks:,} | "
                   f"{engine.speedup_ratio:g}, {engine.decode_speedup_ratio:g} | {_cell(timing_source(engine))} |")
    return out


def decisions_as(engine: EngineConfig) -> str:
    """Whose scheduling decisions an engine reproduces, and which version (``engine.vllm.semantics``,
    ``engine.sglang.semantics``)."""
    vllm = engine.vllm
    if engine.backend == "vllm" and vllm.semantics == "vllm-0.34":
        return f"vLLM 0.34.0 ({'async' if vllm.async_scheduling else 'sync'}, {vllm.scheduling_policy})"
    if engine.backend == "sglang" and engine.sglang.semantics == "sglang-0.5.23":
        return f"SGLang 0.5.23 (non-overlap loop, {engine.sglang.schedule_policy})"
    return "Dynamo 1.6.1's mocker"


def read_scenario_document(outdir: Path) -> dict[str, Any] | None:
    """The scenario.yaml of a report directory as data; None when there is none (a report of an earlier kvemu)
    or it is not a mapping."""
    path = Path(outdir) / SCENARIO_FILE
    if not path.is_file():
        return None
    from harness.yaml_validation import YamlError, load_yaml

    try:  # bounded as every YAML kvemu reads (a report folder is someone else's file too)
        data = load_yaml(read_text_file(path, "scenario"), str(path)).data
    except (YamlError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def _flat(doc: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key paths to values (lists stay whole: a chaos timeline differs as a whole)."""
    if not isinstance(doc, dict):
        return {prefix: doc}
    out: dict[str, Any] = {}
    for key, value in doc.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def scenario_differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Every key path whose value differs between two scenario documents: (key, A's value, B's value), in A's
    order then B's new keys; a key one side lacks shows as "—"."""
    fa, fb = _flat(a), _flat(b)

    def shown(doc: dict[str, Any], key: str) -> str:
        return "—" if key not in doc else yaml.safe_dump(doc[key], default_flow_style=True, width=1 << 20).strip() \
            .removesuffix("...").strip()

    return [(key, shown(fa, key), shown(fb, key)) for key in dict.fromkeys([*fa, *fb])
            if fa.get(key, _MISSING) != fb.get(key, _MISSING)]


_MISSING = object()
