"""report.md: the summary and the run, as tables a reader scans (and the shared cell formats), with the terms it
uses defined at its end; a table with nothing but zeros says "(none)" instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from msgspec import UnsetType

from harness.report.autoscale import autoscale_markdown
from harness.report.plot_drawing import REGRET_PLOT
from harness.report.plots import PLOTS
from harness.report.run_data import RunData
from harness.report.summary import KV_COUNTERS, NS_PER_S
from harness.report.summary_types import Lanes, Regret, Replicas, SlaSection, Summary
from harness.report.what_ran import what_ran_lines


def fmt(value: object, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}{unit}"
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.01:
            return f"{value:.3g}{unit}"
        return f"{value:,.2f}{unit}" if abs(value) < 1e6 else f"{value:,.0f}{unit}"
    return f"{value}{unit}"


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _cell(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


_NOTHING = re.compile(r"[\s0.,/%()—–-]*")
"""A formatted cell that says zero or nothing (``0``, ``0.00 ms``, ``—``, ``0 / 0 (0.0%)``) once its unit is gone."""
_UNITS = re.compile(r"\b(?:ms|tok/s|req/s|tok|s|worker-s)\b")


def _says_nothing(cell: object) -> bool:
    return _NOTHING.fullmatch(_UNITS.sub("", str(cell))) is not None


def table(header: Sequence[str], rows: Iterable[Sequence[object]], labels: int = 1) -> list[str]:
    """A markdown table; or ``(none)`` when every cell but the first ``labels`` of each row (what names the row) is
    zero or empty: a table of zeros tells the reader nothing a word does not."""
    rows = [list(row) for row in rows]
    if all(_says_nothing(c) for row in rows for c in row[labels:]):
        return ["(none)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _goodput_rows(s: Summary, sla: SlaSection | UnsetType) -> list[tuple[str, str]]:
    """Headline rows for goodput next to throughput (none without an SLA)."""
    if isinstance(sla, UnsetType):
        return []
    targets = ", ".join(f"{label} ≤ {fmt(target, ' ms')}"
                        for label, target in (("TTFT", sla.ttft_ms), ("ITL", sla.itl_ms), ("E2E", sla.e2e_ms))
                        if target is not None)
    return [("SLA", targets),
            ("requests meeting the SLA", f"{fmt(s.goodput_completed_requests)} ({pct(sla.met_ratio)})"),
            ("goodput", fmt(s.goodput_request_throughput_rps, " req/s")),
            ("goodput output throughput", fmt(s.goodput_output_throughput_tok_s, " tok/s"))]


def render_markdown(summary: Summary, data: RunData, plots: Sequence[str] = PLOTS) -> str:
    """report.md: what ran, the headline numbers, per-rank, routing truth, affinity, queue, KV events."""
    k = summary.kvemu
    s = summary
    out: list[str] = [f"# {data.command}: {k.scenario}", ""]
    if k.partial:
        why = f" ({k.stop_reason})" if k.stop_reason else ""
        out += [f"> **PARTIAL RUN — this report covers only what finished before the run was interrupted{why}.**",
                "> Requests still in flight are counted as unfinished; throughputs and latencies are incomplete.",
                ""]
    ranks = k.per_rank
    workers = sorted({r.worker_id for r in ranks})
    out += ["## What ran", "",
            f"- scenario `{k.scenario}`, mode `{k.mode}`, seed {k.seed}",
            f"- {len(workers)} workers, {len(ranks)} ranks, router block size {k.block_size}",
            f"- scenario time {fmt(s.duration_ms, ' ms')} (first arrival → last completion), "
            f"wall time {fmt(s.wall_time_ms, ' ms')}",
            *(what_ran_lines(data.scenario, data.origin) if data.scenario is not None else []),
            ""]
    out += ["## Headline", ""]
    out += table(["metric", "value"], [
        ("requests", fmt(s.num_requests)),
        ("completed", fmt(s.completed_requests)),
        ("failed", fmt(k.failed_requests)),
        ("unfinished", fmt(k.unfinished_requests)),
        ("request throughput", fmt(s.request_throughput_rps, " req/s")),
        *_goodput_rows(s, k.sla),
        ("output throughput", fmt(s.output_throughput_tok_s, " tok/s")),
        ("total throughput", fmt(s.total_throughput_tok_s, " tok/s")),
        ("prefix cache reuse (engine)", pct(s.prefix_cache_reused_ratio)),
    ])
    out += [""]
    if k.concurrency is not None:
        out += [f"Closed loop: at most {k.concurrency} sessions in flight, each next one starting when one "
                "ended (arrival times are when they were sent).", ""]
    if not isinstance(k.lanes, UnsetType):
        out += _lanes_lines(k.lanes)
    out += table(["latency (ms)", "mean", "p50", "p90", "p99", "max"], [
        ("TTFT", *map(fmt, (s.mean_ttft_ms, s.median_ttft_ms, s.p90_ttft_ms, s.p99_ttft_ms, s.max_ttft_ms))),
        ("TTST", *map(fmt, (s.mean_ttst_ms, s.median_ttst_ms, s.p90_ttst_ms, s.p99_ttst_ms, s.max_ttst_ms))),
        ("TPOT", *map(fmt, (s.mean_tpot_ms, s.median_tpot_ms, s.p90_tpot_ms, s.p99_tpot_ms, s.max_tpot_ms))),
        ("ITL", *map(fmt, (s.mean_itl_ms, s.median_itl_ms, s.p90_itl_ms, s.p99_itl_ms, s.max_itl_ms))),
        ("E2E", *map(fmt, (s.mean_e2e_latency_ms, s.median_e2e_latency_ms, s.p90_e2e_latency_ms,
                           s.p99_e2e_latency_ms, s.max_e2e_latency_ms))),
    ])
    out += ["", f"Per-user output speed: mean {fmt(s.mean_output_token_throughput_per_user, ' tok/s')}, "
                f"p50 {fmt(s.median_output_token_throughput_per_user, ' tok/s')}.", ""]
    spec = k.speculative
    if not isinstance(spec, UnsetType):
        gaps = spec.itl_per_pass_ms
        out += [f"Speculative decoding ({spec.method}, {spec.num_speculative_tokens} draft tokens): "
                f"{fmt(spec.tokens_per_decode_pass)} tokens per decode pass (expected "
                f"{fmt(spec.expected_tokens_per_decode_pass)}). A pass's tokens arrive together, so ITL counts "
                f"their zero gaps; between passes: mean {fmt(gaps.mean, ' ms')}, p50 {fmt(gaps.median, ' ms')}, "
                f"p99 {fmt(gaps.p99, ' ms')}. TPOT is the per-request mean, per token.", ""]
    out += ["## Per rank", ""]
    out += table(["worker", "rank", "requests", "completed", "failed", "input tok", "output tok", "cache reuse",
                   "mean active", "max active", "max KV blocks"],
                  [(r.worker_id, r.dp_rank, fmt(r.requests), fmt(r.completed_requests),
                    fmt(r.failed_requests), fmt(r.input_tokens), fmt(r.output_tokens),
                    pct(r.prefix_cache_reused_ratio), fmt(r.mean_active_requests),
                    fmt(r.max_active_requests), fmt(r.max_kv_blocks)) for r in ranks], labels=2)
    idle = [f"{r.worker_id}/{r.dp_rank}" for r in ranks if r.requests == 0]
    dis = k.disaggregated
    if idle and isinstance(dis, UnsetType):
        out += ["", f"Ranks that served no request: {', '.join(idle)}."]
    if not isinstance(dis, UnsetType):
        pools = ", ".join(f"{p['workers']} {name} workers × {p['dp_size']} DP ranks" for name, p in dis.pools.items())
        out += ["", "## Disaggregated serving", "", f"Pools: {pools}. The per-rank table counts decode ranks; "
                f"prefill ranks served {fmt(sum(dis.requests_per_prefill_rank.values()))} prompts "
                f"({', '.join(f'{r}: {n}' for r, n in dis.requests_per_prefill_rank.items())}).", ""]
        out += table(["per request (ms)", "mean", "p50", "p99", "max"], [
            (label, fmt(st.mean), fmt(st.median), fmt(st.p99), fmt(st.max))
            for label, st in (("KV transfer (reserved → received)", dis.kv_transfer_ms),
                              ("wait for decode room (prefill end → reserved)", dis.decode_reservation_wait_ms))])
        out += ["", "KV blocks per rank: a prefill rank's are the blocks its router indexed from its KV events; a "
                    "decode rank publishes none (its KV arrives by transfer), so its are the decode router's active "
                    "blocks (booked prompts and outputs)."]
        out += ["", f"Cost: prefill {fmt(s.prefill_worker_seconds, ' worker-s')}, decode "
                    f"{fmt(s.decode_worker_seconds, ' worker-s')}, {fmt(s.gpu_hours)} GPU hours."]
    tiers = k.cache_tiers
    if not isinstance(tiers, UnsetType):
        out += ["", "## Cache hits per tier", "",
                "Prompt tokens each request found cached at its first admission, on the GPU (g1) or loaded from "
                "the engine's host tier.", ""]
        out += table(["tier", "cached tokens", "of input tokens"], [
            ("GPU (g1)", fmt(tiers.g1_cached_tokens), pct(tiers.g1_cached_ratio)),
            ("host", fmt(tiers.host_cached_tokens), pct(tiers.host_cached_ratio))])
        out += ["", f"{fmt(tiers.requests_with_host_hits)} of {fmt(tiers.requests)} requests loaded blocks "
                    "from the host."]
    rt = k.routing
    out += ["", "## Routing truth: predicted vs engine-found cache", "",
            "The router predicts a cached prefix from its (possibly stale) view of KV events; the engine reports "
            "the prefix it actually found at admission, so the gap measures how wrong the router's view was.", ""]
    if not isinstance(rt.pools, UnsetType):
        dec = rt.pools.decode
        out += ["Disaggregated: the prediction figures are the **prefill pool's** (the prefill router's predicted "
                "prefix against what the prefill engine found). The **decode pool** predicts no prefix: each decode "
                f"leg receives its prompt's KV by transfer ({fmt(dec.requests_received_kv)} requests, "
                f"{fmt(dec.transferred_prompt_tokens)} prompt tokens) and the decode router places it by its "
                "ranks' active blocks (the per-rank KV blocks of decode ranks; routing reasons and attempts below "
                "are the decode legs').", ""]
    out += table(["figure", "value"], [
        ("requests compared (completed, routed)", fmt(rt.requests_compared)),
        ("predicted cached tokens", fmt(rt.predicted_cached_tokens)),
        ("engine cached tokens", fmt(rt.engine_cached_tokens)),
        ("engine / predicted", pct(rt.engine_to_predicted_ratio)),
        ("mean absolute difference per request", fmt(rt.mean_abs_diff_tokens, " tok")),
        ("requests where the router overestimated", fmt(rt.overestimated_requests)),
        ("requests where the router underestimated", fmt(rt.underestimated_requests)),
        ("overlap of chosen rank / best overlap (blocks)",
         f"{fmt(rt.selection_overlap_blocks)} / {fmt(rt.best_overlap_blocks)} "
         f"({pct(rt.selection_to_best_ratio)})"),
        ("mean attempts", fmt(rt.mean_attempts)),
        ("retried requests", fmt(rt.retried_requests)),
        ("dispatch rejections", fmt(rt.dispatch_rejections)),
    ])
    if rt.reasons:
        out += ["", "Routing reasons: " + ", ".join(f"`{r}` {n}" for r, n in rt.reasons.items()) + "."]
    out += _regret_section(rt.regret, REGRET_PLOT in plots)
    if not isinstance(k.replicas, UnsetType):
        out += _replicas_section(k.replicas, REGRET_PLOT in plots)
    out += ["", "## Session affinity", ""]
    if k.affinity is None:
        out += ["Affinity was off."]
    else:
        out += table(["counter", "value"], [(name, fmt(v)) for name, v in k.affinity.items()])
    q = k.queue
    out += ["", "## Policy queue", ""]
    if not q.queued_requests and not q.queued_events:
        out += ["No request was queued."]
    else:
        out += [f"{fmt(q.queued_requests)} requests queued ({fmt(q.queued_events)} queue events); wait "
                f"before dispatch: mean {fmt(q.mean_queue_wait_ms, ' ms')}, "
                f"p99 {fmt(q.p99_queue_wait_ms, ' ms')}, max {fmt(q.max_queue_wait_ms, ' ms')}."]
    kv = k.kv_events
    out += ["", "## KV events", ""]
    if not kv.per_worker:
        out += ["No KV-event counters were recorded."]
    else:
        cols = list(KV_COUNTERS) + sorted({c for w in kv.per_worker for c in w} - set(KV_COUNTERS) - {"worker_id"})
        out += table(["worker", *cols], [(w["worker_id"], *(fmt(w.get(c, 0)) for c in cols))
                                         for w in kv.per_worker]
                      + [("**total**", *(fmt(kv.totals.get(c, 0)) for c in cols))])
    out += ["", "## Failures", ""]
    if not k.failed_requests_by_reason:
        out += ["No request failed."]
    else:
        out += table(["reason", "requests"], list(k.failed_requests_by_reason.items()))
    if not isinstance(k.autoscaler, UnsetType):
        out += autoscale_markdown(k.autoscaler, fmt, table)
    if data.worker_events:
        out += ["", "## Worker events", ""]
        shown = sorted(data.worker_events, key=lambda e: (e.time_ns, e.kind))
        out += table(["time (s)", "event", "worker", "why"],
                      [(f"{e.time_ns / NS_PER_S:.3f}", e.kind, e.worker_id, e.reason or "") for e in shown[:50]])
        if len(shown) > 50:
            out += ["", f"… and {len(shown) - 50} more."]
    if plots:
        out += ["", "## Plots", ""]
        out += [f"- [{name}]({name})" for name in plots]
        out += [""] + [f"![{name.removesuffix('.png')}]({name})" for name in plots]
    out += glossary("\n".join(out))
    return "\n".join(out) + "\n"


GLOSSARY: tuple[tuple[str, str, str], ...] = (
    # (term, a pattern: the report uses it where this matches, definition)
    ("TTFT", r"\bTTFT\b", "time to first token: the first token's time minus the request's arrival."),
    ("TTST", r"\bTTST\b", "time to second token: the second token's time minus the first's (requests with 2 or "
                           "more tokens)."),
    ("TPOT", r"\bTPOT\b", "time per output token: (completion - first token) / (output tokens - 1), one value per "
                           "request."),
    ("ITL", r"\bITL\b", "inter-token latency: every gap between two consecutive tokens of a request, pooled over "
                         "all requests."),
    ("E2E", r"\bE2E\b", "end-to-end latency: completion minus arrival."),
    ("p50, p90, p99", r"\bp(?:50|90|99)\b", "the value below which 50%, 90%, 99% of the values lie (the value at "
                                            "the rounded rank, no interpolation); only completed requests count."),
    ("per-user output speed", r"Per-user output speed", "(output tokens - 1) / (completion - first token), per "
                                                         "request: the tokens per second one user sees."),
    ("unfinished", r"\bunfinished\b", "requests neither completed nor failed when the run ended (still queued or "
                                      "in flight)."),
    ("scenario time, wall time", r"scenario time", "scenario time runs on the cluster's clock (virtual in a virtual "
                                                   "run), from the first arrival to the last completion; wall time is "
                                                   "how long the run took on this machine."),
    ("prefix cache reuse", r"cache reuse", "the share of completed requests' prompt tokens the engine found already "
                                           "in its KV cache (not computed again)."),
    ("SLA, goodput", r"\bgoodput\b", "the SLA is the run's latency targets (run.sla); goodput counts the completed "
                                     "requests that met every target, per second."),
    ("DP rank", r"\bDP ranks?\b|\| rank \|", "one data-parallel engine of a worker, with its own KV cache; a worker "
                                             "has dp_size of them."),
    ("predicted vs engine cached tokens", r"predicted cached tokens",
     "the prefix the router expected the chosen rank to hold (from its view of the KV events) against the prefix the "
     "engine found at admission."),
    ("attempts, retried requests", r"mean attempts", "dispatches of a request to a worker; a request is retried when "
                                                     "a dispatch is refused or times out."),
    ("dispatch rejections", r"dispatch rejections", "dispatches a worker refused (full, draining or gone)."),
    ("routing reason `cost`", r"`cost`", "the rank with the lowest cost (the prompt blocks it would compute, plus "
                                         "its active load) was chosen."),
    ("routing reason `softmax`", r"`softmax`", "a rank was drawn with probabilities from a softmax of the costs "
                                               "(router_temperature > 0)."),
    ("routing reason `affinity`", r"`affinity`", "the session's affinity (its earlier requests' rank) limited the "
                                                 "candidates."),
    ("routing reason `pinned`", r"`pinned`", "the request named its worker itself."),
    ("routing reason `policy`", r"`policy`", "a policy other than kv chose (round_robin, random, or module:callable)."),
    ("routing regret; lost, novel blocks", r"regret", "at each decision, lost blocks were cached on a better eligible "
                                                     "rank than the chosen one, novel blocks on no rank; regret = lost "
                                                     "/ (novel + lost): the share of computed prompt blocks a perfect "
                                                     "router would have found cached."),
    ("session affinity counters", r"\| binds \|", "binds: a session's first request bound it to a rank; hits: a "
     "later request found its binding; waits: a request waited for its session's first routing; rebinds (soft mode): "
     "a session moved to another rank; releases: a bound session's request ended; expirations: bindings idle past "
     "ttl_secs dropped; invalidations: bindings dropped (their worker left, or a hard binding was broken); "
     "mismatches (hard mode): a request dispatched elsewhere than its binding."),
    ("KV events", r"## KV events", "what workers publish when blocks enter or leave their cache; batches are "
                                   "numbered, a gap is a missed number, a replay a resend the router asked for, "
                                   "lost batches those never recovered."),
)
"""report.md's terms: each is defined at the report's end when the report uses it."""


def glossary(text: str) -> list[str]:
    """The "Terms" section: the definitions of the ``GLOSSARY`` terms ``text`` uses."""
    used = [(term, meaning) for term, pattern, meaning in GLOSSARY if re.search(pattern, text)]
    if not used:
        return []
    return ["", "## Terms", "", *(f"- **{term}**: {meaning}" for term, meaning in used)]


def _lanes_lines(lanes: Lanes) -> list[str]:
    """report.md's lanes paragraph and phase table: the headline above is the profile phase's."""
    recycle = (f"recycling the corpus for {fmt(lanes.duration_s, ' s')} (+{fmt(lanes.grace_s, ' s')} grace)"
               if lanes.duration_s is not None else "the corpus once")
    out = [f"Lanes: {lanes.lanes} lanes {recycle}; {fmt(lanes.plays_started)} plays started, "
           f"{fmt(lanes.plays_completed)} completed, {fmt(lanes.plays_cut)} cut at the deadline; "
           f"{fmt(lanes.requests_issued)} requests issued, {fmt(lanes.requests_cancelled)} cancelled, "
           f"{fmt(lanes.requests_never_issued)} never issued; idle shifts {fmt(lanes.idle_shifts_tree)} (play), "
           f"{fmt(lanes.idle_shifts_global)} (client). The figures above are the profile phase's.", ""]
    out += table(["phase", "requests", "completed", "failed", "duration"],
                 [(phase, fmt(p.requests), fmt(p.completed_requests), fmt(p.failed_requests), fmt(p.duration_ms, " ms"))
                  for phase, p in (("primer", lanes.phases.primer), ("warmup", lanes.phases.warmup),
                                   ("profile", lanes.phases.profile))])
    return out + [""]


def _regret_section(rg: Regret | None, plotted: bool = False) -> list[str]:
    """Routing regret against the engines' truth at each decision (``kvemu.routing.regret``)."""
    out = ["", "### Routing regret", ""]
    if rg is None:
        return out + ["No engine truth at the routing decisions (the engines ran in other processes)."]
    src = rg.recoverable_prefill_blocks
    if rg.truth == "kv_events":
        out += ["The engines ran in other processes: the truth is the load generator's own view of every rank's "
                "cache from the workers' KV events, read as each request was sent (not a probe of the engines; the "
                "events' own delay included, no chaos fault on a router's feed applied to it). *lost* blocks were "
                "cached on a better registered rank than the chosen one, *novel* blocks nowhere; regret = lost / "
                "(novel + lost), as Dynamo's locality-metrics proposal defines it.", ""]
        feed = rg.truth_feed
        if not isinstance(feed, UnsetType):
            out += [f"The load generator's KV feed: {fmt(feed['batches'])} batches, {fmt(feed['gaps'])} gaps, "
                    f"{fmt(feed['replays'])} replays, {fmt(feed['lost_batches'])} batches lost.", ""]
    else:
        out += ["At each decision the engines were read: *lost* blocks were cached on a better eligible rank than "
                "the chosen one, *novel* blocks nowhere; regret = lost / (novel + lost), as Dynamo's "
                "locality-metrics proposal defines it.", ""]
    out += table(["figure", "value"], [
        ("requests compared / with lost blocks", f"{fmt(rg.requests_compared)} / {fmt(rg.requests_with_loss)}"),
        ("lost blocks (recoverable)", fmt(rg.lost_blocks)),
        ("… on a peer rank / the session's last rank / another rank",
         f"{fmt(src.peer)} / {fmt(src.cache_owner)} / {fmt(src.shared)}"),
        ("novel blocks (unrecoverable)", fmt(rg.unrecoverable_prefill_blocks)),
        ("regret ratio", pct(rg.regret_ratio)),
    ])
    if plotted:
        out += ["", f"Over time: [{REGRET_PLOT}]({REGRET_PLOT})."]
    return out


def _replicas_section(rp: Replicas, plotted: bool) -> list[str]:
    """Router replicas (``kvemu.replicas``): how requests reached them, their sync, and each one's own figures."""
    sync = rp.sync
    how = (f"replica sync on, {fmt(sync.delay_ms, ' ms')} delay" if sync.enabled
           else "no replica sync (each replica's load view holds its own bookings only)")
    out = ["", "## Router replicas", "",
           f"{rp.count} router replicas, front `{rp.front}`, {how}. Each replica routes the requests that "
           "reach it from its own view (its prefix index, fed by its KV feed, and its load view); its regret is "
           "of its own decisions."
           + (f" Regret per replica over time, with the chaos events: [{REGRET_PLOT}]({REGRET_PLOT})." if plotted
              else ""), ""]
    rows = rp.per_replica
    synced = any(not isinstance(r.sync, UnsetType) for r in rows)
    header = ["replica", "requests", "completed", "reuse", "regret", "lost / novel blocks", "KV batches",
              "KV gaps", "KV replays", "feed batches dropped", "restarts"]
    header += ["sync announced / applied"] if synced else []
    body = []
    for r in rows:
        rg, kv = r.regret, r.kv_events
        row = [r.replica, fmt(r.requests), fmt(r.completed_requests), pct(r.prefix_cache_reused_ratio),
               pct(r.regret_ratio),
               "—" if rg is None else f"{fmt(rg.lost_blocks)} / {fmt(rg.novel_blocks)}",
               fmt(kv["batches"]), fmt(kv["gaps"]), fmt(kv["replays"]), fmt(r.kv_feed_dropped_batches),
               fmt(r.restarts)]
        if synced:
            sy = r.sync
            row.append("—" if isinstance(sy, UnsetType) else f"{fmt(sy['announced'])} / {fmt(sy['applied'])}")
        body.append(row)
    return out + table(header, body)

