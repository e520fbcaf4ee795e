"""A workload's three forms (a list of sessions, a loaded trace's sessions column-wise, a trace's graph) answer what
their callers ask as ``Workload`` methods, so that no caller asks which form it holds but the one place that picks
the player (``play_workload``): it was an ``isinstance`` switch in 9 places."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from harness.scenario import TraceWorkload
from harness.workload import count_requests, load_trace
from harness.workload.trace_sessions import start_times, turn_count
from harness.workload.traces.formats import load_graph
from harness.workload.turns import Session, SessionList, Turn

ROOT = Path(__file__).resolve().parents[2]
MS = 1_000_000
FORMS = {"TraceGraph", "TraceSessions", "SessionList"}


def _trace(tmp_path: Path) -> Path:
    """Session ``a`` of two turns (at 0, then 5 ms after its first ended) and a standalone row at 2 ms."""
    rows = [{"timestamp": 0, "hash_ids": [1], "input_length": 4, "output_length": 2, "session_id": "a"},
            {"timestamp": 2, "hash_ids": [2], "input_length": 4, "output_length": 2},
            {"delay": 5, "hash_ids": [1, 3], "input_length": 8, "output_length": 2, "session_id": "a"}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_form_of_a_trace_answers_alike(tmp_path: Path) -> None:
    path = _trace(tmp_path)
    trace = load_trace(TraceWorkload(trace=str(path), trace_block_size=4), path)
    graph = load_graph(path, block_size=4)
    for form in (trace, graph, SessionList(trace)):
        assert form.request_count() == count_requests(form) == 3
        assert form.turn_count() == turn_count(form) == 3
        assert list(form.start_times()) == list(start_times(form)) == [0, 2 * MS]
    assert trace.in_words() == SessionList(trace).in_words() == "2 sessions, 3 requests"
    assert graph.in_words() == "2 plays of 2 sessions, 3 requests (1 dependency)"


def test_a_list_of_sessions_counts_each_sub_agent_as_a_request() -> None:
    sessions = SessionList([Session("a", 7 * MS, [Turn([1], 2, sub_agents=(([2], 1), ([3], 1))), Turn([4], 2)]),
                            Session("b", 1 * MS, [Turn([5], 2)])])
    assert (sessions.turn_count(), sessions.request_count()) == (3, 5)
    assert list(sessions.start_times()) == [7 * MS, 1 * MS]  # in the list's order, as the player takes them
    assert sessions.in_words() == "2 sessions, 5 requests (3 turns + 2 sub-agent requests)"
    assert len(sessions) == 2 and sessions[1].session_id == "b" and [s.session_id for s in sessions] == ["a", "b"]


def _form_switches(path: Path) -> list[str]:
    """``function:line`` of each ``isinstance`` test of a workload's form in the module at ``path``."""
    found = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" and \
                len(node.args) == 2 and FORMS & {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}:
            found.append(f"{path.relative_to(ROOT)}:{func}:{node.lineno}")
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_only_the_player_picker_asks_which_form_a_workload_is() -> None:
    """Counting, start times and ``kvemu validate``'s words are methods of each form; a form's own ``__eq__``
    aside, only ``play_workload`` (which picks ``GraphPlayer``/``LanePlayer`` or ``SessionPlayer``) asks."""
    found = [hit for path in sorted((ROOT / "harness").rglob("*.py")) for hit in _form_switches(path)
             if ":__eq__:" not in hit]
    assert found == ["harness/workload/sessions.py:play_workload:" + found[0].rsplit(":", 1)[1]], found
