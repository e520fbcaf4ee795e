"""``sglang.semantics: sglang-0.5.23``: the SGLang flavour decides as SGLang 0.5.23's own scheduler does.

These checks need no oracle: each step below is what SGLang 0.5.23 did on the same workload
(tests/oracle/test_sglang_differential.py runs it and compares every step), so they hold on a fresh clone too.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvemu.errors import InvalidArgument
from tests.oracle.kvemu_driver import run_kvemu_sglang
from tests.oracle.test_sglang_differential import EVIDENCE
from workers.config import EngineConfig, SglangConfig, SpeculativeConfig

EXACT = "sglang-0.5.23"


def steps(name: str, semantics: str = EXACT) -> list[dict[str, Any]]:
    return run_kvemu_sglang(EVIDENCE[name], semantics)  # type: ignore[arg-type]


def test_the_first_output_token_takes_its_slot_when_it_is_fed_back() -> None:
    # 256 slots, a 40-token prompt and 3 outputs: 40 after the prefill, then one per decode step; at the end the
    # prompt and the 2 tokens fed back are cached (the last one never is), so all 256 are free or evictable
    assert [r["free_tokens"] for r in steps("first_slot")] == [216, 215, 256]
    assert [r["free_tokens"] for r in steps("first_slot", "dynamo")] == [215, 214, 256]


def test_admission_charges_the_whole_prompt_and_waits_for_a_running_request_to_leave() -> None:
    records = steps("pressure")
    admitted = [(r["step"], r["admitted"]) for r in records if r["admitted"]]
    assert admitted == [(0, [["a", 0]]), (32, [["b", 0]])]  # b (60 + 5) does not fit beside a until a is done
    assert [r["scheduled"] for r in records[32:36]] == [[["b", 16]], [["b", 16]], [["b", 16]], [["b", 12]]]


def test_without_chunked_prefill_a_prompt_must_be_shorter_than_the_budget_left() -> None:
    records = steps("budget_boundary")
    assert [r["scheduled"] for r in records[:2]] == [[["a", 30]], [["b", 34]]]


def test_an_aborted_running_request_runs_one_more_decode_step_then_leaves_cached() -> None:
    records = steps("abort_running")
    assert records[4]["scheduled"] == [["a", 1], ["b", 1]] and records[4]["finished"] == [["a", "abort"]]
    assert records[4]["free_tokens"] == 244  # its 8 + 4 tokens are cached, evictable
    assert records[5]["admitted"] == [["c", 0]]  # its seat is free from the next step


def test_retraction_takes_the_last_of_the_tied_and_it_returns_with_its_prompt_only() -> None:
    records = steps("retraction")
    assert [(r["step"], r["preempted"]) for r in records if r["preempted"]] == [(47, ["b"])]
    assert [(r["step"], r["admitted"]) for r in records if r["step"] > 1 and r["admitted"]] == [(51, [["b", 2]])]
    assert records[-1]["step"] == 54


@pytest.mark.parametrize("change, field", [
    ({"block_size": 16}, "block_size"),
    ({"sglang": SglangConfig(semantics=EXACT, prefill_decode_interval=2)}, "sglang.prefill_decode_interval"),
    ({"speculative": SpeculativeConfig(method="mtp", num_speculative_tokens=2)}, "speculative"),
])
def test_the_sglang_semantics_refuse_what_they_were_not_checked_with(change: dict[str, Any], field: str) -> None:
    settings: dict[str, Any] = {"backend": "sglang", "block_size": 1, "sglang": SglangConfig(semantics=EXACT)}
    with pytest.raises(InvalidArgument) as err:
        EngineConfig(**{**settings, **change})
    assert err.value.field == field


def test_chunked_prefill_can_be_off_only_under_the_sglang_semantics() -> None:
    with pytest.raises(InvalidArgument) as err:
        EngineConfig(backend="sglang", enable_chunked_prefill=False)
    assert err.value.field == "enable_chunked_prefill" and "sglang-0.5.23" in str(err.value)
    cfg = EngineConfig(backend="sglang", block_size=1, enable_chunked_prefill=False,
                       sglang=SglangConfig(semantics=EXACT))
    assert cfg.sglang.semantics == EXACT
