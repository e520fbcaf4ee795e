"""``kvemu up``: a router, its workers and a load generator as child processes on 127.0.0.1.

It waits for each process's start line, runs the workload, collects the report and stops everything.
Children die with their parent (Linux parent-death signal) and are terminated on Ctrl-C, on a child
crash and on exit, so ``kvemu up`` never leaves an orphan. It applies the whole chaos timeline: it starts
(``add_worker``) and stops (``remove_worker``: SIGTERM, or SIGKILL) worker processes itself and sends every
other action to the router's control channel (``harness.chaos``) with a token only it and the router know.
With ``router.replicas`` it starts one router process per replica (and, with ``--http``, ``kvemu front``, the
OpenAI front door spreading over them), tells each where its peers publish their
sync batches, gives every worker and the load generator every replica's address, and sends an action that
names a replica (``restart_router``, a fault on its KV feed) to that replica's control channel; the others go to
the first replica, which forwards them to the workers.

Children run ``python -P -m harness.cli``: ``-P`` (Python 3.11) keeps the working directory off their import
path, so a project with its own ``harness/``, ``workers/`` or ``kvemu/`` folder cannot shadow kvemu's packages
(``python -m`` would put it first). ``cli_command`` and ``cli_env`` build that for any other launcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import signal
import site
import subprocess
import sys
import threading
import time
import urllib.request
from http.client import HTTPException, IncompleteRead
from pathlib import Path
from typing import IO, Any

from kvemu.errors import KvemuError
from kvemu.wire import security

from harness.chaos import CONTROL_TOKEN_ENV, SyncPeers, WorkerExited
from harness.procs.protocol import send_control
from harness.text import counted
from harness.scenario import Scenario

__all__ = ["up_main", "Children", "NotStarted", "cli_command", "cli_env", "DRAIN_S", "STOP_GRACE_S", "run_secret"]

DRAIN_S = 10.0
"""How long the front door, routers and workers the supervisor starts drain their open requests when stopped
(their ``--grace``)."""
STOP_GRACE_S = DRAIN_S + 5.0
"""How long the supervisor gives each stage of its stop before SIGKILL: longer than a drain, so that every open
stream ends with its ``[DONE]`` or an error event naming why, never cut."""
ABANDON_S = 2.0
"""``kvemu up`` stopped by a signal, without a front door: once the load generator wrote its report, its router and
workers get this long to stop (together) before they are killed. The requests they still run have no client left,
so a drain would only make the user wait."""
LOADGEN_REPORT_S = 60.0
"""How long ``kvemu up``, stopped, waits for its load generator to write the partial report before stopping it."""
RESTART_DELAYS_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
"""``kvemu serve`` starts a router replica that exited again after these delays: at once the first time, then the
next one for each exit within ``RESTART_STABLE_S`` of its last start (one that dies as it starts is not restarted
in a tight loop)."""
RESTART_STABLE_S = 60.0
Child = subprocess.Popen[str] | subprocess.Popen[bytes]
"""A child process: kvemu's own, read as text (its start line and output), or another project's program, whose
output goes to a log as bytes."""


class NotStarted(KvemuError, RuntimeError):
    """A child process exited (or went silent) before reporting its start line; its stderr says why."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code
        """The child's exit code (None: still running)."""


def cli_command(*args: str) -> list[str]:
    """The command line of a ``kvemu ARGS`` child process; run it with ``env=cli_env()``."""
    return [sys.executable, "-P", "-m", "harness.cli", *args]


def cli_env() -> dict[str, str]:
    """The environment of a child process: this one, with the directory this process imported kvemu from first
    on ``PYTHONPATH`` when that is not a site-packages directory (an editable install or a source checkout), so
    children run the same kvemu as their parent even when ``-P`` leaves the checkout off their path."""
    import harness
    import kvemu
    import workers

    sites = [*getattr(site, "getsitepackages", list)(), getattr(site, "getusersitepackages", str)()]
    sites_real = {os.path.realpath(d) for d in sites if d}
    roots = [os.path.dirname(os.path.dirname(os.path.realpath(m.__file__)))
             for m in (harness, workers, kvemu) if m.__file__]
    env = dict(os.environ)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    extra = [r for r in dict.fromkeys(roots) if r not in sites_real and r not in path]
    if extra:
        env["PYTHONPATH"] = os.pathsep.join([*extra, *path])
    return env


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Children:
    """Child processes started with their JSON start line captured."""

    def __init__(self, own_groups: bool = False) -> None:
        self.procs: dict[str, Child] = {}
        self.info: dict[str, dict[str, Any]] = {}
        self.own_groups = own_groups
        """Each child in a process group of its own: a terminal's Ctrl-C reaches the supervisor alone, which
        stops them in order (``stop_all``) instead of every process at once."""

    def start(self, name: str, args: list[str], timeout_s: float = 30.0,
              env: dict[str, str] | None = None) -> dict[str, Any]:
        """Start ``python -P -m harness.cli ARGS`` (with ``env`` added to its environment) and wait for its
        start line."""
        proc = subprocess.Popen(cli_command(*args), env={**cli_env(), **(env or {})}, stdout=subprocess.PIPE, text=True,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                                process_group=0 if self.own_groups else None)
        self.procs[name] = proc
        stdout = proc.stdout
        assert stdout is not None  # stdout=PIPE
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not line or not line[0].strip():
            code = proc.poll()
            if line and code is None:  # its output ended: it is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = proc.wait(5)
            raise NotStarted(f"{name} did not start (exit code {code}); see its message above", code)
        info = json.loads(line[0])
        if not isinstance(info, dict):
            raise NotStarted(f"{name} printed no start line (a JSON object) but {line[0][:200]!r}", proc.poll())
        self.info[name] = info
        threading.Thread(target=self._drain, args=(stdout,), daemon=True).start()
        return info

    def spawn(self, name: str, cmd: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
        """Start ``cmd``, a program that is not kvemu (another project's router), as a child like the others: its
        output to ``log``, in a process group of its own if theirs are, killed if this process dies, stopped by
        ``stop_all``."""
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                                process_group=0 if self.own_groups else None)
        self.procs[name] = proc
        return proc

    @staticmethod
    def _drain(stdout: IO[str]) -> None:
        for _ in stdout:
            pass

    def signal(self, name: str, sig: int) -> None:
        """Send a signal to one child."""
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)

    def retire(self, name: str, sig: int) -> None:
        """Stop a child on purpose (``sig``): it is renamed ``gone-NAME``, so its exit counts as no crash."""
        self.signal(name, sig)
        self.procs[f"gone-{name}"] = self.procs.pop(name)

    def crashed(self, workers_too: bool = True) -> str | None:
        """A child that exited while the run needs it (a signal counts: a killed router is a crash), if any;
        workers the chaos timeline removed are named ``gone-...`` and the load generator ends the run itself.
        ``workers_too=False``: only the router counts (``lost_workers`` tells of the workers)."""
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None and name != "loadgen" and not name.startswith("gone-") \
                    and (workers_too or not name.startswith("worker-")):
                return f"{name} exited ({_how(code)})"
        return None

    def lost_workers(self) -> list[str]:
        """Worker processes that exited unasked since the last call, each as ``worker-N exited (...)`` (a fault
        the cluster handles: the router fences it when its heartbeats stop, and what it held fails with
        ``worker_lost``)."""
        return [f"{name} exited ({how})" for name, how in self.exited("worker-")]

    def exited(self, prefix: str) -> list[tuple[str, str]]:
        """Children named ``prefix...`` that exited unasked since the last call, with how; each is then renamed
        ``gone-NAME`` (its exit is handled: it is no crash)."""
        out = []
        for name, proc in list(self.procs.items()):
            code = proc.poll()
            if code is not None and name.startswith(prefix):
                out.append((name, _how(code)))
                self.procs[f"gone-{name}"] = self.procs.pop(name)
        return out

    def stop_all(self, grace_s: float = STOP_GRACE_S, hurry: threading.Event | None = None,
                 in_order: bool = True) -> None:
        """Stop every child, in order: the front door and the load generator first (the front drains its open
        streams while the routers and workers still serve them), then the routers, then the workers and the
        rest. Each stage gets SIGTERM, then SIGKILL after ``grace_s``; once ``hurry`` is set (a second Ctrl-C),
        whoever is left is killed at once. ``in_order=False``: all in one stage (no client is left to serve)."""
        stages: dict[int, list[Child]] = {}
        for name, proc in self.procs.items():
            stages.setdefault(_stop_stage(name) if in_order else 0, []).append(proc)
        for stage in sorted(stages):
            procs = stages[stage]
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.send_signal(signal.SIGCONT)  # a stopped child (SIGSTOP) takes its SIGTERM now
            deadline = time.monotonic() + grace_s
            while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline \
                    and not (hurry is not None and hurry.is_set()):
                time.sleep(0.02)
            if hurry is not None and hurry.is_set():
                break
            for proc in procs:
                _kill(proc)
        for proc in self.procs.values():
            _kill(proc)


def _kill(proc: Child) -> None:
    """SIGKILL ``proc`` if it still runs, and reap it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _stop_stage(name: str) -> int:
    """When a child stops in ``Children.stop_all``: 0 the front door and the load generator, 1 the routers, 2
    the rest (workers)."""
    base = name.removeprefix("gone-")
    return 0 if base in ("front", "loadgen") else 1 if base.startswith("router") else 2


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _worker_exits(kids: Children, scenario: Scenario, live: list[int], who: str, routers: list[str],
                  token: str) -> str | None:
    """Log each worker process that exited unasked, drop it from ``live`` and tell the routers (every replica),
    which fence it at once (the report's worker events say how it exited); returns why to stop the run
    (``run.stop_on_worker_exit``), or None: the cluster carries on without it."""
    for problem in kids.lost_workers():
        wid = int(problem.split()[0].removeprefix("worker-"))
        if wid in live:
            live.remove(wid)
        if scenario.run.stop_on_worker_exit:
            return problem
        how = problem.split("(", 1)[1][:-1]
        print(json.dumps({"event": "worker_exited", "worker_id": wid, "how": how}), file=sys.stderr)
        exited = WorkerExited(token=token, worker_id=wid, how=how[:64])
        fenced = all([send_control(router, token, exited).ok for router in routers])
        print(f"{who}: {problem}; the cluster carries on without it (the router "
              f"{'fenced it' if fenced else 'did not answer: it fences it when its heartbeats stop'}; "
              "run.stop_on_worker_exit: true would stop the run)", file=sys.stderr, flush=True)
    return None


def _relay_until_started(stdout: IO[str]) -> tuple[threading.Event, threading.Thread]:
    """Pass a child's standard output (``stdout``) on to ours, line by line, until it closes (the thread); the event
    is set at its start line (the load generator prints it once the router has every expected worker and the run
    begins)."""
    started = threading.Event()

    def relay() -> None:
        for line in stdout:
            if not started.is_set() and '"event": "started"' in line:
                started.set()
            sys.stdout.write(line)
            sys.stdout.flush()

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    return started, thread


def _let_report(loadgen: subprocess.Popen[str], outdir: Path, since: float, what: str, stop: int | None) -> None:
    """Give the load generator time to write its report (after sending it ``stop``), and say so if it did."""
    if loadgen.poll() is None:
        if stop is not None:
            loadgen.send_signal(stop)
        try:
            loadgen.wait(60)
        except subprocess.TimeoutExpired:
            pass
    if _written_since(outdir, since):
        print(f"kvemu up: {what} in {outdir}", file=sys.stderr)


def read_whole(url: str, limit: int, timeout_s: float) -> bytes:
    """The body at ``url`` (a 127.0.0.1 URL this process made), whole and at most ``limit`` bytes; ``OSError`` or
    ``HTTPException`` when it is not (no answer, not HTTP, cut short, longer): another process may hold the port."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - see above
        body = resp.read(limit)
        if resp.length:  # what its Content-Length says is still unread
            raise IncompleteRead(body, resp.length)
    return bytes(body)


def _save_metrics(http: str, outdir: Path) -> None:
    """The front door's final Prometheus snapshot beside the report (``metrics.prom``)."""
    try:
        text = read_whole(f"{http}/metrics", 64 << 20, 5)
    except (OSError, HTTPException) as exc:
        print(f"kvemu up: could not read the front door's metrics: {exc}", file=sys.stderr)
        return
    try:
        outdir.mkdir(parents=True, exist_ok=True)
        (outdir / "metrics.prom").write_bytes(text)
    except OSError as exc:
        print(f"kvemu up: could not write metrics.prom in {outdir}: {exc.strerror or exc}", file=sys.stderr)


def _written_since(outdir: Path, t: float) -> bool:
    """Whether this run's load generator wrote the report (not a file left by an earlier run)."""
    try:
        return (outdir / "summary.json").stat().st_mtime >= t - 1.0
    except OSError:
        return False


def _config(scenario_path: str, overrides: list[str]) -> list[str]:
    sets = [x for o in overrides for x in ("--set", o)]
    return ["--config", scenario_path, *sets] if scenario_path else sets


class _Stack:
    """A router process (one per replica with ``router.replicas``) and its worker processes, started in order
    (each once it reported its endpoints)."""

    def __init__(self, kids: Children, config: list[str], http: list[str], token: str,
                 worker_http: list[str] | None = None, replicas: int = 1) -> None:
        self.kids = kids
        self.config = ["--grace", f"{DRAIN_S:g}", *config]  # every child drains for as long as stop_all expects
        self.token = token
        """The router's control token (chaos, a worker's exit)."""
        self.worker_http = worker_http or []
        self.worker_info: list[dict[str, Any]] = []
        """Each worker's start line: id, KV-event and replay endpoints, HTTP URL (for clients and routers)."""
        self.routers: list[str] = []
        """Every router replica's endpoint, in replica order (the first is ``router``)."""
        self.syncs: dict[int, str] = {}
        """Where each router replica publishes its sync batches (``router.replica_sync``)."""
        started = kids.start("router", ["router", "--listen", "tcp://127.0.0.1:0", *http, *self.config],
                             env={CONTROL_TOKEN_ENV: token}) if replicas == 1 else self._start_replicas(replicas)
        self.router: str = started["listen"]
        if replicas == 1:
            self.routers = [self.router]
        elif http:  # the OpenAI front door: a process of its own, spreading over the router replicas
            started = kids.start("front", ["front", *(x for r in self.routers for x in ("--router", r)), *http,
                                           *self.config])
        self.http: str | None = started.get("http")
        self.next_id = 0
        self.live: list[int] = []

    def _start_replicas(self, n: int) -> dict[str, Any]:
        """Router replicas 0 .. n-1 (the first named ``router``, the others ``router-I``); with replica sync, each
        is then told where the others publish. Returns the first's start line."""
        lines = [self._start_replica(i) for i in range(n)]
        self.routers = [line["listen"] for line in lines]
        self.syncs = {i: line["sync"] for i, line in enumerate(lines) if line.get("sync")}
        for i in range(n):
            self._tell_sync_peers(i)
        return lines[0]

    def _start_replica(self, i: int, listen: str = "tcp://127.0.0.1:0", sync: str | None = None) -> dict[str, Any]:
        """Router replica ``i``'s process, listening at ``listen`` (and publishing its sync batches at ``sync``)."""
        at = ["--sync-listen", sync] if sync else []
        return self.kids.start(replica_name(i), ["router", "--listen", listen, "--replica", str(i), *at,
                                                 *self.config], env={CONTROL_TOKEN_ENV: self.token})

    def _tell_sync_peers(self, i: int) -> None:
        """Tell router replica ``i`` where the others publish their sync batches (with replica sync)."""
        if i in self.syncs:
            reply = send_control(self.routers[i], self.token, SyncPeers(token=self.token, peers={
                j: pub for j, pub in self.syncs.items() if j != i}))
            if not reply.ok:
                raise NotStarted(f"router replica {i} refused its sync peers: {reply.detail}", None)

    def restart_replica(self, i: int) -> None:
        """Start router replica ``i`` again at its addresses, after its process exited: the front door, the
        workers and its peers reconnect to it there (the workers register again when it asks). ``NotStarted``
        (its child killed and forgotten) when it does not come up."""
        name = replica_name(i)
        try:
            self._start_replica(i, self.routers[i], self.syncs.get(i))
            self._tell_sync_peers(i)
        except NotStarted:
            proc = self.kids.procs.pop(name, None)
            if proc is not None:
                _kill(proc)
            raise

    def router_pids(self) -> list[int]:
        """Each router replica's process id, in replica order."""
        return [self.kids.procs[replica_name(i)].pid for i in range(len(self.routers))]

    def start_workers(self, scenario: Scenario) -> int:
        """The scenario's workers, pool by pool (a disaggregated cluster's prefill ids first, then decode, as in
        virtual mode); returns how many."""
        pools = scenario.cluster.pools()
        for pool, (n, _, _) in pools.items():
            for _ in range(n):
                self.add_worker(None if pool == "aggregated" else pool)
        return sum(n for n, _, _ in pools.values())

    def add_worker(self, worker_type: str | None = None) -> None:
        """One more worker process (of the pool ``worker_type`` names, for a disaggregated cluster)."""
        wid = self.next_id
        pool = ["--worker-type", worker_type] if worker_type else []
        routers = [x for r in self.routers for x in ("--router", r)]
        info = self.kids.start(f"worker-{wid}", ["worker", *routers, "--worker-id", str(wid), *pool,
                                                 "--kv-events", "tcp://127.0.0.1:0", "--kv-replay",
                                                 "tcp://127.0.0.1:0", *self.worker_http, *self.config])
        self.worker_info.append({k: info.get(k) for k in ("worker_id", "kv_events", "kv_replay", "http")})
        self.live.append(wid)
        self.next_id += 1


def replica_name(i: int) -> str:
    """The child name of router replica ``i`` (``router`` for the first, as with one router)."""
    return "router" if i == 0 else f"router-{i}"


def replica_of(name: str) -> int:
    """The replica whose child is named ``name`` (``replica_name``'s inverse)."""
    return 0 if name == "router" else int(name.removeprefix("router-"))


class _Restarts:
    """When each router replica that exited is started again (``RESTART_DELAYS_S``)."""

    def __init__(self) -> None:
        self.due: dict[int, float] = {}
        """Replicas to start again: when (``time.monotonic``)."""
        self._streak: dict[int, int] = {}
        self._started: dict[int, float] = {}

    def exited(self, i: int, now: float) -> float:
        """Replica ``i`` exited (or did not come up) at ``now``: schedule its restart; returns the delay."""
        recent = now - self._started.get(i, -RESTART_STABLE_S) < RESTART_STABLE_S
        streak = self._streak.get(i, 0) if recent else 0
        delay = RESTART_DELAYS_S[min(streak, len(RESTART_DELAYS_S) - 1)]
        self._streak[i] = streak + 1
        self.due[i] = now + delay
        return delay

    def take(self, now: float) -> list[int]:
        """The replicas whose restart is due now (each counted started now)."""
        ready = sorted(i for i, t in self.due.items() if t <= now)
        for i in ready:
            del self.due[i]
            self._started[i] = now
        return ready


class StopSignals:
    """SIGINT and SIGTERM while a supervisor runs: the first asks it to stop (``requested``; while ``interrupts``,
    as ``KeyboardInterrupt``), the next, once the stop is under way, to kill its children now (``hurry``), each
    said in one line. No traceback, and the stop is never abandoned half way."""

    def __init__(self, who: str, begun: bool = False, how: str | None = None) -> None:
        self.who = who
        self.how = how or f"open streams get up to {DRAIN_S:g} s to end, then the routers and workers stop"
        """How the stop goes, in the line that announces it."""
        self.requested = threading.Event()
        self.hurry = threading.Event()
        self.interrupts = not begun
        """The first signal also raises ``KeyboardInterrupt`` (while starting the children: stop waiting)."""
        self.signum: int = signal.SIGINT
        """The first signal (SIGINT until one came)."""
        self._previous: dict[int, Any] = {}
        if begun:  # (the stop is under way: the next signal kills)
            self.requested.set()

    def begin(self, why: str) -> None:
        """The stop begins (for ``why``): a signal from now on kills the children now."""
        if not self.requested.is_set():
            self.requested.set()
            print(f"{self.who}: {why}: stopping ({self.how}); press Ctrl-C again to kill them now", file=sys.stderr,
                  flush=True)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.requested.is_set():
            if not self.hurry.is_set():
                self.hurry.set()
                print(f"{self.who}: {signal.Signals(signum).name} again: killing now", file=sys.stderr, flush=True)
            return
        self.signum = signum
        self.begin(signal.Signals(signum).name)
        if self.interrupts:
            raise KeyboardInterrupt

    @property
    def reason(self) -> str:
        """The first signal's name, as a partial report's stop reason says it."""
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """A process stopped by the first signal exits with this: 128 + its number (130 for Ctrl-C)."""
        return 128 + self.signum

    def __enter__(self) -> StopSignals:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread: signals are left alone
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run_secret(who: str, worker_http: list[str] | None = None) -> None:
    """Unless the user set ``KVEMU_SECRET``, a fresh one for this run: this process's sockets and its children's
    (which inherit the environment, never an argument: argv is world-readable in /proc) require it, so no other
    local process can register, submit or read KV events. With ``--worker-http`` the workers are there for other
    routers, which read their KV events with plain ZeroMQ (as behind ``kvemu fleet``): no ZeroMQ secret is made
    then, only a handoff secret (``KVEMU_HANDOFF_SECRET``, unless the user set one) for the KV handoff between
    the workers, which no other router takes part in."""
    if worker_http:
        security.ensure_secret(security.HANDOFF_SECRET_ENV)
    if security.secret():
        return
    if worker_http:
        print(f"{who}: --worker-http puts the workers behind other routers, which read their KV events with plain "
              f"ZeroMQ (vLLM's wire format has no key), so this run's ZeroMQ sockets take no secret: any local process "
              f"can register, submit and read KV events (which carry prompt token ids); only the KV handoff between "
              f"prefill and decode workers takes a secret made for this run, and HTTP routes take none (set "
              f"{security.SECRET_ENV} to require one of every ZeroMQ peer: other routers then read no KV events)",
              file=sys.stderr, flush=True)
        return
    security.ensure_secret()
    print(f"{who}: its ZeroMQ sockets take a secret made for this run (set {security.SECRET_ENV} to choose one, "
          "to connect other kvemu processes)", file=sys.stderr, flush=True)


def serve_main(scenario_path: str, overrides: list[str], scenario: Scenario, http: list[str],
               worker_http: list[str] | None = None) -> int:
    """``kvemu serve``: the router with its OpenAI front door and the scenario's workers, until Ctrl-C/SIGTERM.

    Behind ``router.replicas``, a router replica that exits is started again at its address (``_Restarts``)
    while the front door sends its requests to the live ones; the stack stops when the front door, or the one
    router without replicas, exits. Children run in process groups of their own, so that Ctrl-C stops them in
    order (``Children.stop_all``); a second Ctrl-C kills them at once."""
    run_secret("kvemu serve", worker_http)
    kids = Children(own_groups=True)
    with StopSignals("kvemu serve") as stop:
        try:
            stack = _Stack(kids, _config(scenario_path, overrides), http, secrets.token_hex(16), worker_http,
                           scenario.router.replicas)
            stack.start_workers(scenario)
            print(json.dumps({"event": "serving", "http": stack.http, "router": stack.router, "routers": stack.routers,
                              "workers": scenario.cluster.workers,
                              "worker_http": [w["http"] for w in stack.worker_info if w["http"]],
                              "worker_info": stack.worker_info}), flush=True)
            behind = f" behind {len(stack.routers)} router replicas" if len(stack.routers) > 1 else ""
            print(f"kvemu serve: OpenAI API at {stack.http}/v1 ({counted(scenario.cluster.workers, 'worker')} x "
                  f"{counted(scenario.cluster.dp_size, 'rank')}{behind}); Ctrl-C stops", file=sys.stderr, flush=True)
            stop.interrupts = False
            problem = _serve_until_stopped(kids, stack, scenario, stop)
            if problem is not None:
                stop.begin(problem)
                return 1
            return 0
        except KeyboardInterrupt:
            return 0
        finally:
            stop.interrupts = False
            stop.requested.set()  # (silently: the line saying why was printed)
            kids.stop_all(hurry=stop.hurry)


def _serve_until_stopped(kids: Children, stack: _Stack, scenario: Scenario, stop: StopSignals) -> str | None:
    """Watch the children until a stop is asked (None) or one the stack cannot serve without exits (why)."""
    restarts = _Restarts()
    replicas = len(stack.routers) > 1
    while not stop.requested.is_set():
        now = time.monotonic()
        for name, how in kids.exited("router") if replicas else []:
            i = replica_of(name)
            delay = restarts.exited(i, now)
            print(json.dumps({"event": "router_exited", "replica": i, "how": how, "restart_in_s": delay}),
                  file=sys.stderr)
            print(f"kvemu serve: router replica {i} exited ({how}); the front door sends its requests to the other "
                  f"replicas; starting it again at {stack.routers[i]}" + (f" in {delay:g} s" if delay else ""),
                  file=sys.stderr, flush=True)
        for i in restarts.take(now):
            try:
                stack.restart_replica(i)
            except NotStarted as exc:
                delay = restarts.exited(i, time.monotonic())
                print(f"kvemu serve: router replica {i} did not start again ({exc}); next try in {delay:g} s",
                      file=sys.stderr, flush=True)
                continue
            print(json.dumps({"event": "router_restarted", "replica": i, "listen": stack.routers[i]}),
                  file=sys.stderr, flush=True)
        problem = kids.crashed(workers_too=False) or _worker_exits(kids, scenario, stack.live, "kvemu serve",
                                                                   stack.routers, stack.token)
        if problem is not None:
            return problem
        time.sleep(0.2)
    return None


def up_main(scenario_path: str, overrides: list[str], scenario: Scenario, outdir: Path,
            http: list[str] | None = None, worker_http: list[str] | None = None, quiet: bool = False) -> int:
    """Run the whole stack as processes; returns the load generator's exit code (130 or 143 when stopped by
    SIGINT or SIGTERM). The load generator prints the run's answer (``harness.report.first_screen``, titled
    ``kvemu up``) on our standard output, unless ``quiet``.

    Every child runs in a process group of its own, so a terminal's Ctrl-C reaches this process alone, which
    stops in order: it passes the signal on to the load generator, which stops sending and writes its partial
    report while the router and workers still serve, and then stops the others (``Children.stop_all``). A second
    Ctrl-C kills the router and workers at once, never the load generator writing its report."""
    run_secret("kvemu up", worker_http)
    config = _config(scenario_path, overrides)
    kids = Children(own_groups=True)
    started = time.monotonic()
    started_wall = time.time()
    how = None if http or worker_http else "the load generator writes its partial report, then the router and " \
        "workers stop"
    with StopSignals("kvemu up", how=how) as stop:
        try:
            return _up(kids, config, scenario, outdir, http or [], worker_http, stop, started, started_wall,
                       quiet)
        except KeyboardInterrupt:  # while starting the router or the workers: nothing ran
            print(f"kvemu up: interrupted ({stop.reason}) while starting the processes: nothing ran; no report",
                  file=sys.stderr, flush=True)
            return stop.exit_code
        finally:
            stop.interrupts = False
            # stopped by a signal with no front door, the load generator (gone, its report written) was the only
            # client: what the routers and workers still run has nobody to go to, so they stop together, briefly
            abandon = not (http or worker_http) and stop.requested.is_set()
            stop.requested.set()  # (silently: the line saying why was printed)
            if abandon:
                kids.stop_all(ABANDON_S, hurry=stop.hurry, in_order=False)
            else:
                kids.stop_all(hurry=stop.hurry)


def _up(kids: Children, config: list[str], scenario: Scenario, outdir: Path, http: list[str],
        worker_http: list[str] | None, stop: StopSignals, started: float, started_wall: float,
        quiet: bool = False) -> int:
    """``up_main``'s run, once its signals are handled: start the stack, play the chaos timeline until the load
    generator exits, a child the run needs exits, or a signal asks to stop."""
    token = secrets.token_hex(16)  # the router's control channel answers this process alone
    stack = _Stack(kids, config, http, token, worker_http, scenario.router.replicas)
    router, live = stack.router, stack.live
    workers = stack.start_workers(scenario)
    added = None if not scenario.cluster.disaggregated else "decode"  # add_worker adds to the last pool
    if stack.http:
        print(f"kvemu up: OpenAI API at {stack.http}/v1", file=sys.stderr, flush=True)
    each = [x for r, pid in zip(stack.routers, stack.router_pids()) for x in ("--router", r, "--router-pid", str(pid))]
    # --force: this process claimed OUTDIR already (claim_outdir)
    loadgen = subprocess.Popen(cli_command("loadgen", *each, "-o", str(outdir), "--force", "--chaos", "skip",
                                           "--expect-workers", str(workers), "--report-as", "kvemu up",
                                           *(["--quiet"] if quiet else []), *config),
                               env=cli_env(), stdout=subprocess.PIPE, text=True, process_group=0,
                               preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    kids.procs["loadgen"] = loadgen
    stop.interrupts = False  # from now on a signal is passed on to the load generator, which reports
    assert loadgen.stdout is not None  # stdout=PIPE
    running, relaying = _relay_until_started(loadgen.stdout)
    chaos = sorted(scenario.chaos, key=lambda e: e.at_s)
    t0: float | None = None  # the chaos timeline counts from the load generator's start, as a virtual run's
    while loadgen.poll() is None:
        if stop.requested.is_set():
            code = _interrupted(loadgen, outdir, started_wall, stop, running.is_set())
            relaying.join(5.0)  # its last lines (the partial run's table) reach our standard output before we exit
            return code
        if t0 is None and running.is_set():
            t0 = time.monotonic()
        now = -1.0 if t0 is None else time.monotonic() - t0
        while chaos and chaos[0].at_s <= now:
            ev = chaos.pop(0)
            if ev.action == "add_worker":
                stack.add_worker(added)
            elif ev.action == "remove_worker":  # validation checked the target is running then
                target = ev.worker if ev.worker is not None else min(live, default=None)
                if target not in live:  # it exited on its own meanwhile (a crash, a kill)
                    print(json.dumps({"event": "chaos", "action": ev.action, "at_s": ev.at_s, "ok": False,
                                      "detail": f"worker {target} is not running"}), file=sys.stderr)
                    continue
                live.remove(target)
                kids.retire(f"worker-{target}", signal.SIGTERM if ev.graceful else signal.SIGKILL)
            else:  # through the router's control channel (the named replica's, else the first)
                target_router = stack.routers[ev.replica] if ev.replica is not None else router
                reply = send_control(target_router, token, ev)
                print(json.dumps({"event": "chaos", "action": ev.action, "at_s": ev.at_s, "ok": reply.ok,
                                  "detail": reply.detail}), file=sys.stderr)
        problem = kids.crashed(workers_too=False) or _worker_exits(kids, scenario, live, "kvemu up", stack.routers,
                                                                   token)
        if problem:
            print(f"kvemu up: {problem}; stopping", file=sys.stderr)
            if problem.startswith("router"):  # the load generator fails what is open at once and reports
                _let_report(loadgen, outdir, started_wall, "partial report", stop=signal.SIGUSR1)
            return 1
        time.sleep(0.05)
    code = loadgen.returncode
    if stack.http:
        _save_metrics(stack.http, outdir)
    where = (f"report in {outdir}" if _written_since(outdir, started_wall) else
             f"no report in {outdir} (the load generator's lines above say why, or where it went)")
    relaying.join(5.0)  # its last lines (the run's summary table) reach our standard output before we exit
    print(f"kvemu up: done in {time.monotonic() - started:.1f} s; {where}", file=sys.stderr)
    return code


def _interrupted(loadgen: subprocess.Popen[str], outdir: Path, since: float, stop: StopSignals, running: bool) -> int:
    """A signal asked ``kvemu up`` to stop: the load generator gets the same signal and writes its partial report
    (a second signal is passed on too: it says so, and goes on writing); returns the exit code for the signal."""
    loadgen.send_signal(stop.signum)
    told_hurry = False
    deadline = time.monotonic() + LOADGEN_REPORT_S
    while loadgen.poll() is None and time.monotonic() < deadline:
        if stop.hurry.is_set() and not told_hurry:
            told_hurry = True
            loadgen.send_signal(stop.signum)
        time.sleep(0.02)
    if _written_since(outdir, since):
        print(f"kvemu up: interrupted ({stop.reason}); partial report in {outdir}", file=sys.stderr, flush=True)
    elif not running:  # (the load generator said why: it was generating the workload, or waiting for the router)
        print(f"kvemu up: interrupted ({stop.reason}) before the run started: nothing ran; no report",
              file=sys.stderr, flush=True)
    else:
        print(f"kvemu up: interrupted ({stop.reason}); the load generator wrote no report in {outdir} (its lines "
              "above say why)", file=sys.stderr, flush=True)
    return stop.exit_code
