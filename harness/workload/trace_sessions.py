"""A loaded trace kept column-wise: ``TraceSessions``, a ``Sequence[Session]`` of compact arrays.

A Mooncake trace may hold 10^7 rows; as ``Session``/``Turn`` objects each costs about 480 bytes, as columns
about 60 (a tiny row). Sessions and turns are materialized on demand, equal to what a list of them held:
per row (a turn) the hash ids its prompt uses (low 32 bits, flat, with offsets), its clamped prompt length,
output length, think time and the next turn of its session; per session (sorted stably by start) its start,
first row, turn count and name (the line number of a standalone row, which is named ``trace-{line}``).
Rare extras sit in dicts: real session ids, and an ``input_length`` the clamp changed. (A row's
``output_token_ids`` are not kept: a trace turn never carried them.)
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import overload

from harness.workload.traces.mooncake import MooncakeRow

from harness.workload.turns import Session, Turn, Workload, sessions_in_words

__all__ = ["TraceSessions", "TraceSessionsBuilder", "start_times", "turn_count"]

_U32 = 0xFFFFFFFF
_NO_ROW = 0
"""``next`` of a session's last turn (row 0 is always a session's first turn, never a next one)."""


class TraceSessions(Sequence[Session]):
    """A loaded trace's sessions in start order, materialized one at a time (see the module doc)."""

    __slots__ = ("_block", "_ids", "_id_end", "_prompt", "_output", "_delay", "_next", "_input_length",
                 "_start", "_first", "_line", "_turns", "_names", "_n")

    def __init__(self, block: int, ids: array[int], id_end: array[int], prompt: array[int], output: array[int],
                 delay: array[int], next_row: array[int], input_length: dict[int, int], start: array[int],
                 first: array[int], line: array[int], turns: array[int], names: dict[int, str], n: int) -> None:
        self._block = block
        self._ids = ids  # per row: the used hash ids, row r's at [id_end[r - 1], id_end[r])
        self._id_end = id_end
        self._prompt = prompt  # per row: input_length clamped to its hash ids
        self._output = output
        self._delay = delay  # per row: ns after the previous turn of its session ended (0: a first turn)
        self._next = next_row  # per row: its session's next turn (_NO_ROW: none)
        self._input_length = input_length  # row → its input_length where the clamp changed it
        self._start = start  # per session, in start order: start ns
        self._first = first  # ... its first row
        self._line = line  # ... the line of its first row (a standalone session's name)
        self._turns = turns  # ... its turn count
        self._names = names  # session → its session id, for the sessions a trace names
        self._n = n  # sessions in this view (a prefix of the columns)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> Session: ...
    @overload
    def __getitem__(self, i: slice) -> list[Session]: ...
    def __getitem__(self, i: int | slice) -> Session | list[Session]:
        if isinstance(i, slice):
            return [self._session(k) for k in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("TraceSessions index out of range")
        return self._session(i)

    def __iter__(self) -> Iterator[Session]:
        return map(self._session, range(self._n))

    def _session(self, i: int) -> Session:
        name = self._names.get(i)
        turns: list[Turn] = []
        r = self._first[i]
        while True:
            turns.append(self._turn(r))
            r = self._next[r]
            if r == _NO_ROW:
                break
        return Session(f"trace-{self._line[i]}" if name is None else name, self._start[i], turns, name is not None)

    def _turn(self, r: int) -> Turn:
        lo = self._id_end[r - 1] if r else 0
        return Turn(None, self._output[r], self._delay[r],
                    hash_ids=self._ids[lo:self._id_end[r]], input_length=self._input_length.get(r, self._prompt[r]),
                    trace_block_size=self._block)

    def start_times(self) -> Sequence[int]:
        """Each session's start (ns), in order, without materializing any."""
        return self._start[:self._n]

    def turn_count(self) -> int:
        """How many turns (rows) the sessions hold: a trace's turns have no sub-agents, so its requests too."""
        if self._n == len(self._start):
            return len(self._output)
        return sum(self._turns[:self._n])

    def request_count(self) -> int:
        """How many requests the sessions send: their turns (a trace turn has no sub-agents)."""
        return self.turn_count()

    def in_words(self) -> str:
        """Its size in words, as ``kvemu validate`` prints it."""
        return sessions_in_words(len(self), self.turn_count(), self.request_count())

    def starting_by(self, limit_ns: int) -> TraceSessions:
        """The sessions that start at or before ``limit_ns`` (a prefix: they are in start order), sharing columns."""
        return TraceSessions(self._block, self._ids, self._id_end, self._prompt, self._output, self._delay,
                             self._next, self._input_length, self._start, self._first, self._line,
                             self._turns, self._names, bisect_right(self._start, limit_ns, 0, self._n))

    def __repr__(self) -> str:
        return f"TraceSessions({self._n} sessions)"


class TraceSessionsBuilder:
    """Collects a trace's rows into columns as they are read, then sorts the sessions into ``TraceSessions``."""

    def __init__(self, trace_block_size: int) -> None:
        self._block = trace_block_size
        self._ids = array("I")
        self._id_end = array("Q")
        self._prompt = array("I")
        self._output = array("I")
        self._delay = array("q")
        self._next = array("I")
        self._input_length: dict[int, int] = {}
        self._start = array("q")
        self._first = array("I")
        self._line = array("Q")
        self._turns = array("I")
        self._names: dict[int, str] = {}
        self._open: dict[str, int] = {}  # session id → its session, while loading
        self._last = array("I")  # per session, while loading: its latest row
        self._end = array("q")  # ... the earliest its latest turn starts (ns; responses add to it)
        self._in_order = True

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._open

    def turn(self, row: MooncakeRow) -> int:
        """Stores a validated row's turn (only the hash ids its prompt uses, as 32 bits); returns its row index."""
        r = len(self._output)
        block = self._block
        prompt = min(row.input_length, len(row.hash_ids) * block)
        self._ids.extend([h & _U32 for h in islice(row.hash_ids, -(-prompt // block))])
        self._id_end.append(len(self._ids))
        self._prompt.append(prompt)
        if prompt != row.input_length:
            self._input_length[r] = row.input_length
        self._output.append(row.output_length)
        self._delay.append(0)
        self._next.append(_NO_ROW)
        return r

    def open(self, r: int, lineno: int, start_ns: int, session_id: str | None) -> None:
        """Row ``r`` (from line ``lineno``) starts a session at ``start_ns``, named ``session_id`` if it has one."""
        i = len(self._start)
        if i and start_ns < self._start[-1]:
            self._in_order = False
        self._start.append(start_ns)
        self._first.append(r)
        self._line.append(lineno)
        self._turns.append(1)
        self._last.append(r)
        self._end.append(start_ns)
        if session_id is not None:
            self._names[i] = session_id
            self._open[session_id] = i

    def follow(self, session_id: str, r: int, delay_ns: int) -> int:
        """Row ``r`` continues session ``session_id`` ``delay_ns`` after its latest turn; returns the earliest
        that the turn starts (ns), for the caller's bound."""
        i = self._open[session_id]
        self._delay[r] = delay_ns
        self._next[self._last[i]] = r
        self._last[i] = r
        self._turns[i] += 1
        self._end[i] += delay_ns
        return self._end[i]

    def build(self) -> TraceSessions:
        """The sessions sorted stably by start (no permutation when they came in order)."""
        start, first, line, turns, names = self._start, self._first, self._line, self._turns, self._names
        if not self._in_order:
            import numpy as np  # (only for an out-of-order trace: numpy costs a run without one ~0.1 s to import)

            dtypes = {"q": np.int64, "Q": np.uint64, "I": np.uint32}
            order = np.argsort(np.frombuffer(start, dtype=np.int64), kind="stable")
            start, first, line, turns = (array(a.typecode, np.frombuffer(a, dtype=dtypes[a.typecode])[order].tobytes())
                                         for a in (start, first, line, turns))
            rank = np.empty_like(order)
            rank[order] = np.arange(len(order))
            names = {int(rank[i]): sid for i, sid in names.items()}
        return TraceSessions(self._block, self._ids, self._id_end, self._prompt, self._output, self._delay, self._next,
                             self._input_length, start, first, line, turns, names, len(start))


def start_times(sessions: Workload) -> Iterable[int]:
    """Each session's start (ns), in order (``Workload.start_times``)."""
    return sessions.start_times()


def turn_count(sessions: Workload) -> int:
    """How many turns the sessions hold (``Workload.turn_count``)."""
    return sessions.turn_count()
