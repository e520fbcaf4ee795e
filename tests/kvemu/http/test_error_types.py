"""Every HTTP status kvemu answers with has its own OpenAI-style error type: a client's 4xx is never typed as the
server's fault."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

from kvemu.http.errors import ERROR_TYPES, ApiError, error_body

REPO = Path(__file__).resolve().parents[3]


def _literal_statuses() -> set[int]:
    """Statuses written as literals in ``ApiError(...)``, ``error_body(...)`` and ``respond(send, ...)`` calls."""
    found: set[int] = set()
    for path in [*(REPO / "kvemu").rglob("*.py"), *(REPO / "harness").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            args = node.args[1:2] if name == "respond" else node.args[:1]
            if name in ("ApiError", "error_body", "respond"):
                found |= {a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, int)
                          and a.value >= 400}
    return found


def test_every_status_kvemu_answers_with_has_its_own_error_type():
    statuses = _literal_statuses()
    assert {400, 403, 404, 413, 503} <= statuses  # the walk finds them
    assert statuses <= ERROR_TYPES.keys(), sorted(statuses - ERROR_TYPES.keys())


@pytest.mark.parametrize(("status", "kind"), [(403, "PermissionDeniedError"), (408, "RequestTimeoutError"),
                                              (410, "GoneError"), (502, "BadGatewayError"),
                                              (504, "GatewayTimeoutError"), (418, "BadRequestError"),
                                              (599, "InternalServerError")])
def test_a_status_is_typed_by_what_it_means(status, kind):
    body = msgspec.json.decode(ApiError(status, "no").body)
    assert body == {"error": {"message": "no", "type": kind, "param": None, "code": status}}
    assert msgspec.json.decode(error_body(status, "no"))["error"]["type"] == kind
