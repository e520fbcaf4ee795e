"""``kvemu bench-router``: the same workload through several routers, each in front of a fresh kvemu fleet.

For each router: a fleet (``kvemu fleet``; for ``kvemu``, ``kvemu serve --in-process``: its router, workers and
front door in one process, as a fleet's workers share one), the
router started with the flags for that fleet (``harness.external_routers``), the workload replayed through it
over HTTP (``harness.procs.http_loadgen``, engine truth merged), everything stopped; then ``routers.md``,
``routers.json`` and ``routers.png`` (``harness.report.routers``). With ``compress`` > 1, arrivals and engine
passes run that many times faster and the report's latencies are scaled back.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvemu.errors import KvemuError

from harness.run.factories import engine_config
from harness.external_routers import KNOWN_ROUTERS, READY_PATHS, READY_TIMEOUT_S, RouterSpec, RouterSpecError, \
    flag_caveats, router_command, router_folder, unique_labels
from harness.run.interrupts import held_signals
from harness.run.pools import AGGREGATED
from harness.procs.fleet import FleetInfo, FleetWorker
from harness.procs.http_loadgen import PromptForm, http_loadgen_report
from harness.procs.up import Children, NotStarted, read_whole
from harness.report.routers import router_row, write_router_report
from harness.report.summary_types import Summary
from harness.run.runner import NothingRan
from harness.scenario import RunOrigin, Scenario, parse_scenario, scenario_text
from harness.scenario.sections import TraceWorkload
from harness.text import counted
from harness.workload.build import build_sessions, count_requests

__all__ = ["bench_routers", "BenchInterrupted", "compress_overrides", "READY_TIMEOUT_S"]


def compress_overrides(scenario: Scenario, factor: float) -> list[str]:
    """The ``--set`` overrides that run ``scenario`` ``factor`` times faster: arrivals (a trace's
    ``arrival_speedup_ratio``; a synthetic workload's rate and think time), every engine pass of every pool,
    and a disaggregated cluster's KV transfers (their link, which no speed-up ratio shortens)."""
    if factor == 1:
        return []
    w = scenario.workload
    out = []
    for pool in scenario.cluster.pools():
        engine = engine_config(scenario.cluster, pool)
        at = "cluster.engine" if pool == AGGREGATED else f"cluster.{pool}.engine"
        out.append(f"{at}.speedup_ratio={engine.speedup_ratio * factor:g}")
        if engine.kv_transfer_bandwidth is not None:
            out.append(f"{at}.kv_transfer_bandwidth={engine.kv_transfer_bandwidth * factor:g}")
    if isinstance(w, TraceWorkload):
        out.append(f"workload.arrival_speedup_ratio={w.arrival_speedup_ratio * factor:g}")
    else:
        out += [f"workload.rate_rps={w.rate_rps * factor:g}", f"workload.think_time_s={w.think_time_s / factor:g}"]
    if scenario.run.duration_s is not None:  # the same sessions in a shorter time, not more of them
        out.append(f"run.duration_s={scenario.run.duration_s / factor:g}")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - a 127.0.0.1 URL this process made
            return bool(resp.status == 200)
    except (OSError, http.client.HTTPException):
        return False


def _wait_ready(base: str, proc: subprocess.Popen, paths: tuple[str, ...], timeout_s: float) -> str | None:
    """Wait until the router answers 200 on every one of ``paths``; why not (None: ready)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the router exited with code {proc.returncode} before it was ready"
        if all(_answers(f"{base}{p}") for p in paths):
            return None
        time.sleep(0.25)
    return f"the router did not answer {' and '.join(paths)} within {timeout_s:g} s"


def _save(url: str, path: Path) -> None:
    """A router's Prometheus page, as it was at the end of its run (nothing when it does not answer with a whole
    HTTP page)."""
    try:
        path.write_bytes(read_whole(url, 64 << 20, 5))
    except (OSError, http.client.HTTPException):
        pass


def _kvemu_fleet(started: dict[str, Any], scenario: Scenario) -> FleetInfo:
    """``kvemu serve --in-process``'s start line as a fleet: its workers, whose engine truth its front door
    serves (so every worker's ``url`` is the front door's)."""
    return FleetInfo(model="kvemu", kv_events_version=scenario.cluster.kv_events_version, workers=[
        FleetWorker(worker_id=wid, pool="aggregated", url=started["http"], dp_size=started["dp_size"],
                    block_size=engine_config(scenario.cluster).resolved_block_size, kv_events=[], kv_replay=[])
        for wid in started["worker_ids"]])


TOKEN_ID_ROUTERS = frozenset({"kvemu", "vllm-router"})
"""Routers that take token-id prompts (vllm-router hashes them as they are; for text it asks every worker to
tokenize it). The others get text, which the fleet's tokenizer maps back to the same ids."""


def prompt_form_for(spec: RouterSpec, asked: str) -> PromptForm:
    """The prompt form ``spec`` gets: as ``asked``, or for ``auto`` token ids where the router takes them."""
    if asked == "auto":
        return "tokens" if spec.kind in TOKEN_ID_ROUTERS else "text"
    return "tokens" if asked == "tokens" else "text"


def _run_one(spec: RouterSpec, label: str, scenario: Scenario, config: list[str], outdir: Path, compress: float,
             prompt_form: PromptForm, origin: RunOrigin,
             summaries: dict[str, Summary]) -> tuple[dict[str, Any], str | None]:
    """``spec``'s row, and the signal that stopped the benchmark during it (None: none did). Its fleet and router
    run in process groups of their own, so that a terminal's Ctrl-C reaches this process alone: the load generator
    stops, asks the fleet (still serving) for its truth and writes the partial report, then they are stopped; a
    signal while they stop kills them at once."""
    kids = Children(own_groups=True)
    t0 = time.monotonic()
    try:
        row = _bench_one(kids, spec, label, scenario, config, outdir / router_folder(label), compress, prompt_form,
                         origin, t0, summaries)
    except KeyboardInterrupt as exc:  # while its fleet or router started: nothing went through it
        reason = getattr(exc, "reason", "SIGINT")
        row = {**router_row(label, None, time.monotonic() - t0, error=f"interrupted ({reason}) before its run"),
               "partial": reason}
    caught: list[str] = []
    hurry = threading.Event()
    with held_signals(caught, say="killing the router and its fleet now", hurry=hurry):
        kids.stop_all(hurry=hurry)
    return row, row.get("partial") or (caught[0] if caught else None)


def _bench_one(kids: Children, spec: RouterSpec, label: str, scenario: Scenario, config: list[str], where: Path,
               compress: float, prompt_form: PromptForm, origin: RunOrigin, t0: float,
               summaries: dict[str, Summary]) -> dict[str, Any]:
    """Start ``spec``'s fleet and router among ``kids`` and replay the workload through it into ``where``; its row
    (``partial``: the signal that stopped its run, whose partial report is written); its run's summary goes to
    ``summaries`` (by label)."""
    caveats: list[str] = []
    metrics_port = None
    where.mkdir(parents=True, exist_ok=True)
    try:
        if spec.kind == "kvemu":
            started = kids.start("serve", ["serve", *config, "--http", "127.0.0.1:0", "--in-process"], timeout_s=120)
            fleet, url = _kvemu_fleet(started, scenario), started["http"]
        else:
            fleet = _fleet_info(kids.start("fleet", ["fleet", *config], timeout_s=120))
            port = _free_port()
            metrics_port = _free_port() if spec.kind in KNOWN_ROUTERS else None  # a cmd: router is given none
            cmd = router_command(spec, fleet, port, metrics_port)
            (where / "router-command.txt").write_text(" ".join(cmd) + "\n")
            for caveat in (caveats := flag_caveats(spec.kind, fleet, spec.policy)):
                print(f"kvemu bench-router: {label}: {caveat}", file=sys.stderr, flush=True)
            with open(where / "router.log", "wb") as log:
                router = kids.spawn("router", cmd, log)
            url = f"http://127.0.0.1:{port}"
            why = _wait_ready(url, router, READY_PATHS[spec.kind], READY_TIMEOUT_S)
            if why is not None:
                return router_row(label, None, time.monotonic() - t0, error=f"{why} (see {where / 'router.log'})")
        print(f"kvemu bench-router: {label}: replaying through {url}", file=sys.stderr, flush=True)
        summary, _ = http_loadgen_report(scenario, url, where, fleet=fleet, prompt_form=prompt_form,
                                         compress=compress, origin=origin,
                                         command=f"kvemu bench-router ({label})")
        if metrics_port is not None:  # what the router says it did (its retries, errors): beside the report
            _save(f"http://127.0.0.1:{metrics_port}/metrics", where / "router-metrics.prom")
        summaries[label] = summary
        row = {**router_row(label, summary, time.monotonic() - t0), "prompt": prompt_form, "caveats": caveats}
        stopped = summary.kvemu.stop_reason
        if stopped in ("SIGINT", "SIGTERM"):  # the user stops the benchmark (this router's partial report is kept)
            row["partial"] = stopped
        return row
    except (RouterSpecError, OSError, NotStarted) as exc:
        return router_row(label, None, time.monotonic() - t0, error=str(exc))


def _fleet_info(started: dict[str, Any]) -> FleetInfo:
    import msgspec

    return msgspec.convert(started, FleetInfo)


class BenchInterrupted(KvemuError, RuntimeError):
    """A signal (``reason``) stopped ``kvemu bench-router`` during ``router``; ``rows`` (that router's partial,
    routers after it absent) are written in ``outdir``'s routers.md, marked partial."""

    def __init__(self, reason: str, router: str, rows: list[dict[str, Any]], outdir: Path) -> None:
        whole = sum(1 for r in rows if not r.get("partial"))
        cut = ", 1 stopped part way" if rows[-1].get("partial") and not rows[-1].get("error") else ""
        super().__init__(f"interrupted ({reason}) during {router}: {counted(whole, 'router')} benchmarked{cut}; "
                         f"the table so far (partial) in {outdir / 'routers.md'}")
        self.reason = reason
        self.rows = rows

    @property
    def exit_code(self) -> int:
        """130 for SIGINT (Ctrl-C), 143 for SIGTERM."""
        return 143 if self.reason == "SIGTERM" else 130


def bench_routers(scenario_path: str | None, overrides: list[str], routers: list[RouterSpec], outdir: Path,
                  compress: float = 1.0, prompt_form: str = "auto",
                  summaries: dict[str, Summary] | None = None) -> tuple[list[dict[str, Any]], str]:
    """Run the workload through each router; returns the rows and the markdown table (also written in
    ``outdir``); each router's run summary goes to ``summaries`` (by label), as it ends. A signal (Ctrl-C, SIGTERM) stops it: the table of the routers run so far is written, the one it
    stopped marked partial, and ``BenchInterrupted`` says so."""
    base = _load(scenario_path, overrides)
    overrides = [*overrides, *compress_overrides(base, compress)]
    scenario = _load(scenario_path, overrides)
    origin = RunOrigin.of("kvemu bench-router", scenario_path, overrides)  # (--compress's overrides too)
    config = ([str(Path(scenario_path).resolve())] if scenario_path else []) + \
        [x for o in overrides for x in ("--set", o)]  # kvemu serve's and kvemu fleet's arguments
    try:
        requests = count_requests(build_sessions(scenario))
    except KeyboardInterrupt as exc:
        raise NothingRan("generating the workload", getattr(exc, "reason", "SIGINT")) from None
    rows = []
    summaries = {} if summaries is None else summaries
    interrupted: dict[str, str] | None = None
    started = time.monotonic()
    labels = unique_labels([spec.label if spec.kind != "kvemu" else f"kvemu:{scenario.router.policy}"
                            for spec in routers])
    for spec, label in zip(routers, labels, strict=True):
        row, stopped = _run_one(spec, label, scenario, config, outdir, compress, prompt_form_for(spec, prompt_form),
                                origin, summaries)
        rows.append(row)
        print(f"kvemu bench-router: {row['router']}: {row['completed']} completed, {row['failed']} failed"
              + (f" (PARTIAL: {row['partial']})" if row.get("partial") else "")
              + (f"; {row['error']}" if row.get("error") else "") + f" ({row['wall_s']:.0f} s)", file=sys.stderr,
              flush=True)
        if stopped is not None:
            interrupted = {"signal": stopped, "router": label}
            break
    not_run = labels[len(rows):]
    pools = scenario.cluster.pools()
    about = {"scenario": scenario.name, "requests": requests,
             "pools": {pool: {"workers": n, "dp_size": dp} for pool, (n, dp, _) in pools.items()},
             "workers": sum(n for n, _, _ in pools.values()), "compress": compress,
             "prompt": prompt_form, "wall_s": round(time.monotonic() - started, 1),
             "routers": [r["router"] for r in rows], "interrupted": interrupted, "not_run": not_run}
    with held_signals([], say="the routers' table is being written; kvemu stops once it is"):
        table = write_router_report(rows, outdir, about)
    if interrupted is not None:
        raise BenchInterrupted(interrupted["signal"], interrupted["router"], rows, outdir)
    print(f"kvemu bench-router: {counted(len(rows), 'router')} in {about['wall_s']:g} s; "
          f"{outdir / 'routers.md'}", file=sys.stderr)
    return rows, table


def _load(scenario_path: str | None, overrides: list[str]) -> Scenario:
    text, base_dir, source = scenario_text(scenario_path)  # a YAML file, a trace .jsonl or the built-in
    return parse_scenario(text, base_dir=base_dir, overrides=overrides, source=source)

