"""``kvemu scenario show``: a resolved scenario as YAML, every key with its value (defaults filled), followed by a
comment with its bound and one-line meaning, all read from the schema (the ``msgspec.Meta`` constraints and the
fields' docstrings), so nobody has to read Python to learn the knobs. The text loads back as the same scenario."""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from kvemu.config import RouterConfig
from kvemu.runtime.router import RouterSettings
from workers.config import EngineConfig

from harness.scenario.loading import POOL_KEYS, resolve
from harness.scenario.schema import Scenario
from harness.scenario.sections import EngineSpec, RouterSpec, TraceWorkload

__all__ = ["show_scenario"]

_FIELDS_FROM: dict[type, tuple[type, ...]] = {EngineSpec: (EngineConfig,), RouterSpec: (RouterConfig, RouterSettings)}
"""Sections built by ``msgspec.defstruct`` from another struct's fields: whose docstrings their fields carry."""
_HIDDEN = frozenset({"base_dir"})
"""Scenario fields the loader sets, not a file."""
COMMENT_COLUMN = 44
"""Where the comments start (when the key and value leave room)."""


def show_scenario(scenario: Scenario) -> str:
    """The YAML text of ``scenario`` with every key's bound and meaning in a comment after it."""
    lines = [f"# kvemu scenario {scenario.name}, resolved: every key with its value (defaults filled in), then its "
             "bound and meaning.", "# (kvemu run / validate take this file as it is.)"]
    value = msgspec.to_builtins(scenario)
    if isinstance(scenario.workload, TraceWorkload):  # absolute, to be found from wherever this text goes (the
        value["workload"]["trace"] = str(resolve(scenario, scenario.workload.trace))  # loader made the others so)
    schema = mi.type_info(Scenario)
    assert isinstance(schema, mi.StructType)
    lines += _mapping(schema, value, 0)
    return "\n".join(lines) + "\n"


def _mapping(t: mi.StructType, value: dict[str, Any], depth: int, kinds: str = "") -> list[str]:
    """A section's lines at ``depth`` (``kinds``: a tagged union's choices, said beside its tag)."""
    out: list[str] = []
    pad = "  " * depth
    docs = _field_docs(t.cls)
    if t.tag_field is not None:
        out.append(_line(f"{pad}{t.tag_field}: {_scalar(t.tag)}", kinds or f"this section's {t.tag_field}"))
    unused = t.cls.__name__ == "ClusterSpec" and value.get("prefill") is not None  # the pools size themselves
    for f in t.fields:
        if f.name in _HIDDEN:
            continue
        v, ftype, doc = value.get(f.encode_name), f.type, docs.get(f.name, "")
        if unused and f.name in POOL_KEYS:
            out.append(f"{pad}# {f.name}: unused: a disaggregated cluster sizes each pool (cluster.prefill, "
                       "cluster.decode)")
            continue
        struct = _struct_of(ftype, v)
        if struct is not None and isinstance(v, dict):
            out.append(_line(f"{pad}{f.encode_name}:", "a section", doc or _class_doc(struct.cls)))
            out += _mapping(struct, v, depth + 1, _describe(ftype) if struct.tag is not None else "")
        elif v is None and _struct_of(ftype, {}) is not None:  # an optional section not given: a key would be
            out.append(_line(f"{pad}# {f.encode_name}:", "not set; " + _describe(ftype), doc))  # one, so a comment
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            item = _struct_of(ftype, v[0])
            out.append(_line(f"{pad}{f.encode_name}:", _describe(ftype), doc))
            for entry in v:
                assert item is not None
                body = _mapping(item, entry, depth + 2)
                out += [f"{pad}  - {body[0].lstrip()}", *body[1:]]
        else:
            out.append(_line(f"{pad}{f.encode_name}: {_scalar(v)}", _describe(ftype), doc))
    return out


def _line(text: str, bound: str, doc: str = "") -> str:
    comment = bound + (f" | {_first_sentence(doc)}" if doc else "")
    return f"{text.ljust(COMMENT_COLUMN)}  # {comment}" if comment else text


def _struct_of(t: Any, value: Any) -> mi.StructType | None:
    """The struct type of ``t`` that ``value`` (a mapping, or None) has: a tagged union's member by its tag."""
    if isinstance(t, mi.Metadata):
        return _struct_of(t.type, value)
    if isinstance(t, mi.StructType):
        return t
    if isinstance(t, (mi.UnionType, mi.ListType)):
        members = t.types if isinstance(t, mi.UnionType) else (t.item_type,)
        structs = [s for m in members if (s := _struct_of(m, value)) is not None]
        for s in structs:
            if s.tag_field is None or not isinstance(value, dict) or value.get(s.tag_field) == s.tag:
                return s
    return None


def _scalar(v: Any) -> str:
    """A value as YAML that loads back as the same value (strings quoted; floats keep their point)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        text = repr(v)
        return text if "." in text or "e" not in text else text.replace("e", ".0e", 1)
    if isinstance(v, (int, str)):
        return json.dumps(v) if isinstance(v, str) else str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    raise TypeError(f"no YAML form for {type(v).__name__}")  # pragma: no cover - the schema has no other values


def _number(x: float) -> str:
    if isinstance(x, int) and abs(x) >= 1 << 20:
        for k in range(20, 65):
            if abs(x) == 1 << k:
                return f"{'-' if x < 0 else ''}2^{k}"
            if x == (1 << k) - 1:
                return f"2^{k}-1"
    return f"{x:g}" if isinstance(x, float) else str(x)


def _range(t: mi.IntType | mi.FloatType) -> str:
    lo = f"[{_number(t.ge)}" if t.ge is not None else f"({_number(t.gt)}" if t.gt is not None else None
    hi = f"{_number(t.le)}]" if t.le is not None else f"{_number(t.lt)})" if t.lt is not None else None
    if lo and hi:
        return f" in {lo}, {hi}"
    if lo:
        return f" {'>=' if t.ge is not None else '>'} {lo[1:]}"
    return f" {'<=' if t.le is not None else '<'} {hi[:-1]}" if hi else ""


def _describe(t: Any) -> str:
    """A type and its bound in words: ``int in [1, 4096]``, ``one of lru, fifo``, ``float > 0 or null``..."""
    if isinstance(t, mi.Metadata):
        return _describe(t.type)
    if isinstance(t, mi.IntType):
        return "int" + _range(t)
    if isinstance(t, mi.FloatType):
        return "number" + _range(t)
    if isinstance(t, mi.StrType):
        return "string" + (f" of at most {t.max_length} chars" if t.max_length is not None else "")
    if isinstance(t, mi.BoolType):
        return "true or false"
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(map(str, t.values))
    if isinstance(t, mi.StructType):
        return "a section" if t.tag is None else f"{t.tag_field} {t.tag}"
    if isinstance(t, mi.ListType):
        most = f", at most {_number(t.max_length)}" if t.max_length is not None else ""
        item = "sections" if isinstance(t.item_type, mi.StructType) else f"({_describe(t.item_type)})"
        return f"a list of {item}{most}"
    if isinstance(t, mi.UnionType):
        parts = [_describe(m) for m in t.types if not isinstance(m, mi.NoneType)]
        structs = [m for m in t.types if isinstance(m, mi.StructType) and m.tag is not None]
        if structs:  # a tagged union: its kinds
            parts = [f"{structs[0].tag_field}: one of " + ", ".join(str(s.tag) for s in structs)]
        nullable = any(isinstance(m, mi.NoneType) for m in t.types)
        return " or ".join(parts) + (" or null" if nullable else "")
    return type(t).__name__.removesuffix("Type").lower()  # pragma: no cover - the schema has no other types


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.split()).replace("``", "")
    match = re.search(r"(?<=[a-z0-9)\]`'\"])\. ", text)
    return text[: match.start() + 1] if match else text


def _class_doc(cls: type) -> str:
    """A section's own docstring (not one it inherits), else that of the struct its fields come from."""
    own = cls.__dict__.get("__doc__")
    if own:
        return inspect.cleandoc(own)
    return next((inspect.cleandoc(c.__doc__) for c in _FIELDS_FROM.get(cls, ()) if c.__doc__), "")


@cache
def _field_docs(cls: type) -> dict[str, str]:
    """A struct's field docstrings (the string after a field): its own over its bases', over its sources'
    (``_FIELDS_FROM``)."""
    docs: dict[str, str] = {}
    for klass in [*_FIELDS_FROM.get(cls, ()), *reversed(cls.__mro__)]:
        docs.update(_own_field_docs(klass))
    return docs


@cache
def _own_field_docs(cls: type) -> dict[str, str]:
    module = sys.modules.get(cls.__module__)
    if module is None or not getattr(module, "__file__", None):  # (builtins: object)
        return {}
    try:
        tree = _module_tree(module.__name__)
    except (OSError, SyntaxError, UnicodeDecodeError):  # no source beside it: no docs, the bounds still show
        return {}
    node = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__), None)
    if node is None:
        return {}
    docs: dict[str, str] = {}
    for before, after in zip(node.body, node.body[1:]):
        if isinstance(before, ast.AnnAssign) and isinstance(before.target, ast.Name) \
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str):
            docs[before.target.id] = after.value.value
    return docs


@cache
def _module_tree(name: str) -> ast.Module:
    """A module's syntax tree, from its ``.py`` file (installed beside a compiled build's extension too)."""
    path = Path(sys.modules[name].__file__ or "")
    if path.suffix != ".py":
        path = path.with_name(name.rpartition(".")[2] + ".py")
    return ast.parse(path.read_text(encoding="utf-8"))
