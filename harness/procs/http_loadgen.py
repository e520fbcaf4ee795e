"""``kvemu loadgen --http URL``: a scenario's workload sent to any OpenAI-compatible server, judged by the engines.

Each request is one streamed ``/v1/completions`` call with ``X-Request-Id`` (and the session headers), so a
router in front of a kvemu fleet passes the id on to the worker that serves it. Prompts keep the workload's
prefix identity: as token ids (``prompt_form="tokens"``) or as text the fleet's tokenizer maps back to exactly
those ids (``"text"``, the default: what a router that hashes text needs). The report is kvemu's usual one,
from client-side times, with the engine-side truth of a fleet (``harness.procs.engine_truth``) merged in by
request id: the worker and rank that served, the tokens its engine found cached, preemptions, admission. A
router that gives the legs its own id (vllm-router's PD mode) is matched by the id the answer carries; a
disaggregated request's prefill leg says what the prompt found cached and where, its decode leg who served.
A chunk that carries several tokens (servers coalesce them) has them spread evenly since the previous chunk,
so inter-token latencies read as the engine's passes, not as zeros.

``compress`` > 1 plays the workload that many times faster against engines made that many times faster
(``kvemu bench-router`` sets both); every time in the report is scaled back, so latencies read as uncompressed.
"""

from __future__ import annotations

import http.client
import json
import sys
from array import array
import time
import urllib.request
from pathlib import Path
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import anyio
import msgspec

from kvemu.http.tokenizer import TextTokenizer, load_tokenizer
from kvemu.messages import ClientRequest
from kvemu.records import RequestRecord
from kvemu.runtime.loop import run_live

from harness.run.factories import engine_config
from harness.run.interrupts import RunSignals, Terminated, terminate_as_interrupt
from harness.workload.lanes import CANCEL_DRAIN_S
from harness.run.pools import pool_sizes, speculative_settings, routing_block_size
from harness.procs.engine_truth import LoadPage, LoadSample, TruthPage, Unsettled
from harness.procs.fleet import FleetInfo
from harness.report.files import save_report
from harness.report.run_data import RunData, Sample
from harness.report.summary_types import Summary
from harness.run.progress import PROGRESS_EVERY_S, RunProgress, for_scenario, print_progress
from harness.run.runner import NothingRan, count_requests
from harness.scenario import RunOrigin, Scenario
from harness.workload.sessions import Played, awaiting, play_workload
from harness.workload.forms import Sessions
from harness.workload.build import build_sessions

__all__ = ["HttpTarget", "Legs", "http_loadgen_report", "fetch_truth", "legs_by_id", "PromptForm"]

PromptForm = Literal["text", "tokens"]
MAX_ERROR_BODY = 512
"""The most of a failed response's body a record's failure quotes."""
_SPECIAL_IDS = 8
"""The built-in tokenizer's special tokens (``<unk>``, roles...) come first: a prompt never uses them."""
UNSETTLED_TIMEOUT_S = 5.0
"""How long one worker may take to answer ``/kvemu/unsettled``."""
DRAIN_POLL_S = 0.01
"""How often the cancel drain asks the workers whether they settled."""


class _MonoClock:
    """Monotonic nanoseconds since the run's start (``play_workload``'s clock)."""

    is_virtual = False

    def __init__(self) -> None:
        self.t0 = time.monotonic_ns()

    def now_ns(self) -> int:
        return time.monotonic_ns() - self.t0


class HttpTarget:
    """Sends requests as streamed ``/v1/completions`` calls to one URL and records what the client saw."""

    def __init__(self, url: str, *, model: str, tokenizer: TextTokenizer, prompt_form: PromptForm = "text",
                 clock: _MonoClock | None = None, timeout_s: float = 600.0) -> None:
        import httpx

        self.url = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.tok = tokenizer
        self.prompt_form = prompt_form
        self.clock = clock or _MonoClock()
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self._httpx = httpx
        self.engine_ids: dict[str, str] = {}
        """The id an answer carried, by the client's request id, where the two differ (a router that replaced
        ``X-Request-Id``: the engines' records carry the answer's)."""

    def prompt_ids(self, tokens: Any) -> list[int]:
        """The workload's ids, in the tokenizer's ordinary vocabulary (the same ids map to the same ids, so
        shared prefixes stay shared)."""
        span = self.tok.vocab_size - _SPECIAL_IDS
        return [t if _SPECIAL_IDS <= t < self.tok.vocab_size else _SPECIAL_IDS + t % span for t in tokens]

    def body(self, req: ClientRequest) -> dict[str, Any]:
        """The request's JSON body: its prompt, exactly ``max_tokens`` streamed tokens."""
        ids = self.prompt_ids(req.tokens)
        prompt: Any = ids if self.prompt_form == "tokens" else self.tok.decode(ids)
        return {"model": self.model, "prompt": prompt, "max_tokens": req.max_tokens, "min_tokens": req.max_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    def headers(self, req: ClientRequest) -> dict[str, str]:
        """``X-Request-Id`` (what matches the engine's record), and the session headers routers read."""
        h = {"X-Request-Id": req.request_id}
        if req.session_id is not None:
            h["X-Session-Id"] = req.session_id
        if req.parent_session_id is not None:
            h["X-Parent-Session-Id"] = req.parent_session_id
        return h

    def record(self, req: ClientRequest) -> RequestRecord:
        """A request's record as it is sent (``submit`` fills it in)."""
        return RequestRecord(request_id=req.request_id, session_id=req.session_id,
                             parent_session_id=req.parent_session_id, arrival_ns=self.clock.now_ns(),
                             isl=len(req.tokens), max_tokens=req.max_tokens, attempts=1,
                             # kept to the report: 8 bytes a token time, not an int object and a list slot (~40)
                             token_times_ns=array("q"))  # type: ignore[arg-type]

    async def submit(self, req: ClientRequest, rec: RequestRecord | None = None) -> RequestRecord:
        """Send one request and stream its answer; the record says what the client saw (its failure: the status
        and the server's words, or the connection's error; cancelled: unanswered when the run stopped)."""
        rec = rec if rec is not None else self.record(req)
        try:
            async with self._client.stream("POST", self.url, json=self.body(req), headers=self.headers(req)) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread())[:MAX_ERROR_BODY].decode("utf-8", "replace")
                    rec.failure = f"http_{resp.status_code}: {' '.join(text.split())}"
                    return rec
                async for line in resp.aiter_lines():
                    self._on_line(rec, line)
        except self._httpx.HTTPError as exc:
            rec.failure = f"connection: {type(exc).__name__}: {str(exc)[:200]}"
            return rec
        except anyio.get_cancelled_exc_class():
            if rec.failure is None:
                rec.failure = f"unanswered: {rec.output_tokens} of {req.max_tokens} tokens when the run stopped"
            raise
        if rec.failure is None:
            if rec.output_tokens >= req.max_tokens:
                rec.completion_ns = rec.last_token_ns()
            else:
                rec.failure = f"short_answer: {rec.output_tokens} of {req.max_tokens} tokens"
        return rec

    def _on_line(self, rec: RequestRecord, line: str) -> None:
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            rec.failure = f"bad_stream: {data[:100]!r}"
            return
        if "error" in chunk:
            rec.failure = f"stream_error: {str(chunk['error'])[:200]}"
            return
        answer_id = chunk.get("id")
        if answer_id and answer_id != rec.request_id and rec.request_id not in self.engine_ids:
            self.engine_ids[rec.request_id] = str(answer_id)[:512]
        now = self.clock.now_ns()
        for choice in chunk.get("choices") or ():
            n = len(self.tok.encode(choice.get("text") or ""))
            if not n:
                continue
            last = rec.last_token_ns()
            if last is None:
                rec.first_token_ns = now
                rec.add_token_times([now] * n)
            else:  # a server that sends several tokens in one chunk made them one pass apart: spread them evenly
                rec.add_token_times([last + (now - last) * (i + 1) // n for i in range(n)])
            rec.output_tokens += n

    async def unsettled(self, workers: Sequence[str]) -> int | None:
        """Requests the workers at these URLs still work for (``GET /kvemu/unsettled``: unfinished, holding KV for
        a transfer, being offloaded); None when one of them did not answer."""
        total = 0
        for url in workers:
            try:
                resp = await self._client.get(f"{url.rstrip('/')}/kvemu/unsettled", timeout=UNSETTLED_TIMEOUT_S)
                if resp.status_code != 200:
                    return None
                total += msgspec.json.decode(resp.content, type=Unsettled).requests
            except (self._httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError):
                return None
        return total

    async def aclose(self) -> None:
        await self._client.aclose()


def fetch_truth(fleet: FleetInfo, timeout_s: float = 10.0) -> tuple[list[RequestRecord], list[LoadSample], list[str]]:
    """Every worker's engine records and load samples (paged), and a line per worker that did not answer fully."""
    records: list[RequestRecord] = []
    samples: list[LoadSample] = []
    problems: list[str] = []
    for url in dict.fromkeys(w.url for w in fleet.workers):  # one server may speak for several workers
        try:
            for page in _pages(f"{url}/kvemu/requests", TruthPage, timeout_s, problems):
                records.extend(page.records)
            for load in _pages(f"{url}/kvemu/load", LoadPage, timeout_s, problems):
                samples.extend(load.samples)
        except (OSError, http.client.HTTPException, msgspec.DecodeError) as exc:
            problems.append(f"{url}: {exc}")
    return records, samples, problems


_P = TypeVar("_P", TruthPage, LoadPage)


def _pages(url: str, page_type: type[_P], timeout_s: float, problems: list[str]) -> Iterator[_P]:
    after = 0
    while True:
        with urllib.request.urlopen(f"{url}?after={after}", timeout=timeout_s) as resp:  # noqa: S310 - the fleet's
            page = msgspec.json.decode(resp.read(256 << 20), type=page_type)
        if page.dropped > after:
            problems.append(f"{url}: {page.dropped - after} entries no longer kept")
        if page.next == after:
            return
        yield page
        after = page.next


class Legs(msgspec.Struct):
    """The engine truth of one request: the leg that served it (aggregated, or the decode leg) and the prefill
    leg of a disaggregated one."""

    serving: RequestRecord | None = None
    prefill: RequestRecord | None = None


def legs_by_id(records: list[RequestRecord], pool_of: dict[int, str]) -> dict[str, Legs]:
    """Each request id's legs (a prefill worker's record is the prefill leg)."""
    out: dict[str, Legs] = {}
    for t in records:
        legs = out.setdefault(t.request_id, Legs())
        if t.worker_id is not None and pool_of.get(t.worker_id) == "prefill":
            legs.prefill = t
        else:
            legs.serving = t
    return out


def _merge(rec: RequestRecord, legs: Legs | None, t0: int, scale: float) -> RequestRecord:
    """The client's record with the engine's facts, times from the run's start and scaled back by ``scale``."""
    def back(t: int | None, base: int = 0) -> int | None:
        return None if t is None else round((t - base) * scale)

    out = msgspec.structs.replace(
        rec, arrival_ns=back(rec.arrival_ns) or 0, first_token_ns=back(rec.first_token_ns),
        completion_ns=back(rec.completion_ns),
        token_times_ns=array("q", [round(t * scale) for t in rec.token_times_ns]))
    if legs is None:
        return out
    for truth in (legs.serving, legs.prefill):
        if truth is not None and out.failure is None and truth.failure is not None:
            out.failure = truth.failure
    if (truth := legs.serving) is not None:
        out.worker_id, out.dp_rank = truth.worker_id, truth.dp_rank
        out.engine = msgspec.structs.replace(truth.engine, admitted_ns=back(truth.engine.admitted_ns, t0))
        out.dispatch_ns = back(truth.arrival_ns, t0)
        out.kv_reserved_ns, out.kv_activated_ns = back(truth.kv_reserved_ns, t0), back(truth.kv_activated_ns, t0)
    if (pre := legs.prefill) is not None:  # the prompt's cache was found where it was computed
        out.prefill_worker_id, out.prefill_dp_rank = pre.worker_id, pre.dp_rank
        out.prefill_done_ns = back(pre.completion_ns, t0)
        facts = pre.engine
        out.engine = msgspec.structs.replace(out.engine, cached_tokens=facts.cached_tokens,
                                             reused_tokens=facts.reused_tokens,
                                             host_cached_tokens=facts.host_cached_tokens,
                                             preemptions=out.engine.preemptions + facts.preemptions)
        out.dispatch_ns = back(pre.arrival_ns, t0)
    return out


async def _play(scenario: Scenario, target: HttpTarget, played: Played, workers: Sequence[str] = (),
                sessions: Sessions | None = None,
                progress: RunProgress | None = None,
                signals: RunSignals | None = None) -> tuple[list[RequestRecord], bool, str | None]:
    """Play the workload (``sessions``, made here if not given) against ``target``. With lanes, a request cancelled
    at their deadline has its stream closed (the worker aborts it; its record says why), and, given the
    ``workers``' URLs, the warm-up's barrier waits for them to settle and the run waits (at most
    ``CANCEL_DRAIN_S``) for them to abort what it cancelled. Given ``signals`` (the process's), the first SIGINT
    or SIGTERM stops it: what ran is returned, with the signal's name."""
    if sessions is None:
        sessions = build_sessions(scenario)
    if signals is not None and signals.caught:  # (between the workload's making and here: nothing ran)
        raise Terminated(signals.caught[0])
    records: dict[str, RequestRecord] = {}
    scopes: dict[str, anyio.CancelScope] = {}  # the requests in flight
    total = count_requests(sessions)
    print(json.dumps({"event": "started", "role": "loadgen", "http": target.url, "requests": total}), flush=True)
    ended = [0]

    async def submit(req: ClientRequest) -> RequestRecord:
        rec = records[req.request_id] = target.record(req)  # kept even if the run stops before it ends
        with anyio.CancelScope() as scope:
            scopes[req.request_id] = scope
            try:
                return await target.submit(req, rec)
            finally:
                del scopes[req.request_id]
                ended[0] += 1
        return rec  # cancelled: its stream is closed

    async def tell_progress(meter: RunProgress) -> None:
        while True:
            meter.running(target.clock.now_ns(), ended[0], total)
            await anyio.sleep(0.25)

    def cancel(request_id: str, reason: str) -> None:
        scope = scopes.get(request_id)
        if scope is not None:
            records[request_id].failure = reason
            scope.cancel()

    in_server: Callable[[], Awaitable[int | None]] | None = None
    if workers:
        async def in_server() -> int | None:
            return await target.unsettled(workers)

    finished = False
    try:
        async with anyio.create_task_group() as play:
            if signals is not None:
                signals.arm(play.cancel_scope.cancel)
            if progress is not None:
                play.start_soon(tell_progress, progress)
            finished = await play_workload(scenario, sessions, awaiting(play, submit), target.clock,
                                           cancel=cancel, in_server=in_server, out=played)
            play.cancel_scope.cancel()
        stopped = list(signals.caught) if signals is not None else []
        if not stopped and in_server is not None and played.requests_cancelled:
            await _drain(in_server)
    finally:
        if signals is not None:
            signals.disarm()
        with anyio.CancelScope(shield=True):
            await target.aclose()
    return list(records.values()), finished and not stopped, stopped[0] if stopped else None


async def _drain(in_server: Callable[[], Awaitable[int | None]]) -> None:
    """Wait until the workers settled (they aborted the requests whose streams closed, so their engine records say
    so), at most ``CANCEL_DRAIN_S``."""
    with anyio.move_on_after(CANCEL_DRAIN_S):
        while await in_server() != 0:
            await anyio.sleep(DRAIN_POLL_S)


def http_loadgen_report(scenario: Scenario, url: str, outdir: Path, *, fleet: FleetInfo | None = None,
                        prompt_form: PromptForm = "text", tokenizer: str | None = None, model: str = "kvemu",
                        compress: float = 1.0, origin: RunOrigin | None = None,
                        command: str = "kvemu loadgen") -> tuple[Summary, Path | None]:
    """Play the scenario against ``url``, gather ``fleet``'s engine truth, write the report (titled after
    ``command``); returns its summary and where it went. ``origin``: what the scenario was built from, for the
    report's "What ran". Ctrl-C or SIGTERM stops the run and a partial report is written (more signals meanwhile
    are said and otherwise wait for it); before the run, while the workload is made: ``NothingRan``, no report."""
    target = HttpTarget(url, model=model, tokenizer=load_tokenizer(tokenizer), prompt_form=prompt_form)
    wall0 = time.perf_counter_ns()
    played = Played()
    workers = list(dict.fromkeys(w.url for w in fleet.workers)) if fleet is not None else []
    meter = for_scenario(scenario)
    # on a terminal, a line every few seconds: what it does, how far, and the ETA (never silent for long)
    ticker = print_progress(meter, "kvemu loadgen", PROGRESS_EVERY_S) if sys.stderr.isatty() else None
    try:
        with terminate_as_interrupt():
            try:
                sessions = build_sessions(scenario, meter.generated)
            except KeyboardInterrupt as exc:
                raise NothingRan("generating the workload", getattr(exc, "reason", "SIGINT")) from None
        # from here to the report's end the process's SIGINT and SIGTERM are the run's: the first stops the run,
        # the next are said and wait for the report (the loop's closing included)
        with RunSignals(say="the partial report is being written; kvemu stops once it is") as signals:
            try:
                client_records, finished, stopped = run_live(lambda: _play(scenario, target, played, workers,
                                                                           sessions, meter, signals))
            except KeyboardInterrupt as exc:  # before the play began
                raise NothingRan("starting the run", getattr(exc, "reason", "SIGINT")) from None
            meter.enter("writing the report")
            if stopped in ("SIGINT", "SIGTERM"):  # (the engines' truth and the plots take seconds: say what happens)
                print(f"kvemu: {stopped}: writing the partial report in {outdir}", file=sys.stderr, flush=True)
            return _report(scenario, target, fleet, client_records, finished, stopped, played, wall0, compress,
                           outdir, origin, command)
    finally:
        if ticker is not None:
            ticker.set()


def _report(scenario: Scenario, target: HttpTarget, fleet: FleetInfo | None, client_records: list[RequestRecord],
            finished: bool, stopped: str | None, played: Played, wall0: int,
            compress: float, outdir: Path, origin: RunOrigin | None,
            command: str) -> tuple[Summary, Path | None]:
    """``http_loadgen_report``'s report of a run played: the records joined with ``fleet``'s engine truth."""
    truth: dict[str, Legs] = {}
    samples: list[Sample] = []
    problems: list[str] = []
    ranks: list[tuple[int, int]] = []
    if fleet is not None:
        got, load, problems = fetch_truth(fleet)
        pool_of = {w.worker_id: w.pool for w in fleet.workers}
        truth = legs_by_id(got, pool_of)
        ranks = sorted((w.worker_id, r) for w in fleet.workers for r in range(w.dp_size))
        blocks = {pool: engine_config(scenario.cluster, pool).num_gpu_blocks for pool in scenario.cluster.pools()}
        samples = [Sample(time_ns=round((s.t_ns - target.clock.t0) * compress), worker_id=s.worker_id,
                          dp_rank=s.dp_rank, active_requests=s.running + s.waiting,
                          kv_blocks=round(s.kv_usage * blocks[pool_of[s.worker_id]]), pool=pool_of[s.worker_id])
                   for s in load if s.t_ns >= target.clock.t0]
    for p in problems:
        print(f"kvemu loadgen: engine truth: {p}", file=sys.stderr)
    truth_id = {r.request_id: r.request_id if r.request_id in truth
                else target.engine_ids.get(r.request_id, r.request_id) for r in client_records}
    records = [_merge(r, truth.get(truth_id[r.request_id]), target.clock.t0, compress) for r in client_records]
    failures: dict[str, int] = {}
    for r in records:
        if r.failure:
            key = r.failure.split(":")[0]
            failures[key] = failures.get(key, 0) + 1
    matched = sum(1 for k in truth_id.values() if k in truth)
    counters = {"engine_truth_matched": matched, "engine_truth_unmatched": len(client_records) - matched,
                "engine_truth_unclaimed": len(set(truth) - set(truth_id.values()))}
    data = RunData(records=sorted(records, key=lambda r: (r.arrival_ns, r.request_id)), scenario_name=scenario.name,
                   command=command, mode="live", seed=scenario.run.seed, wall_time_ns=time.perf_counter_ns() - wall0,
                   partial=not finished or stopped is not None,
                   stop_reason=stopped or (None if finished else "drain_timeout"),
                   block_size=routing_block_size(scenario.cluster), ranks=ranks, samples=samples,
                   counters=counters, failures=failures, pools=pool_sizes(scenario.cluster),
                   speculative=speculative_settings(scenario.cluster),
                   sla=scenario.run.sla, concurrency=scenario.workload.concurrency,
                   lanes=played.lanes, phases=played.phases, scenario=scenario, origin=origin)
    return save_report(data, outdir)
