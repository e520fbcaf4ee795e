"""The scenario file: a cluster, a router, a workload, how to run it, and what to break.

Every field is typed (msgspec) and documented with its default. Loading rejects unknown keys, wrong
types, out-of-range values and missing files with an error naming the key path and its line; nothing
runs on an invalid scenario. ``--set key.path=value`` overrides are applied before validation.

``sections`` holds each section's fields and checks, ``schema`` the whole scenario and the checks across
sections, ``loading`` reading, overriding and validating a file, ``origin`` what a run's scenario was built from
(its file and overrides); this package re-exports their public names.
"""

from harness.scenario import loading, origin, schema, sections
from harness.scenario.loading import (
    MAX_SCENARIO_BYTES,
    PATH_KEYS,
    POOL_KEYS,
    ScenarioError,
    apply_overrides,
    default_scenario_text,
    file_kind,
    load_scenario,
    parse_scenario,
    paths_from_cwd,
    read_text_file,
    resolve,
    scenario_text,
)
from harness.scenario.origin import BUILT_IN, Override, RunOrigin
from harness.scenario.schema import MAX_SYNTHETIC_TOKENS, Scenario
from harness.scenario.sections import (
    CHAOS_TARGETS,
    MAX_DP_SIZE,
    MAX_RANKS,
    MAX_REQUESTS,
    MAX_SCENARIO_NS,
    MAX_SCENARIO_S,
    MAX_WORKERS,
    AffinitySpec,
    AutoscalerSpec,
    ChaosAction,
    ChaosEvent,
    ChaosTargets,
    ClusterSpec,
    Count,
    Distribution,
    EngineSpec,
    Index,
    LanesSpec,
    NonNeg,
    PoolSpec,
    Positive,
    PositiveSeconds,
    RouterSpec,
    RunSpec,
    Seconds,
    SyntheticWorkload,
    Tokens,
    TraceWorkload,
)
from harness.yaml_validation import describe_validation_error, floats_where_expected, line_of

__all__ = [  # spelt out: mypy reads only a literal list (the test holds it equal to the modules' lists)
    "EngineSpec", "ChaosAction", "ChaosTargets", "CHAOS_TARGETS", "PoolSpec", "ClusterSpec", "AffinitySpec",
    "RouterSpec", "Distribution", "SyntheticWorkload", "TraceWorkload", "LanesSpec", "RunSpec", "ChaosEvent",
    "AutoscalerSpec", "MAX_WORKERS", "MAX_DP_SIZE", "MAX_RANKS", "MAX_SCENARIO_S", "MAX_SCENARIO_NS",
    "MAX_REQUESTS", "Count", "Index", "NonNeg", "Positive", "Seconds", "PositiveSeconds", "Tokens", "Scenario",
    "MAX_SYNTHETIC_TOKENS", "ScenarioError", "MAX_SCENARIO_BYTES", "PATH_KEYS", "POOL_KEYS", "load_scenario",
    "parse_scenario", "scenario_text", "apply_overrides", "paths_from_cwd", "default_scenario_text",
    "read_text_file", "resolve", "file_kind", "Override", "RunOrigin", "BUILT_IN", "floats_where_expected",
    "describe_validation_error", "line_of"
]
