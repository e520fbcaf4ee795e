"""kvemu's YAML files (scenarios, sweeps) read once and validated with msgspec: parsing bounded in expanded size
and aliases before anything is built, an error said as ``source: key.path (line N): what is wrong`` (with a "did
you mean" for an unknown key), every problem of a file found in one pass, the line of a key, a value at a key
path, and floats read as YAML 1.2 writes them."""

from __future__ import annotations

import difflib
import functools
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Union

import msgspec
import msgspec.inspect as mi
import yaml

from kvemu.errors import InvalidArgument, KvemuError

__all__ = ["MAX_LISTED_PROBLEMS", "MAX_YAML_ALIASES", "MAX_YAML_VALUES", "Problem", "YamlDocument", "YamlError",
           "describe_validation_error", "floats_where_expected", "key_location", "line_of", "load_yaml",
           "problems_message", "validation_problems", "value_at"]


MAX_YAML_VALUES = 250_000
"""Most values (scalars, lists, mappings) a YAML file kvemu reads may stand for, each use of an alias or merge key
counted as the copy it makes: a few hundred bytes of nested aliases ("billion laughs") or merge keys otherwise
stand for billions, which building, validating or printing the file would expand."""
MAX_YAML_ALIASES = 10_000
"""Most aliases (``*name``, including those a merge key ``<<`` names) a YAML file kvemu reads may use."""
MAX_LISTED_PROBLEMS = 50
"""Most problems of one file an error lists (then how many more): a file is untrusted, and can hold many."""

_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's parser and composer where PyYAML has them (in C: a file is parsed in milliseconds, and its nesting is
bounded by libyaml), else PyYAML's pure-Python ones; either way PyYAML's safe constructor."""


class YamlError(KvemuError, ValueError):
    """A YAML file kvemu will not read: not YAML, or past ``MAX_YAML_VALUES`` / ``MAX_YAML_ALIASES``; the message
    names the file."""


@dataclass(frozen=True)
class YamlDocument:
    """A YAML file read once: its ``data`` and the ``node`` graph it was built from (for the lines of keys)."""

    data: Any
    node: yaml.Node | None


def load_yaml(text: str, source: str) -> YamlDocument:
    """``text`` (from ``source``, which messages name) parsed once, its node graph checked against
    ``MAX_YAML_VALUES`` and ``MAX_YAML_ALIASES`` before a Python value is built from it; ``YamlError`` otherwise."""
    loader = _LOADER(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_size(node, source)
        return YamlDocument(loader.construct_document(node) if node is not None else None, node)
    except yaml.MarkedYAMLError as exc:  # its marks say where, in a file named "<unicode string>": name ours
        exc.context_mark, exc.problem_mark = (
            None if m is None else yaml.Mark(source, m.index, m.line, m.column, text + "\0", m.index)
            for m in (exc.context_mark, exc.problem_mark))
        raise YamlError(f"{source}: not valid YAML: {exc}") from None
    except yaml.YAMLError as exc:
        raise YamlError(f"{source}: not valid YAML: {exc}") from None
    except RecursionError:  # the pure-Python composer, on deep nesting
        raise YamlError(f"{source}: nested too deeply") from None
    finally:
        loader.dispose()


def _check_size(root: yaml.Node, source: str) -> None:
    """Refuse a node graph standing for more than ``MAX_YAML_VALUES`` values (counted as if every alias and merge
    were copied, as PyYAML before 6.0.4 copies merged keys), more than ``MAX_YAML_ALIASES`` aliases, or an alias
    inside its own anchor. Iterative, and linear in the distinct nodes."""
    sizes: dict[int, int] = {}
    open_ids: set[int] = set()
    aliases = 0
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _children(node)
        if done:
            open_ids.discard(key)
            sizes[key] = size = 1 + sum(sizes[id(c)] for c in children)
            if size > MAX_YAML_VALUES:
                raise YamlError(f"{source}: line {node.start_mark.line + 1}: this value stands for more than "
                                f"{MAX_YAML_VALUES:,} values once its aliases and merge keys are expanded (the "
                                "limit; a scenario or sweep needs far fewer)")
            continue
        if key in open_ids:
            raise YamlError(f"{source}: line {node.start_mark.line + 1}: an alias inside the value it names "
                            "(a recursive value)")
        if key in sizes:  # reached before: this use is an alias
            aliases += 1
            if aliases > MAX_YAML_ALIASES:
                raise YamlError(f"{source}: line {node.start_mark.line + 1}: more than {MAX_YAML_ALIASES:,} aliases "
                                "(*name, or merge keys <<) (the limit; a scenario or sweep needs far fewer)")
            continue
        open_ids.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(children))


def _children(node: yaml.Node) -> list[yaml.Node]:
    """The nodes directly under ``node``: a sequence's items, a mapping's keys and values."""
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def line_of(node: yaml.Node | None, path: Sequence[str | int]) -> int | None:
    """1-based line of the key at ``path`` (or of its nearest existing ancestor) in a composed document."""
    line = None
    for part in path:
        if isinstance(node, yaml.MappingNode):
            entry = next(((k, v) for k, v in node.value if k.value == part), None)
            if entry is None:
                return line
            line = entry[0].start_mark.line + 1
            node = entry[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def value_at(data: Any, path: Sequence[str | int]) -> tuple[bool, Any]:
    """``(True, value)`` at ``path`` in raw scenario data, or ``(False, None)`` where it does not exist."""
    for part in path:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            return False, None
    return True, data


def _parse_path(where: str) -> list[str | int]:
    parts: list[str | int] = []
    for piece in where.removeprefix("$").split("."):
        if not piece:
            continue
        while "[" in piece:
            head, _, rest = piece.partition("[")
            if head:
                parts.append(head)
            idx, _, piece = rest.partition("]")
            parts.append(int(idx) if idx.isdigit() else idx)  # msgspec writes a mapping's value as [...]
        if piece:
            parts.append(piece)
    return parts


_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
               "object": "a mapping of keys", "array": "a list", "null": "null"}
"""msgspec's type names, as a person would say them."""


def _expected(types: str) -> str:
    """msgspec's ``int | null`` in words: ``an integer (or null)``."""
    words = [_TYPE_WORDS.get(t.strip(), f"`{t.strip()}`") for t in types.split("|")]
    rest = [w for w in words if w != "null"]
    return " or ".join(rest) + (" (or null)" if "null" in words and rest else "")


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a YAML file: its ``key`` path (``chaos[0].at_s``; empty when none applies), ``at`` where
    the key is (`` (line N)``, `` (from --set)`` or empty) and ``message``, what is wrong."""

    key: str
    at: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}{self.at}: {self.message}" if self.key else self.message


def problems_message(source: str, problems: Sequence[Problem], total: int | None = None) -> str:
    """``source: key.path (line N): what is wrong`` for one problem; for several ``source: N problems`` and one
    indented line each, the first ``MAX_LISTED_PROBLEMS`` of ``total`` (default: all given), then how many more."""
    total = len(problems) if total is None else total
    if total == 1 and problems:
        return f"{source}: {problems[0]}"
    listed = problems[:MAX_LISTED_PROBLEMS]
    more = total - len(listed)
    return "\n  ".join([f"{source}: {total} problems", *map(str, listed)] + ([f"and {more} more"] if more else []))


def describe_validation_error(exc: msgspec.ValidationError, raw: Any, node: yaml.Node | None, source: str, *,
                              schema: Any = None, overridden: frozenset[str] | set[str] = frozenset()) -> str:
    """``source: key.path (line N): what is wrong`` for a ``msgspec.convert`` error on ``raw`` (built from ``node``).

    Shared by every YAML file kvemu validates with msgspec (scenarios, sweeps), so their errors read alike. With
    ``schema`` (the type ``raw`` was converted to) an unknown key gets a "did you mean"; a key under one of the
    ``overridden`` key paths says it came from ``--set`` instead of citing a line it did not come from.
    """
    found = _Found.of(exc, "$")
    return f"{source}: {_describe(found, raw, node, schema, overridden, set())}"


def validation_problems(raw: Any, schema: Any, node: yaml.Node | None, *,
                        overridden: frozenset[str] | set[str] = frozenset()) -> tuple[list[Problem], int]:
    """Every problem ``msgspec.convert(raw, schema, strict=True)`` meets, where it stops at the first: (the first
    ``MAX_LISTED_PROBLEMS``, described as ``describe_validation_error`` does, and how many in all; none if ``raw``
    converts). A struct's fields are converted one by one (its unknown and missing keys each a problem), a list's
    items one by one; a struct's own cross-field check (``__post_init__``) only once every field converts."""
    found = _find(raw, schema, "$")
    told: set[str] = set()
    return [_describe(f, raw, node, schema, overridden, told) for f in found[:MAX_LISTED_PROBLEMS]], len(found)


@dataclass(frozen=True)
class _Found:
    """A problem as msgspec says it: ``message``, the path ``where`` (``$.chaos[0].at_s``), the check's exception."""

    message: str
    where: str
    cause: BaseException | None = None

    @classmethod
    def of(cls, exc: msgspec.ValidationError, root: str) -> _Found:
        """``exc``, from converting the value at path ``root``, with the path from the file's top."""
        message, _, where = str(exc).partition(" - at `")
        where = where.rstrip("`")
        return cls(message, where.replace("$", root, 1) if where else root, exc.__cause__)


def _find(value: Any, tp: Any, where: str) -> list[_Found]:
    """The problems of converting ``value`` (at path ``where``) to type ``tp``, all of them (see
    ``validation_problems``); in the order of the file's keys, as msgspec meets them."""
    try:
        msgspec.convert(value, tp, strict=True)
        return []
    except msgspec.ValidationError as exc:
        first = _Found.of(exc, where)
    struct = _struct_of(value, tp)
    if struct is not None:
        config = struct.__struct_config__
        fields = _fields(struct)
        found: list[_Found] = []
        for key, item in value.items():
            field = fields.get(key)
            if field is not None:
                found += _find(item, field.type, f"{where}.{key}")
            elif key != config.tag_field and config.forbid_unknown_fields:
                found.append(_Found(f"Object contains unknown field `{key}`", where))
        found += [_Found(f"Object missing required field `{name}`", where)
                  for name, field in fields.items() if field.required and name not in value]
        return found or [first]  # every field converts: the struct's own check failed
    item_type = _list_item(tp)
    if item_type is not None and isinstance(value, list) and first.where != where:  # (not the list's own length)
        return [f for i, item in enumerate(value) for f in _find(item, item_type, f"{where}[{i}]")] or [first]
    return [first]


@functools.cache  # (struct types are few; reading their fields resolves their annotations, slowly)
def _fields(struct: type[msgspec.Struct]) -> dict[str, msgspec.structs.FieldInfo]:
    """``struct``'s fields by the name a file gives them."""
    return {f.encode_name: f for f in msgspec.structs.fields(struct)}


@functools.cache  # (schemas are few, and a large one takes milliseconds to inspect)
def _type_info(schema: Any) -> mi.Type:
    """``msgspec.inspect.type_info(schema)``, once per schema."""
    return mi.type_info(schema)


def _unannotated(tp: Any) -> Any:
    """``tp`` without its ``Annotated`` constraints."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _struct_of(value: Any, tp: Any) -> Any:
    """The struct type a mapping ``value`` converts to as ``tp``: ``tp`` itself, or the member of an optional or
    tagged union (by its tag); None if ``value`` is no mapping of names, or ``tp`` has no such struct."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        return None
    tp = _unannotated(tp)
    if _is_struct(tp):
        return tp
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return None
    structs = [m for m in typing.get_args(tp) if _is_struct(m)]
    tagged = [m for m in structs if m.__struct_config__.tag_field is not None
              and value.get(m.__struct_config__.tag_field) == m.__struct_config__.tag]
    untagged = [m for m in structs if m.__struct_config__.tag_field is None]
    return tagged[0] if tagged else untagged[0] if len(structs) == 1 and untagged else None


def _list_item(tp: Any) -> Any:
    """The item type of a list type ``tp``; None for another type."""
    tp = _unannotated(tp)
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list and typing.get_args(tp) else None


def _describe(found: _Found, raw: Any, node: yaml.Node | None, schema: Any,
              overridden: frozenset[str] | set[str], told: set[str]) -> Problem:
    """``found`` (on ``raw``, built from ``node``) said as ``describe_validation_error`` says it; ``told``: the
    sections whose kind a problem described before has said what to do about (the next ones say it briefly)."""
    message, cause = found.message, found.cause
    key = found.where.removeprefix("$.").removeprefix("$")
    unknown = re.match(r"^Object contains unknown field `(.+)`$", message)
    if isinstance(cause, InvalidArgument) and cause.field:  # a section's own check names its field
        key = f"{key}.{cause.field}" if key else cause.field
    elif unknown:
        key = f"{key}.{unknown.group(1)}" if key else unknown.group(1)
        message = "unknown key (check its spelling and section)"
        guess = _close_key(raw, _parse_path(key), schema)
        if guess:
            message = f"unknown key; did you mean {guess}?"
        other = _other_kinds_key(raw, _parse_path(key), schema, overridden, told)
        if other:
            message = other
    parts = _parse_path(key)
    if not isinstance(cause, InvalidArgument) and not unknown:
        found_value, value = value_at(raw, parts)
        if found_value and not isinstance(value, (dict, list)):
            mismatch = re.match(r"^Expected `(.+)`, got `.+`$", message)
            if mismatch:  # "Expected `int`, got `str`": say what was expected in words, and the value once
                message = f"expected {_expected(mismatch.group(1))}, got {value!r}"
            else:
                message = f"{message}, got {value!r}"
    return Problem(key or "(top level)", key_location(node, parts, overridden), message)


def key_location(node: yaml.Node | None, parts: Sequence[str | int], overridden: frozenset[str] | set[str] = frozenset()) -> str:
    """`` (from --set)`` if the value at ``parts`` came from an override, else `` (line N)`` of the file (or ``""``)."""
    dotted = [".".join(str(p) for p in parts[:n]) for n in range(1, len(parts) + 1)]
    if any(d in overridden for d in dotted):
        return " (from --set)"
    line = line_of(node, parts)
    return f" (line {line})" if line else ""


def _close_key(raw: Any, parts: list[str | int], schema: Any) -> str | None:
    """The valid key path closest to the unknown ``parts`` (``router.policy`` for ``router.polcy``), if any."""
    if schema is None or not parts or not isinstance(parts[-1], str):
        return None
    struct = _type_at(raw, parts[:-1], _type_info(schema))
    if not isinstance(struct, mi.StructType):
        return None
    names = [f.encode_name for f in struct.fields if f.encode_name != "base_dir"]
    match = difflib.get_close_matches(parts[-1], names, n=1)
    if not match:
        return None
    head = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts[:-1]).lstrip(".")
    return f"{head}.{match[0]}" if head else match[0]


def _other_kinds_key(raw: Any, parts: list[str | int], schema: Any, overridden: frozenset[str] | set[str],
                     told: set[str]) -> str | None:
    """For a key unknown to its section's kind but a field of another kind (``workload.rate_rps`` with
    ``workload.kind: trace``): which kind it belongs to, and what this kind needs instead (unless its section is
    in ``told``: said for another key already; the section is added)."""
    if schema is None or not parts or not isinstance(parts[-1], str):
        return None
    union = _type_at(raw, parts[:-1], _type_info(schema), member=False)
    union = union.type if isinstance(union, mi.Metadata) else union
    node = value_at(raw, parts[:-1])[1]
    if not isinstance(union, mi.UnionType) or not isinstance(node, dict):
        return None
    kinds = [m for m in union.types if isinstance(m, mi.StructType) and m.tag_field]
    current = next((m for m in kinds if node.get(m.tag_field) == m.tag), None)
    owners = [str(m.tag) for m in kinds if m is not current and any(f.encode_name == parts[-1] for f in m.fields)]
    if current is None or not owners or current.tag_field is None:
        return None
    head = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts[:-1]).lstrip(".")
    tag = f"{head}.{current.tag_field}" if head else current.tag_field
    if head in told:
        return f"belongs to {tag}={' or '.join(owners)} too"
    told.add(head)
    needs = [f"{head}.{f.encode_name}" if head else f.encode_name for f in current.fields
             if f.required and f.encode_name not in node]
    removal = " (--set cannot remove a key: write the scenario to a file without it)" if tag in overridden else ""
    return (f"belongs to {tag}={' or '.join(owners)}; with {tag}={current.tag}, remove it{removal}"
            + (f" and set {', '.join(needs)}" if needs else ""))


def _struct_for(raw: Any, t: Any) -> Any:
    """The type ``raw`` takes in ``t``: an optional or tagged union's member struct (by its tag), else ``t``."""
    if isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.UnionType):
        structs = [m for m in t.types if isinstance(m, mi.StructType)]
        if isinstance(raw, dict) and structs:
            tagged = [m for m in structs if m.tag_field and raw.get(m.tag_field) == m.tag]
            return tagged[0] if tagged else structs[0] if len(structs) == 1 else None
    return t


def _type_at(raw: Any, parts: list[str | int], t: Any, *, member: bool = True) -> Any:
    """The type at key path ``parts`` of a value of type ``t`` (``raw`` picks union members, the last one too
    unless not ``member``); None if unknown."""
    for part in parts:
        t = _struct_for(raw, t)
        if isinstance(t, mi.StructType) and isinstance(part, str):
            field = next((f for f in t.fields if f.encode_name == part), None)
            if field is None:
                return None
            t, raw = field.type, raw.get(part) if isinstance(raw, dict) else None
        elif isinstance(t, mi.ListType) and isinstance(part, int):
            t, raw = t.item_type, raw[part] if isinstance(raw, list) and part < len(raw) else None
        else:
            return None
    return _struct_for(raw, t) if member else t


_YAML12_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
"""A float as YAML 1.2 (and a person) writes it: ``1e2``, ``1E-3``, ``+1.5e3``, ``.5``. PyYAML follows YAML 1.1,
which reads those without a dot, or with an unsigned exponent, as strings."""


def floats_where_expected(raw: Any, schema: Any) -> Any:
    """``raw`` with every string that spells a float (YAML 1.2) made a float where ``schema`` expects a number
    (``run.duration_s: 1e2``); strings elsewhere (a name ``1e2``) stay strings. Changes ``raw`` in place."""
    return _floats(raw, _type_info(schema))


def _floats(raw: Any, t: Any) -> Any:
    """``floats_where_expected`` on one value of (``msgspec.inspect``) type ``t``."""
    t = _struct_for(raw, t)
    if isinstance(raw, str):
        members = t.types if isinstance(t, mi.UnionType) else [t]
        if any(isinstance(m.type if isinstance(m, mi.Metadata) else m, mi.FloatType) for m in members) \
                and _YAML12_FLOAT.fullmatch(raw.strip()):
            return float(raw)
    elif isinstance(raw, dict) and isinstance(t, mi.StructType):
        for field in t.fields:
            if field.encode_name in raw:
                raw[field.encode_name] = _floats(raw[field.encode_name], field.type)
    elif isinstance(raw, dict) and isinstance(t, mi.DictType):
        for k in raw:
            raw[k] = _floats(raw[k], t.value_type)
    elif isinstance(raw, list) and isinstance(t, mi.ListType):
        raw[:] = [_floats(item, t.item_type) for item in raw]
    return raw
