"""The flags kvemu writes for third-party routers in front of a fleet, and the router specs bench-router takes."""

from __future__ import annotations

import msgspec
import pytest

from harness.external_routers import RouterSpec, RouterSpecError, fill_command, fleet_flags, parse_router, \
    router_folder, unique_labels
from harness.procs.fleet import FleetInfo, FleetWorker

from tests.raw_peer import NOT_HTTP, raw_peer


def _worker(wid: int, pool: str = "aggregated", dp: int = 2) -> FleetWorker:
    return FleetWorker(worker_id=wid, pool=pool, url=f"http://127.0.0.1:{9000 + wid}", dp_size=dp, block_size=64,
                       kv_events=[f"tcp://127.0.0.1:{7000 + 10 * wid + r}" for r in range(dp)],
                       kv_replay=[f"tcp://127.0.0.1:{8000 + 10 * wid + r}" for r in range(dp)])


AGG = FleetInfo(model="m", kv_events_version="0.33", workers=[_worker(0), _worker(1)])
PD = FleetInfo(model="m", kv_events_version="0.33",
               workers=[_worker(0, "prefill", 1), _worker(1, "decode", 1), _worker(2, "decode", 1)])


def test_vllm_router_gets_every_worker_its_ranks_kv_sources_in_rank_order_and_the_block_size():
    flags = fleet_flags("vllm-router", AGG)
    assert flags[:3] == ["--worker-urls", "http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    assert flags[flags.index("--intra-node-data-parallel-size") + 1] == "2"
    assert flags[flags.index("--kv-event-block-size") + 1] == "64"
    assert flags[flags.index("--kv-event-model") + 1] == "m"  # vllm-router refuses static sources without it
    sources = [flags[i + 1] for i, f in enumerate(flags) if f == "--kv-event-source"]
    assert sources == ["http://127.0.0.1:9000=tcp://127.0.0.1:7000,tcp://127.0.0.1:7001",
                       "http://127.0.0.1:9001=tcp://127.0.0.1:7010,tcp://127.0.0.1:7011"]
    replays = [flags[i + 1] for i, f in enumerate(flags) if f == "--kv-event-replay-source"]
    assert replays[0] == "http://127.0.0.1:9000=tcp://127.0.0.1:8000,tcp://127.0.0.1:8001"


def test_a_policy_other_than_kv_aware_gets_no_kv_event_sources():
    flags = fleet_flags("vllm-router", AGG, "round_robin")
    assert "--kv-event-source" not in flags and flags[-2:] == ["--policy", "round_robin"]


def test_sglang_router_learns_the_ranks_itself():
    assert fleet_flags("sglang-router", AGG) == ["--worker-urls", "http://127.0.0.1:9000", "http://127.0.0.1:9001",
                                                 "--dp-aware"]


def test_a_disaggregated_fleet_is_given_as_prefill_and_decode_lists():
    flags = fleet_flags("vllm-router", PD)
    assert flags[:7] == ["--vllm-pd-disaggregation", "--prefill", "http://127.0.0.1:9000", "--decode",
                         "http://127.0.0.1:9001", "--decode", "http://127.0.0.1:9002"]
    assert flags[flags.index("--pd-kv-events") + 1] == "http://127.0.0.1:9000=tcp://127.0.0.1:7000"
    assert fleet_flags("sglang-router", PD)[:6] == ["--pd-disaggregation", "--prefill", "http://127.0.0.1:9000", "9000",
                                                    "--decode", "http://127.0.0.1:9001"]  # the bootstrap port


@pytest.mark.parametrize("text, spec", [
    ("kvemu", RouterSpec("kvemu")),
    ("vllm-router", RouterSpec("vllm-router", "kv_aware")),
    ("vllm-router:round_robin", RouterSpec("vllm-router", "round_robin")),
    ("sglang-router", RouterSpec("sglang-router", "cache_aware")),
    ("cmd:my-router --port {port} {flags}", RouterSpec("cmd", command="my-router --port {port} {flags}")),
])
def test_router_specs(text, spec):
    assert parse_router(text) == spec


@pytest.mark.parametrize("text, words", [
    ("nginx", "one of kvemu"),
    ("sglang-router:kv_aware", "sglang-router's policies are"),
    ("cmd:", "the command is empty"),
    ("cmd:x {nope}", r"unknown placeholder \{nope\} in the cmd: router's command; known: \{flags\}, "
                     r"\{sglang_flags\}, \{workers\}, \{port\}"),
    ("cmd:x {port", r"expected '\}' before end of string"),
])
def test_a_bad_router_spec_says_what_it_takes(text, words):
    with pytest.raises(RouterSpecError, match=words):
        parse_router(text)


@pytest.mark.parametrize("command, label", [
    ("my-router --port {port} {flags}", "cmd:my-router"),
    ("/opt/venv/bin/python3.12 /home/me/tiny_proxy.py {port} {workers}", "cmd:tiny_proxy.py"),
    ("python -u -m my.router --port {port}", "cmd:my.router"),
    ("node proxy.js {port}", "cmd:proxy.js"),
])
def test_a_command_router_is_named_by_its_program_or_an_interpreters_script(command, label):
    assert parse_router(f"cmd:{command}").label == label


def test_routers_of_one_bench_never_share_a_label_or_a_folder():
    labels = ["cmd:p.py", "cmd:p.py", "kvemu:kv", "cmd:p.py-2", "cmd:a/b", "cmd:a-b", "cmd:p.py"]
    unique = unique_labels(labels)
    assert unique == ["cmd:p.py", "cmd:p.py-2", "kvemu:kv", "cmd:p.py-2-2", "cmd:a/b", "cmd:a-b-2", "cmd:p.py-3"]
    assert len({router_folder(label) for label in unique}) == len(labels)


def test_bench_router_help_states_the_cmd_contract(capsys):
    from harness.cli import main

    with pytest.raises(SystemExit):
        main(["bench-router", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "{workers} = the workers' URLs" in out and "{sglang_flags} =" in out
    assert "answer GET /health with 200 within 60 s" in out


def test_a_command_template_gets_the_fleet_filled_in():
    filled = fill_command("proxy --port {port} --to {workers} -- {flags}", AGG, 1234)
    assert filled.startswith("proxy --port 1234 --to http://127.0.0.1:9000 http://127.0.0.1:9001 -- --worker-urls")


# ---------------------------------------------------------------------- what the commands refuse before starting

EXAMPLES = __import__("pathlib").Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize("argv, words", [
    (["bench-router", str(EXAMPLES / "compose-disagg.yaml"), "--router", "kvemu"],
     "does not serve a disaggregated cluster"),
    (["fleet", str(EXAMPLES / "compose-chaos.yaml")], "cannot be applied by kvemu fleet"),
    (["bench-router", "--router", "nginx"], "one of kvemu"),
    (["bench-router", "--router", "cmd:proxy {prot} {workers}"], r"unknown placeholder \{prot\}"),
    (["bench-router", "--compress", "0.5"], "between 1 and 1000"),
    (["bench-router", str(EXAMPLES / "compose-chaos.yaml"), "--router", "kvemu"], "cannot be applied|not to kvemu's"),
    (["loadgen"], "give --router"),
    (["loadgen", "--http", "127.0.0.1:8000"], "an http:// or https:// URL"),
    (["worker"], "give --router"),
])
def test_the_fleet_commands_refuse_what_they_cannot_do_before_starting_anything(argv, words, capsys):
    from harness.cli import main

    assert main(argv) == 2
    assert __import__("re").search(words, capsys.readouterr().err)


def test_compression_speeds_up_every_pool_and_a_disaggregated_clusters_link():
    """``--compress 10``: arrivals, every pool's engine passes and the KV link ten times faster (a transfer is
    not shortened by a speed-up ratio), so that latencies scaled back by 10 read as uncompressed."""
    from harness.run.factories import engine_config
    from harness.router_bench import compress_overrides
    from harness.scenario import load_scenario

    agg = load_scenario(EXAMPLES / "quickstart.yaml")
    fast = load_scenario(EXAMPLES / "quickstart.yaml", compress_overrides(agg, 10))
    assert engine_config(fast.cluster).speedup_ratio == 10 * engine_config(agg.cluster).speedup_ratio
    assert fast.workload.rate_rps == 10 * agg.workload.rate_rps  # type: ignore[union-attr]
    pd = load_scenario(EXAMPLES / "compose-disagg.yaml")
    fast = load_scenario(EXAMPLES / "compose-disagg.yaml", compress_overrides(pd, 10))
    for pool in ("prefill", "decode"):
        assert engine_config(fast.cluster, pool).speedup_ratio == 10 * engine_config(pd.cluster, pool).speedup_ratio
    assert engine_config(fast.cluster, "prefill").kv_transfer_bandwidth == 250.0
    assert engine_config(fast.cluster, "decode").kv_transfer_bandwidth is None
    assert compress_overrides(pd, 1) == []


def test_a_caveat_says_when_vllm_routers_pd_kv_aware_cannot_read_the_fleets_blocks():
    from harness.external_routers import flag_caveats

    (caveat,) = flag_caveats("vllm-router", PD)  # 64-token blocks; --pd-kv-events reads 16
    assert "16-token blocks" in caveat and "64-token" in caveat and "block_size to 16" in caveat
    assert flag_caveats("vllm-router", PD, "round_robin") == [] and flag_caveats("sglang-router", PD) == []
    assert flag_caveats("vllm-router", AGG) == []  # --kv-event-block-size serves the aggregated sources
    small = FleetInfo(model="m", kv_events_version="0.33",
                      workers=[msgspec.structs.replace(w, block_size=16) for w in PD.workers])
    assert flag_caveats("vllm-router", small) == []


def test_the_routers_report_names_each_pool_and_every_caveat(tmp_path):
    from harness.report.routers import router_row, write_router_report

    row = {**router_row("vllm-router:kv_aware", None, 1.0), "caveats": ["reads 16-token blocks"]}
    write_router_report([row], tmp_path, {"scenario": "s", "requests": 3, "compress": 1.0,
                                          "pools": {"prefill": {"workers": 4, "dp_size": 1},
                                                    "decode": {"workers": 12, "dp_size": 2}}})
    text = (tmp_path / "routers.md").read_text()
    assert "4 prefill workers x 1 rank + 12 decode workers x 2 ranks" in text
    assert "- vllm-router:kv_aware: reads 16-token blocks" in text


def test_only_a_known_router_is_given_a_metrics_port():
    """vllm-router and sglang-router serve Prometheus where bench-router says; a ``cmd:`` router is told no such
    port, so bench-router must not read one (whoever holds it by then is a stranger)."""
    from harness.external_routers import router_command

    cmd = router_command(parse_router("vllm-router:round_robin"), AGG, 8000, 8001)
    assert cmd[cmd.index("--prometheus-port") + 1] == "8001"
    with pytest.raises(RouterSpecError, match="Prometheus"):
        router_command(parse_router("vllm-router:round_robin"), AGG, 8000, None)
    assert router_command(parse_router("cmd:proxy {port}"), AGG, 8000, None) == ["proxy", "8000"]


@pytest.mark.parametrize("answer", NOT_HTTP)
def test_a_metrics_port_answering_something_other_than_http_saves_nothing_and_raises_nothing(tmp_path, answer):
    """The Prometheus page is read at the end of a router's run from a port another process may hold by then (a
    ZeroMQ socket answers with its greeting): the row stands, and no page is written."""
    from harness.router_bench import _answers, _save

    with raw_peer(answer) as url:
        _save(f"{url}/metrics", tmp_path / "router-metrics.prom")
        assert _answers(f"{url}/health") == answer.startswith(b"HTTP/1.1 200")  # a status alone says ready
    assert not (tmp_path / "router-metrics.prom").exists()
