"""What a worker registers of its engine (``EngineConfig.settings``, ``Register.engine``) and how a router refuses
a worker whose engine is not its scenario's (``engine_mismatch``): the README's separate-process recipe once ran
its workers on the default engine, 11x slower than the scenario said, with no word of it."""

from __future__ import annotations

import msgspec
import pytest

from kvemu.clock import ManualClock
from kvemu.hooks import Hooks
from kvemu.messages import MAX_KNOB_CHARS, EngineSettings, Register, RegisterAck, decode_worker_message, encode
from workers.config import EngineConfig

from harness.run.factories import engine_config, pool_router
from harness.scenario import parse_scenario

SCENARIO = "name: s\ncluster: {workers: 1, engine: {num_gpu_blocks: 4096, speedup_ratio: 4, decode_speedup_ratio: 4}}\n"


def test_the_digest_covers_every_knob_but_the_dp_size_and_not_how_a_number_was_written():
    base = EngineConfig().settings()
    assert EngineConfig(dp_size=8).settings() == base  # a worker's --dp-size is its own
    assert EngineConfig(speedup_ratio=4).settings() == EngineConfig(speedup_ratio=4.0).settings()
    for changed in (EngineConfig(speedup_ratio=4), EngineConfig(block_size=16), EngineConfig(backend="sglang"),
                    EngineConfig(max_num_seqs=128, max_num_batched_tokens=4096)):
        assert changed.settings().digest != base.digest
    assert len(base.digest) == 32 and all(len(v) <= MAX_KNOB_CHARS for _, v in base.knobs)
    assert "dp_size" not in dict(base.knobs)


def test_differences_name_the_knobs_that_differ_and_only_those():
    worker = EngineConfig(block_size=16).settings()
    scenario = EngineConfig(block_size=64, speedup_ratio=4).settings()
    assert worker.differences(scenario) == ("block_size=16, speedup_ratio=1.0", "block_size=64, speedup_ratio=4.0")
    many = EngineSettings(digest="ab", knobs=[(f"k{i}", str(i)) for i in range(12)])
    mine, theirs = many.differences(EngineSettings(digest="cd"), most=3)
    assert mine == "k0=0, k1=1, k2=2 and 9 more" and theirs == "k0=(none), k1=(none), k2=(none) and 9 more"
    assert EngineSettings(digest="ab").differences(EngineSettings(digest="cd")) == ("engine settings ab",
                                                                                    "engine settings cd")


@pytest.mark.parametrize("engine", [
    {"digest": "a" * 65, "knobs": []},
    {"digest": "not-hex", "knobs": []},
    {"digest": "ab", "knobs": [["speedup_ratio", "1" * (MAX_KNOB_CHARS + 1)]]},
    {"digest": "ab", "knobs": [["k", "v"]] * 65},
])
def test_a_registration_with_an_engine_past_its_bounds_is_refused_while_decoding(engine):
    raw = msgspec.msgpack.encode({"type": "Register", "worker_id": 1, "engine": engine})
    with pytest.raises(msgspec.ValidationError):
        decode_worker_message(raw)


class _Acks:
    """A router end that keeps what the router answers."""

    def __init__(self) -> None:
        self.sent: list[RegisterAck] = []

    def send_nowait(self, peer: bytes, msg: msgspec.Struct) -> None:
        self.sent.append(msg)  # type: ignore[arg-type]


def _register(engine: EngineConfig, **kw: object) -> tuple[RegisterAck, object]:
    end = _Acks()
    router = pool_router(parse_scenario(SCENARIO), "aggregated", clock=ManualClock(), end=end, hooks=Hooks(),
                         guarded=False)  # (in process, on a manual clock: no live-only bounds)
    msg = decode_worker_message(encode(Register(worker_id=7, engine=engine.settings(), **kw)))  # as on the wire
    router.on_message(b"w7", msg)
    return end.sent[-1], router


def test_a_router_refuses_a_worker_of_another_engine_naming_the_knobs_and_takes_its_own():
    ack, router = _register(EngineConfig())
    assert not ack.accepted and ack.reason == (
        "engine_mismatch: worker 7 runs num_gpu_blocks=16384, speedup_ratio=1.0, decode_speedup_ratio=1.0 where the "
        "router's scenario says num_gpu_blocks=4096, speedup_ratio=4.0, decode_speedup_ratio=4.0; start it with the "
        "router's scenario (kvemu worker --config FILE, the same --set), or with --own-engine if it differs on "
        "purpose")
    assert router.workers == {}
    scenario_engine = msgspec.structs.replace(engine_config(parse_scenario(SCENARIO).cluster), dp_size=3)
    ack, router = _register(scenario_engine)
    assert ack.accepted and list(router.workers) == [7]
    ack, router = _register(EngineConfig(), own_engine=True)  # a straggler on purpose
    assert ack.accepted and list(router.workers) == [7]
