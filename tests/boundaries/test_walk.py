"""Every field kvemu decodes from a peer, a client or a file declares its bounds (issue #43, "By construction").

The decode sites are found in the source (``walk.decode_sites``): a new message in a union a decoder takes, or a
new decoder, is walked with no list to update. A field without a bound fails here unless it is listed below with
why: ``OPAQUE`` (a value the code checks itself, with its own error), ``PENDING`` (types another change bounds;
the lead removes each entry once it is merged: an entry that no longer matches anything fails too).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import pytest
from msgspec import Meta

from tests.boundaries.walk import decode_sites, unbounded

OPAQUE = {
    "CompletionRequest.prompt[]: Any": "a prompt's items (ids, texts or lists of ids): prompts_of checks them, and "
                                        "the list is bounded; a deep nesting is a 400 (tests/kvemu/http)",
    "CompletionRequest.logprobs: Any": "refused unless null/false by output_budget, with vLLM's message",
    "ChatRequest.logprobs: Any": "as CompletionRequest.logprobs",
    "CompletionRequest.data_parallel_rank: Any": "SGLang's rank pin: _body_rank checks it (0..RANK_MAX, an int)",
    "ChatRequest.data_parallel_rank: Any": "as CompletionRequest.data_parallel_rank",
    "BlockStored.extra_keys[]: Any": "vLLM's per-block extra keys, carried and never read by kvemu (list bounded)",
    "_ArrayBlockStored.extra_keys[]: Any": "as BlockStored.extra_keys (its array form)",
    "_DecodedRow.hash_ids[]: int": "u64 in JSON: _fast_row checks the top (2**64) and falls back to the checked path",
}

# PENDING: types whose bounds belong to another change of issue #43 (the lead removes an entry once it is merged:
# the test then holds the type to the rule). Empty: every type a decoder takes is bounded.
PENDING: dict[str, str] = {}

DYNAMIC = {
    ("kvemu.http.protocol", "kind"): "decode_body's own cache: every decode_body(body, T) call site is walked",
    ("harness.sweep.results", "kind"): "the sweep store's _decode(data, T): every _decode(data, T) call site is walked",
    ("harness.procs.http_loadgen", "page_type"): "TruthPage (walked from harness.procs.fleet)",
    ("harness.yaml_validation", "tp"): "a field type of the Scenario schema, already converted whole (walked from "
                                       "harness.scenario.loading), converted again field by field to list problems",
    ("harness.cli.processes", "FleetInfo"): "imported inside the function; walked from harness.router_bench",
    ("harness.cli.processes", "AdmissionLimits"): "imported inside the function (the CLI starts without prometheus); "
                                                  "walked as a field of harness.procs.protocol's messages",
}


def _violations() -> dict[str, list[str]]:
    """Each unbounded leaf, with the decode sites it is reached from."""
    found: dict[str, list[str]] = {}
    for site in decode_sites():
        if site.type is None:
            continue
        for leaf in unbounded(site.type, site.msgpack):
            found.setdefault(leaf, []).append(f"{site.module}:{site.line}")
    return found


def _allowed(leaf: str) -> bool:
    return leaf in OPAQUE or leaf.split(".", 1)[0] in PENDING


def test_every_field_a_decoder_takes_declares_its_bounds():
    bad = {leaf: where for leaf, where in _violations().items() if not _allowed(leaf)}
    assert not bad, "fields without a bound (use kvemu.limits' types):\n" + "\n".join(
        f"  {leaf}  (decoded at {', '.join(where)})" for leaf, where in sorted(bad.items()))


def test_every_allowance_still_names_an_unbounded_field():
    found = _violations()
    owners = {leaf.split(".", 1)[0] for leaf in found}
    stale = [k for k in OPAQUE if k not in found] + [t for t in PENDING if t not in owners]
    assert not stale, f"bounded now: remove from OPAQUE/PENDING: {stale}"


def test_every_own_conversion_left_out_is_still_in_the_source():
    """``OWN_FIGURES`` names real conversions (a stale entry would hide a decode site added there later)."""
    import ast

    from tests.boundaries.walk import OWN_FIGURES, ROOT

    for module, expr in OWN_FIGURES:
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        calls = [ast.unparse(n.args[1]) for n in ast.walk(tree) if isinstance(n, ast.Call) and len(n.args) >= 2
                 and ast.unparse(n.func) == "msgspec.convert"]
        assert expr in calls, (module, expr)


def test_every_decode_site_names_its_type():
    sites = decode_sites()
    unresolved = {(s.module, s.expr) for s in sites if s.type is None}
    assert unresolved <= set(DYNAMIC), unresolved - set(DYNAMIC)
    types = {s.type for s in sites}
    from harness.procs.protocol import ClientMessage, ReplyMessage
    from kvemu.kv_events import KVEventBatch
    from kvemu.messages import ClientRequest, RouterMessage, WorkerMessage
    from kvemu.replica_sync import SyncBatch

    assert {WorkerMessage, RouterMessage, ClientRequest, ClientMessage, ReplyMessage, SyncBatch,
            KVEventBatch} <= types
    assert len(sites) >= 20


class _Inner(msgspec.Struct):
    n: int
    f: Annotated[float, Meta(ge=0)]


class _Probe(msgspec.Struct, tag=True):
    s: str
    ok: Annotated[str, Meta(max_length=3)]
    b: bytes | None
    xs: Annotated[list[Annotated[int, Meta(ge=0, le=9)]], Meta(max_length=2)]
    d: dict[str, Annotated[int, Meta(ge=0, le=1)]]
    t: tuple[Annotated[str, Meta(max_length=2)], _Inner]
    a: Any = None


def test_the_walk_finds_each_kind_of_missing_bound():
    assert sorted(unbounded(_Probe)) == sorted([
        "_Probe.s: str", "_Probe.b: bytes", "_Probe.d: dict", "_Probe.d{key}: str", "_Inner.n: int",
        "_Inner.f: float (not finite)", "_Probe.a: Any"])


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -float("inf")])
def test_a_float_with_both_bounds_refuses_what_is_not_finite(value):
    from kvemu.limits import Finite

    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=Finite)
