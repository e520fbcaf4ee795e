"""Where a run's scenario came from: the file (or trace, or built-in quickstart) a command named and the ``--set``
overrides applied on top of it, as typed values the report lists under "What ran"."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

import msgspec
from msgspec import Meta

from kvemu.limits import MAX_LIST_ITEMS, FilePath, Name
from kvemu.validation import check_struct

from harness.scenario.loading import MAX_SCENARIO_BYTES

__all__ = ["Override", "RunOrigin", "BUILT_IN"]

BUILT_IN = "<built-in quickstart>"
"""The ``source`` of a run that named no scenario."""


class Override(msgspec.Struct, frozen=True):
    """One ``--set key.path=value``: the key path and the value's YAML text as given (a relative path made absolute
    from the directory it was typed in)."""

    key: Annotated[str, Meta(min_length=1, max_length=1000)]
    value: Annotated[str, Meta(max_length=MAX_SCENARIO_BYTES)]

    def __post_init__(self) -> None:
        check_struct(self)

    @classmethod
    def parse(cls, item: str) -> Override:
        """``key.path=value`` as an ``Override`` (an item the loader accepted: it has a key and an ``=``)."""
        key, _, value = item.partition("=")
        return cls(key=key, value=value)

    def __str__(self) -> str:
        return f"{self.key}={self.value}"


class RunOrigin(msgspec.Struct, frozen=True, kw_only=True):
    """What a command was given to build the scenario it ran: the command, the scenario it named and the overrides
    in the order applied (the last of a key wins)."""

    command: Name = "kvemu"
    """The command that ran it: ``kvemu run``, ``kvemu loadgen`` (also ``kvemu up``'s), ``kvemu sweep``,
    ``kvemu bench-router``."""
    source: FilePath = BUILT_IN
    """The scenario file or trace as named, or ``BUILT_IN``."""
    overrides: Annotated[tuple[Override, ...], Meta(max_length=MAX_LIST_ITEMS)] = ()

    def __post_init__(self) -> None:
        check_struct(self)

    @classmethod
    def of(cls, command: str, source: str | None, items: Iterable[str]) -> RunOrigin:
        """The origin of a scenario loaded from ``source`` (None or "": the built-in) with ``items`` (``--set``)."""
        return cls(command=command, source=source or BUILT_IN, overrides=tuple(Override.parse(i) for i in items))
