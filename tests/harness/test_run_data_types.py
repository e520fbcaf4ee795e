"""The run -> report path is typed: nothing reachable from ``RunData`` (what the runner and the load generators hand
the report) or from ``Summary`` (what the report hands summary.json, the sweep and the CLI) is ``Any``, so no
``dict[str, Any]`` read by string key crosses from one room to the next (issue #45, "Types across every room")."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated, Any, get_args, get_origin, get_type_hints

import msgspec
import pytest

from harness.report.run_data import RunData
from harness.report.summary_types import Summary


def untyped(tp: Any, where: str, seen: set[type] | None = None) -> list[str]:
    """Where ``Any`` occurs in ``tp``: its own arguments (``dict[str, Any]``...) and, for a struct or dataclass,
    each field's type, walked down to the leaves (``RunData.worker_events[]``, ``AutoscaleLog.config{}``...)."""
    seen = set() if seen is None else seen
    if tp is Any:
        return [where]
    origin = get_origin(tp)
    if origin is Annotated:
        return untyped(get_args(tp)[0], where, seen)
    if origin in (typing.Union, types.UnionType):
        return [w for arg in get_args(tp) for w in untyped(arg, where, seen)]
    if origin is not None:
        suffix = "{}" if origin is dict else "[]"
        return [w for arg in get_args(tp) if arg is not Ellipsis for w in untyped(arg, where + suffix, seen)]
    if isinstance(tp, type) and (issubclass(tp, msgspec.Struct) or dataclasses.is_dataclass(tp)) and tp not in seen:
        seen.add(tp)
        return [w for name, field in get_type_hints(tp, include_extras=True).items()
                for w in untyped(field, f"{tp.__name__}.{name}", seen)]
    return []


@pytest.mark.parametrize("root", [RunData, Summary])
def test_nothing_the_report_is_made_of_is_any(root):
    assert untyped(root, root.__name__) == []


class _Row(msgspec.Struct):
    data: dict[str, Any]


class _Outer(msgspec.Struct):
    rows: list[_Row] | None
    extra: Annotated[list[Any], msgspec.Meta(max_length=4)]


def test_the_walk_finds_an_any_field_at_any_depth():
    assert untyped(_Outer, "_Outer") == ["_Row.data{}", "_Outer.extra[]"]
