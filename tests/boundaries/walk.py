"""Find the types kvemu decodes from bytes or files, and every field of them without a declared bound.

The decode sites are found in the source (``msgspec.*.Decoder(T)``, ``msgspec.*.decode(..., type=T)``,
``msgspec.convert(x, T)``, ``decode_body(body, T)``), so a message added to a union a decoder takes, or a new
decoder, is walked without anyone listing it. ``unbounded(T)`` walks ``T`` through structs, unions, optionals,
lists, tuples and dicts and names each leaf that takes an unbounded value: an integer without both ends, a
float without both (msgspec takes ``inf``/``nan`` otherwise), a string, bytes or container without a
``max_length``, and ``Any``.
"""

from __future__ import annotations

import ast
import functools
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from kvemu.limits import U64_WIRE, WIRE_RANGE

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvemu", "harness", "workers")
MSGPACK_FED = {"kvemu.wire.codec": "its msgspec.convert calls take what its own msgpack decoder gave (the generic "
                                    "path): integers within msgpack's 64 bits"}
OWN_FIGURES: dict[tuple[str, str], str] = {}
"""Conversions of a process's own values into a typed record, not decodes of what crosses a boundary (none now:
``summarize`` builds its ``Summary`` directly instead of converting a dict)."""


@dataclass(frozen=True)
class Site:
    """One place the code decodes bytes (or converts loaded data) into a type."""

    module: str
    line: int
    call: str
    expr: str
    """The type expression as written."""
    type: Any
    """What it names (None: a name that is not a module-level value, e.g. a parameter)."""

    @property
    def msgpack(self) -> bool:
        """It decodes msgpack, whose integers stop at 64 bits (JSON and loaded YAML have no such cap)."""
        return "msgpack" in self.call or self.module in MSGPACK_FED


def _type_arg(node: ast.Call) -> tuple[str, ast.expr] | None:
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    dotted = ast.unparse(f)
    if name == "Decoder" and "msgspec" in dotted and node.args:
        return dotted, node.args[0]
    if name == "decode" and dotted.startswith("msgspec."):
        for kw in node.keywords:
            if kw.arg == "type":
                return dotted, kw.value
    if name == "convert" and "msgspec" in dotted and len(node.args) >= 2:
        return dotted, node.args[1]
    if name in ("decode_body", "_decode") and len(node.args) >= 2:
        return dotted, node.args[1]
    return None


@functools.cache
def decode_sites() -> tuple[Site, ...]:
    """Every decode site in kvemu's packages, its type resolved in its module where it is a module-level name."""
    sites = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if "msgspec" not in text and "decode_body" not in text:  # (a module with ``_decode`` imports msgspec)
                continue
            found = [(n.lineno, *arg) for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Call)
                     if (arg := _type_arg(n)) is not None]
            if not found:
                continue
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mod = importlib.import_module(module)
            for line, call, expr in found:
                if (module, ast.unparse(expr)) in OWN_FIGURES:
                    continue
                try:
                    value = eval(ast.unparse(expr), vars(mod))  # noqa: S307 - a type expression from our own source
                except NameError:
                    value = None
                sites.append(Site(module, line, call, ast.unparse(expr), value))
    return tuple(sites)


def _bounded_int(t: mi.IntType, u64: bool = False) -> bool:
    """Both ends declared (``u64``: the top is the msgpack wire's own, ``kvemu.limits.U64``)."""
    return (t.ge is not None or t.gt is not None) and (t.le is not None or t.lt is not None or u64)


def unbounded(root: Any, msgpack: bool = True) -> Iterator[str]:
    """``Owner.field`` (with ``[]``, ``{}`` and ``|`` steps) of every leaf of ``root`` without a bound; an integer
    marked as the wire's range (``kvemu.limits.WireInt``, ``U64``) counts as bounded only when ``msgpack``."""
    seen: set[type] = set()

    def walk(t: mi.Type, where: str) -> Iterator[str]:
        if isinstance(t, mi.Metadata):
            extra = t.extra or {}
            if isinstance(t.type, mi.IntType) and extra.get("range") == WIRE_RANGE:
                if not msgpack:
                    yield f"{where}: int (the msgpack range, on a decoder without it)"
                return
            if isinstance(t.type, mi.IntType) and extra.get("le") == U64_WIRE:
                if not (msgpack and _bounded_int(t.type, u64=True)):
                    yield f"{where}: int"
                return
            yield from walk(t.type, where)
        elif isinstance(t, mi.StructType):
            if t.cls in seen:
                return
            seen.add(t.cls)
            for f in t.fields:
                yield from walk(f.type, f"{t.cls.__qualname__}.{f.name}")
        elif isinstance(t, mi.UnionType):
            for u in t.types:
                yield from walk(u, where)
        elif isinstance(t, mi.IntType):
            if not _bounded_int(t):
                yield f"{where}: int"
        elif isinstance(t, mi.FloatType):
            if (t.ge is None and t.gt is None) or (t.le is None and t.lt is None):
                yield f"{where}: float (not finite)"
        elif isinstance(t, (mi.StrType, mi.BytesType, mi.ByteArrayType, mi.MemoryViewType)):
            if t.max_length is None:
                yield f"{where}: {type(t).__name__[:-4].lower()}"
        elif isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
            if t.max_length is None:
                yield f"{where}: {type(t).__name__[:-4].lower()}"
            yield from walk(t.item_type, f"{where}[]")
        elif isinstance(t, mi.TupleType):
            for i, item in enumerate(t.item_types):
                yield from walk(item, f"{where}[{i}]")
        elif isinstance(t, mi.DictType):
            if t.max_length is None:
                yield f"{where}: dict"
            yield from walk(t.key_type, f"{where}{{key}}")
            yield from walk(t.value_type, f"{where}{{}}")
        elif isinstance(t, (mi.TypedDictType, mi.DataclassType, mi.NamedTupleType)):
            for f in t.fields:
                yield from walk(f.type, f"{where}.{f.name}")
        elif isinstance(t, mi.AnyType):
            yield f"{where}: Any"
        elif isinstance(t, mi.RawType):
            return  # (a document's part kept undecoded: decoded again at its own site, walked as every other)
        elif isinstance(t, (mi.NoneType, mi.BoolType, mi.LiteralType, mi.EnumType, mi.DateTimeType,
                            mi.DateType, mi.TimeType, mi.TimeDeltaType, mi.UUIDType, mi.DecimalType)):
            return
        else:
            yield f"{where}: {type(t).__name__} (unknown to the walk)"

    yield from walk(mi.type_info(root), getattr(root, "__qualname__", str(root)))


def bounded_values_ok(value: Any, root: Any) -> None:
    """Raise unless ``value`` (a decoded ``root``) would decode again: a round trip re-checks every bound."""
    msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=root)
