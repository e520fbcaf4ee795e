"""The common in-memory model of every trace format: a dependency graph of request nodes, kept column-wise.

A node is one request: its id, its play and session, its prompt (hash ids, one per ``block_size`` tokens,
and ``input_length``), its output length, and ``not_before_ns``, the earliest it may be sent after its play
began (a root's ready time; a floor for the others). Its incoming edges say when it may go: each names a
predecessor, a trigger (the predecessor's ``dispatch`` or its ``completion``), a delay and a relation
(``sequence``, ``spawn``, ``join``, ``replay_barrier``). A node is released once every edge's trigger
happened plus its delay. A Mooncake session is the special case of a chain of sequence edges.

Columns (``array``s) instead of objects, as ``harness.workload.trace_sessions`` keeps a Mooncake trace: a node costs
about 60 bytes plus its hash ids (8 bytes each, full 64 bits, so a conversion writes back what it read).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvemu.errors import InvalidArgument

from harness.text import counted

__all__ = ["grouped", "successors", "targets", "indegrees", "DISPATCH", "COMPLETION", "TRIGGERS", "RELATIONS",
           "SEQUENCE", "SPAWN", "JOIN", "REPLAY_BARRIER", "MAX_SESSION_BYTES",
           "Dependency", "Edge", "Node", "TraceGraph", "GraphBuilder", "Source"]

MAX_SESSION_BYTES = 256
"""Longest session id (bytes): a router refuses a longer affinity key, so a loader refuses it first."""
DISPATCH, COMPLETION = 0, 1
TRIGGERS = ("dispatch", "completion")
"""Trigger names by code: the predecessor's dispatch (it was sent) or its completion (it ended)."""
SEQUENCE, SPAWN, JOIN, REPLAY_BARRIER = 0, 1, 2, 3
RELATIONS = ("sequence", "spawn", "join", "replay_barrier")
"""Relation names by code: what an edge means (replay treats them alike: only trigger and delay time it)."""
ALLOWED = {(SEQUENCE, COMPLETION), (SPAWN, DISPATCH), (SPAWN, COMPLETION), (JOIN, COMPLETION),
           (REPLAY_BARRIER, COMPLETION)}
"""The (relation, trigger) pairs Agentic Mooncake v2 allows."""


def grouped(keys: Sequence[int], groups: int) -> tuple[array[int], array[int]]:
    """Indices grouped by key, compact: those with key ``k`` are ``items[start[k]:start[k + 1]]``, in index
    order (a counting sort; no list per group)."""
    start = array("Q", bytes(8 * (groups + 1)))
    for k in keys:
        start[k + 1] += 1
    for k in range(groups):
        start[k + 1] += start[k]
    fill = array("Q", start[:groups])
    items = array("Q", bytes(8 * len(keys)))
    for i, k in enumerate(keys):
        items[fill[k]] = i
        fill[k] += 1
    return start, items


def successors(edge_end: Sequence[int], edge_source: Sequence[int]) -> tuple[array[int], array[int]]:
    """Outgoing edges by source node: node ``i``'s edge indices are ``edges[start[i]:start[i + 1]]``."""
    return grouped(edge_source, len(edge_end))


def targets(edge_end: Sequence[int]) -> array[int]:
    """Each edge's target node (the node whose incoming edges it is among)."""
    out = array("I")
    lo = 0
    for i, hi in enumerate(edge_end):
        out.extend([i] * (hi - lo))
        lo = hi
    return out


def indegrees(edge_end: Sequence[int]) -> array[int]:
    """Each node's number of incoming edges."""
    return array("I", (hi - (edge_end[i - 1] if i else 0) for i, hi in enumerate(edge_end)))


class Dependency(NamedTuple):
    """An incoming edge as a loader reads it: the predecessor's request id, trigger, relation, delay (ns)."""

    request_id: str
    trigger: int
    relation: int
    delay_ns: int
    field: str
    """Where the row names it (``dependencies[2]``, ``wait_for[0]``), for error messages."""


class Edge(NamedTuple):
    """An incoming edge of a loaded node: the predecessor's node index, trigger, relation and delay (ns)."""

    source: int
    trigger: int
    relation: int
    delay_ns: int


class Node(NamedTuple):
    """One node materialized (writers and tests read these; replay reads the columns)."""

    request_id: str
    play: str
    session: str
    model: str
    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int
    not_before_ns: int
    edges: tuple[Edge, ...]
    output_token_ids: tuple[int, ...] | None = None
    api_time_ns: int | None = None


@dataclass(frozen=True)
class Source:
    """Where a graph came from, as a v2 header says it: the original format and a digest of it (may be empty)."""

    format: str
    digest: str = ""


class TraceGraph:
    """A loaded trace's nodes and edges (see the module doc); equal graphs replay alike."""

    def __init__(self, b: GraphBuilder, source_file: str) -> None:
        self.block_size = b.block_size
        self.source = b.source
        self.file = source_file
        self._rid = bytes(b._rid)
        self._rid_end = b._rid_end
        self._hash = b._hash
        self._hash_end = b._hash_end
        self.input_length = b._input
        self.output_length = b._output
        self.not_before_ns = b._not_before
        self.session = b._session  # node → session index
        self.model = b._model  # node → model index
        self.line = b._line  # node → its line in the file read (not part of equality)
        self.sessions = b._session_names  # session index → its name
        self.session_keys = b._session_keys  # session index → its affinity key (see ``GraphBuilder.finish``)
        self.session_play = b._session_play  # session index → play index
        self.plays = b._plays  # play index → its name
        self.models = b._models
        self.edge_end = b._edge_end  # node → end of its incoming edges in the edge columns
        self.edge_source = b._edge_source
        self.edge_kind = b._edge_kind  # trigger | relation << 1
        self.edge_delay_ns = b._edge_delay
        self.output_token_ids = b._output_ids
        self.api_time_ns = b._api_time

    def __len__(self) -> int:
        return len(self.output_length)

    def request_id(self, i: int) -> str:
        """Node ``i``'s request id."""
        lo = self._rid_end[i - 1] if i else 0
        return self._rid[lo:self._rid_end[i]].decode()

    def hash_ids(self, i: int) -> array[int]:
        """Node ``i``'s hash ids (full 64 bits)."""
        lo = self._hash_end[i - 1] if i else 0
        return self._hash[lo:self._hash_end[i]]

    def edges(self, i: int) -> Iterator[Edge]:
        """Node ``i``'s incoming edges, in the order its row gave them."""
        lo = self.edge_end[i - 1] if i else 0
        for e in range(lo, self.edge_end[i]):
            k = self.edge_kind[e]
            yield Edge(self.edge_source[e], k & 1, k >> 1, self.edge_delay_ns[e])

    def play_of(self, i: int) -> int:
        """Node ``i``'s play index."""
        return self.session_play[self.session[i]]

    def node(self, i: int) -> Node:
        """Node ``i`` materialized."""
        return Node(self.request_id(i), self.plays[self.play_of(i)], self.sessions[self.session[i]],
                    self.models[self.model[i]], tuple(self.hash_ids(i)), self.input_length[i], self.output_length[i],
                    self.not_before_ns[i], tuple(self.edges(i)), self.output_token_ids.get(i), self.api_time_ns.get(i))

    def nodes(self) -> Iterator[Node]:
        """Every node, in file order."""
        return map(self.node, range(len(self)))

    def turn_count(self) -> int:
        """How many requests replay sends: one a node (as ``TraceSessions.turn_count`` counts rows)."""
        return len(self)

    def request_count(self) -> int:
        """How many requests replay sends: one a node."""
        return len(self)

    def start_times(self) -> Iterator[int]:
        """Each root's ready time (ns), in file order: when the graph's first requests may start."""
        return (self.not_before_ns[i] for i in self.roots())

    def in_words(self) -> str:
        """Its size in words, as ``kvemu validate`` prints it."""
        return (f"{counted(len(self.plays), 'play')} of {counted(len(self.sessions), 'session')}, "
                f"{counted(len(self), 'request')} ({counted(self.edge_count(), 'dependency', 'dependencies')})")

    def edge_count(self) -> int:
        """How many edges the graph holds."""
        return len(self.edge_source)

    def roots(self) -> Iterator[int]:
        """The nodes without incoming edges, in file order."""
        end = self.edge_end
        return (i for i in range(len(self)) if end[i] == (end[i - 1] if i else 0))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TraceGraph):
            return NotImplemented
        return (self.block_size == other.block_size and len(self) == len(other)
                and list(self.nodes()) == list(other.nodes()))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"TraceGraph({len(self)} nodes, {self.edge_count()} edges, {len(self.sessions)} sessions, "
                f"{len(self.plays)} plays, block_size={self.block_size})")

    def select(self, keep: Sequence[bool]) -> TraceGraph:
        """The graph of the kept nodes, in order; an edge from a dropped node drops its target too."""
        b = GraphBuilder(self.block_size, self.file, self.source)
        index = array("q", [-1]) * len(self)
        for i in range(len(self)):
            if not keep[i]:
                continue
            edges = list(self.edges(i))
            if any(index[e.source] < 0 for e in edges):
                continue
            n = self.node(i)
            index[i] = b.add(n.request_id, n.play, n.session, n.model, n.hash_ids, n.input_length,
                             n.output_length, n.not_before_ns, self.line[i],
                             [Dependency(self.request_id(e.source), e.trigger, e.relation, e.delay_ns, "")
                              for e in edges], output_token_ids=n.output_token_ids, api_time_ns=n.api_time_ns)
        return b.finish()

    def scaled(self, ratio: float) -> TraceGraph:
        """The same graph ``ratio`` times faster: ``not_before`` and every delay divided by it."""
        if ratio == 1.0:
            return self
        g = object.__new__(TraceGraph)
        g.__dict__.update(self.__dict__)
        g.not_before_ns = array("q", (round(t / ratio) for t in self.not_before_ns))
        g.edge_delay_ns = array("q", (round(t / ratio) for t in self.edge_delay_ns))
        return g


class GraphBuilder:
    """Collects nodes as a loader reads them, then resolves and checks their edges (``finish``)."""

    def __init__(self, block_size: int, file: str, source: Source) -> None:
        self.block_size = block_size
        self.file = file
        self.source = source
        self._rid = bytearray()
        self._rid_end = array("Q")
        self._hash = array("Q")
        self._hash_end = array("Q")
        self._input = array("Q")
        self._output = array("I")
        self._not_before = array("q")
        self._session = array("I")
        self._model = array("I")
        self._line = array("Q")
        self._session_names: list[str] = []
        self._session_keys: list[str] = []
        self._session_play = array("I")
        self._plays: list[str] = []
        self._models: list[str] = []
        self._edge_end = array("Q")
        self._edge_source = array("I")
        self._edge_kind = array("B")
        self._edge_delay = array("q")
        self._output_ids: dict[int, tuple[int, ...]] = {}
        self._api_time: dict[int, int] = {}
        self._index: dict[str, int] = {}  # while loading: request id → node
        self._session_index: dict[tuple[int, str], int] = {}
        self._play_index: dict[str, int] = {}
        self._model_index: dict[str, int] = {}
        self._pending: list[str] = []  # per edge, while loading: the predecessor's request id
        self._fields: list[str] = []  # ... and where its row named it

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._index

    def __len__(self) -> int:
        return len(self._output)

    def request_id_of(self, i: int) -> str:
        """Node ``i``'s request id (while loading)."""
        lo = self._rid_end[i - 1] if i else 0
        return self._rid[lo:self._rid_end[i]].decode()

    def add(self, request_id: str, play: str, session: str, model: str, hash_ids: Sequence[int], input_length: int,
            output_length: int, not_before_ns: int, line: int, deps: Sequence[Dependency], *,
            output_token_ids: Sequence[int] | None = None, api_time_ns: int | None = None,
            id_field: str = "request_id") -> int:
        """Adds a node (its row already checked field by field); returns its index. A repeated id is refused."""
        i = len(self._output)
        if request_id in self._index:
            raise self.error(line, id_field, f"request id {request_id!r} repeats line "
                             f"{self._line[self._index[request_id]]}; request ids must be unique")
        if len(session.encode()) > MAX_SESSION_BYTES:
            raise self.error(line, "session_id", f"the session id {session[:60]!r}... is {len(session.encode())} "
                             f"bytes, more than the {MAX_SESSION_BYTES} a router takes as an affinity key; shorten it")
        self._index[request_id] = i
        self._rid += request_id.encode()
        self._rid_end.append(len(self._rid))
        self._hash.extend(hash_ids)
        self._hash_end.append(len(self._hash))
        self._input.append(input_length)
        self._output.append(output_length)
        self._not_before.append(not_before_ns)
        p = _intern(self._play_index, self._plays, play, play)
        s = _intern(self._session_index, self._session_names, (p, session), session)
        if s == len(self._session_play):
            self._session_play.append(p)
        self._session.append(s)
        self._model.append(_intern(self._model_index, self._models, model, model))
        self._line.append(line)
        for d in deps:
            self._pending.append(d.request_id)
            self._fields.append(d.field)
            self._edge_kind.append(d.trigger | d.relation << 1)
            self._edge_delay.append(d.delay_ns)
        self._edge_end.append(len(self._pending))
        if output_token_ids is not None:
            self._output_ids[i] = tuple(output_token_ids)
        if api_time_ns is not None:
            self._api_time[i] = api_time_ns
        return i

    def error(self, line: int, field: str, what: str) -> InvalidArgument:
        """The error of a bad value: names the file, the line and the field."""
        return InvalidArgument(f"{self.file}:{line}: {field}: {what}", field=field)

    def finish(self) -> TraceGraph:
        """Resolves every edge's predecessor and refuses unknown, self- and cross-play dependencies, cycles and
        plays without a root; the graph then holds no id dictionaries."""
        index = self._index
        end = self._edge_end
        e = 0
        for i in range(len(self._output)):
            play = self._session_play[self._session[i]]
            while e < end[i]:
                rid = self._pending[e]
                src = index.get(rid)
                if src is None:
                    raise self.error(self._line[i], self._fields[e], f"depends on request id {rid!r}, which no row "
                                     "of the trace has; fix the id or add its row")
                if src == i:
                    raise self.error(self._line[i], self._fields[e], "a request cannot depend on itself")
                if self._session_play[self._session[src]] != play:
                    raise self.error(self._line[i], self._fields[e], f"depends on {rid!r} (line {self._line[src]}) of "
                                     f"play {self._plays[self._session_play[self._session[src]]]!r}, not its own "
                                     f"play {self._plays[play]!r}; dependencies stay within a play")
                self._edge_source.append(src)
                e += 1
        self._check_acyclic()
        self._check_roots()
        self._session_keys = self._affinity_keys()
        self._index = {}
        self._pending = []
        self._fields = []
        self._session_index = {}
        return TraceGraph(self, self.file)

    def _affinity_keys(self) -> list[str]:
        """Each session's affinity key: its name, or ``<play>:<name>`` when several plays use the name (plays are
        separate runs: a conversation of one must not pin another's); refused past ``MAX_SESSION_BYTES``."""
        plays: dict[str, int] = {}
        shared = set()
        for s, name in enumerate(self._session_names):
            if plays.setdefault(name, self._session_play[s]) != self._session_play[s]:
                shared.add(name)
        if not shared:
            return self._session_names
        keys = []
        for s, name in enumerate(self._session_names):
            key = f"{self._plays[self._session_play[s]]}:{name}" if name in shared else name
            if len(key.encode()) > MAX_SESSION_BYTES:
                line = self._line[self._session.index(s)]
                raise self.error(line, "session_id", f"session {name!r} is used by several plays, so its affinity "
                                 f"key is <play>:<session>, {len(key.encode())} bytes, more than "
                                 f"{MAX_SESSION_BYTES}; give the plays' sessions their own names")
            keys.append(key)
        return keys

    def _check_acyclic(self) -> None:
        """Kahn's algorithm over the edges; a node left over sits on a cycle (or after one)."""
        n = len(self._output)
        indegree = indegrees(self._edge_end)
        start, out = successors(self._edge_end, self._edge_source)
        target = targets(self._edge_end)
        ready = [i for i in range(n) if not indegree[i]]
        seen = 0
        while ready:
            i = ready.pop()
            seen += 1
            for e in out[start[i]:start[i + 1]]:
                j = target[e]
                indegree[j] -= 1
                if not indegree[j]:
                    ready.append(j)
        if seen < n:
            left = bytearray(1 if indegree[k] else 0 for k in range(n))
            on = self._on_cycle(left.index(1), left)
            lines = ", ".join(str(self._line[k]) for k in on)
            raise self.error(self._line[on[0]], self._fields_of(on[0]), f"cycle detected among the requests of "
                             f"lines {lines}; a request cannot wait, directly or not, for itself")

    def _fields_of(self, i: int) -> str:
        lo = self._edge_end[i - 1] if i else 0
        return self._fields[lo] if self._edge_end[i] > lo else "request_id"

    def _on_cycle(self, start: int, left: bytearray) -> list[int]:
        """The nodes of a cycle reached by walking back from ``start`` through the nodes Kahn's algorithm
        ``left`` (each has a predecessor left too)."""
        seen: dict[int, int] = {}
        path: list[int] = []
        i = start
        while i not in seen:
            seen[i] = len(path)
            path.append(i)
            lo = self._edge_end[i - 1] if i else 0
            preds = [self._edge_source[e] for e in range(lo, self._edge_end[i])]
            i = next(p for p in preds if left[p])
        return sorted(path[seen[i]:])

    def _check_roots(self) -> None:
        has_root = bytearray(len(self._plays))
        first_line: dict[int, int] = {}
        lo = 0
        for i in range(len(self._output)):
            p = self._session_play[self._session[i]]
            first_line.setdefault(p, self._line[i])
            if self._edge_end[i] == lo:
                has_root[p] = 1
            lo = self._edge_end[i]
        for p, line in first_line.items():
            if not has_root[p]:
                raise self.error(line, "dependencies", f"play {self._plays[p]!r} has no root (a request without "
                                 "dependencies): nothing in it could start")


def _intern(index: dict[Any, int], names: list[str], key: Any, name: str) -> int:
    """``key``'s number in ``index``, a new one (and ``name`` appended to ``names``) the first time."""
    k = index.setdefault(key, len(names))
    if k == len(names):
        names.append(name)
    return k
