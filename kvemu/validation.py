"""Range checks declared once, as ``msgspec.Meta`` constraints, and enforced on every path.

Decoding (a scenario file, a wire message) checks a struct's ``Meta`` constraints already; a struct built
in Python does not. ``check_struct`` applies the same declared constraints to a built struct (call it
from ``__post_init__``), and also rejects NaN and infinite floats, which no knob of kvemu accepts. The
error names the field and the bound, so one declaration gives one message on both paths.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from typing import Any

import msgspec
import msgspec.inspect as mi

from kvemu.errors import InvalidArgument

__all__ = ["check_struct"]

_BOUNDS: tuple[tuple[str, str, Callable[[float, float], bool]], ...] = (
    ("gt", ">", operator.gt), ("ge", ">=", operator.ge), ("lt", "<", operator.lt), ("le", "<=", operator.le))
_PLANS: dict[type, list[tuple[str, tuple[mi.Type, ...]]]] = {}


def _plan(cls: type) -> list[tuple[str, tuple[mi.Type, ...]]]:
    plan = _PLANS.get(cls)
    if plan is None:
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        plan = _PLANS[cls] = [
            (f.name, f.type.types if isinstance(f.type, mi.UnionType) else (f.type,)) for f in info.fields
        ]
    return plan


def _accepts(t: mi.Type, value: Any) -> bool:
    if isinstance(t, mi.NoneType):
        return value is None
    if isinstance(t, mi.BoolType):
        return isinstance(value, bool)
    if isinstance(t, mi.IntType):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(t, mi.FloatType):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(t, mi.StrType):
        return isinstance(value, str)
    if isinstance(t, mi.LiteralType):
        return value in t.values
    if isinstance(t, (mi.ListType, mi.TupleType, mi.VarTupleType)):
        return isinstance(value, (list, tuple))
    return True  # other containers and structs: their own types check them


def _describe(types: tuple[mi.Type, ...]) -> str:
    names = []
    for t in types:
        if isinstance(t, mi.LiteralType):
            names.append(" or ".join(repr(v) for v in t.values))
        else:
            names.append({mi.NoneType: "null", mi.BoolType: "a bool", mi.IntType: "an integer",
                          mi.FloatType: "a number", mi.StrType: "a string"}.get(type(t), type(t).__name__))
    return " or ".join(names)


def check_struct(obj: msgspec.Struct) -> None:
    """Raise ``InvalidArgument`` naming the first field of ``obj`` that breaks its declared type or bounds
    (a list of numbers: each item's)."""
    for name, types in _plan(type(obj)):
        value = getattr(obj, name)
        t = next((t for t in types if _accepts(t, value)), None)
        if t is None:
            raise InvalidArgument(f"{name} must be {_describe(types)}, got {value!r}", field=name)
        if isinstance(t, (mi.ListType, mi.VarTupleType)) and isinstance(t.item_type, (mi.IntType, mi.FloatType)):
            for i, item in enumerate(value):
                _check_value(f"{name}[{i}]", name, (t.item_type,), item)
            continue
        _check_value(name, name, types, value, t)


def _check_value(label: str, name: str, types: tuple[mi.Type, ...], value: Any, t: mi.Type | None = None) -> None:
    """Check one value (a field's, or ``label`` an item of it) against the first of ``types`` it is."""
    if t is None:
        t = next((t for t in types if _accepts(t, value)), None)
        if t is None:
            raise InvalidArgument(f"{label} must be {_describe(types)}, got {value!r}", field=name)
    if isinstance(t, mi.FloatType) and not math.isfinite(value):
        raise InvalidArgument(f"{label} must be a finite number, got {value!r}", field=name)
    if isinstance(t, (mi.IntType, mi.FloatType)):
        for attr, op, ok in _BOUNDS:
            bound = getattr(t, attr)
            if bound is not None and not ok(value, bound):
                raise InvalidArgument(f"{label} must be {op} {bound}, got {value!r}", field=name)
    if isinstance(t, mi.StrType) and t.pattern is not None and not re.search(t.pattern, value):
        raise InvalidArgument(f"{label} must match {t.pattern}, got {value!r}", field=name)
