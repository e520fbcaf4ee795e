"""A workload's units: a ``Session`` of ``Turn`` requests (synthesized, or materialized from a loaded trace), and
what every form of a workload gives its callers (``Workload``), a list of sessions' included (``SessionList``).

Their own module so that the trace's column store (``harness.workload.trace_sessions``) and the workload builders
(``harness.workload.build``) share them without importing each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol, overload

from workers.hash_id_prompt import HashIdTokens

from harness.text import counted

__all__ = ["Turn", "Session", "SessionList", "Workload", "sessions_in_words"]


class Turn(NamedTuple):
    """One request of a session (trace turns keep their hash ids and expand them only when sent)."""

    tokens: list[int] | None
    max_tokens: int
    delay_ns: int = 0
    """Wait after the previous turn of the session completed (0 for the first turn)."""
    output_token_ids: list[int] | None = None
    """The reply's token ids, so that later turns that quote it hit the engine's cache."""
    sub_agents: tuple[tuple[list[int], int], ...] = ()
    """Sibling requests ``(tokens, max_tokens)`` started when this turn completes."""
    worker_id: int | None = None
    hash_ids: Sequence[int] | None = None
    """A trace turn's hash ids: those its prompt uses, as the low 32 bits its tokens take (an ``array("I")``)."""
    input_length: int = 0
    trace_block_size: int = 0

    def prompt(self) -> Sequence[int]:
        """The prompt's token ids (a trace prompt stays a lazy ``HashIdTokens``: it hashes its blocks
        once per trace block instead of per token, and is encoded as a list where bytes are needed)."""
        if self.tokens is not None:
            return self.tokens
        return HashIdTokens(self.hash_ids or (), self.input_length, self.trace_block_size)


class Session(NamedTuple):
    """Turns that run one after another, starting at ``start_ns``."""

    session_id: str
    start_ns: int
    turns: list[Turn]
    sticky: bool = False
    """Whether its requests carry the session id (affinity); trace rows without one do not."""



class Workload(Protocol):
    """What a run, the load generators and ``kvemu validate`` ask of a workload, whatever its form: a list of
    sessions (``SessionList``), a loaded trace's sessions kept column-wise (``TraceSessions``) or a trace's
    dependency graph (``TraceGraph``). Only ``play_workload``, which picks the player, asks which form it is."""

    def request_count(self) -> int:
        """How many requests it sends (each turn and each of its sub-agents; a graph: each node)."""
        ...

    def turn_count(self) -> int:
        """How many turns it holds (a graph: its nodes)."""
        ...

    def start_times(self) -> Iterable[int]:
        """Each session's start (ns), in order, without materializing a loaded trace's sessions (a graph: its
        roots' ready times)."""
        ...

    def in_words(self) -> str:
        """Its size in words, as ``kvemu validate`` prints it."""
        ...


def sessions_in_words(sessions: int, turns: int, requests: int) -> str:
    """``3 sessions, 7 requests (5 turns + 2 sub-agent requests)``: sessions of turns in words."""
    detail = f" ({counted(turns, 'turn')} + {counted(requests - turns, 'sub-agent request')})" if requests > turns \
        else ""
    return f"{counted(sessions, 'session')}, {counted(requests, 'request')}{detail}"


class SessionList(Sequence[Session]):
    """A list of sessions (a synthetic workload's) as a ``Workload``: a sequence of its sessions, counted by
    walking them."""

    __slots__ = ("_sessions",)

    def __init__(self, sessions: Iterable[Session] = ()) -> None:
        self._sessions = list(sessions)

    def __len__(self) -> int:
        return len(self._sessions)

    @overload
    def __getitem__(self, index: int) -> Session: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Session]: ...

    def __getitem__(self, index: int | slice) -> Session | Sequence[Session]:
        return self._sessions[index]

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions)

    def request_count(self) -> int:
        return sum(1 + len(t.sub_agents) for s in self._sessions for t in s.turns)

    def turn_count(self) -> int:
        return sum(len(s.turns) for s in self._sessions)

    def start_times(self) -> Iterable[int]:
        return (s.start_ns for s in self._sessions)

    def in_words(self) -> str:
        return sessions_in_words(len(self), self.turn_count(), self.request_count())

    def __repr__(self) -> str:
        return f"SessionList({self._sessions!r})"
