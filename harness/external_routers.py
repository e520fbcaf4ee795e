"""Routers that are not kvemu's, in front of a kvemu fleet: the flags each takes for a fleet, and how to start it.

Known routers come from their PyPI packages (``pip install 'kvemu[routers]'``): ``vllm-router`` (vLLM's
router; its ``kv_aware`` policy consumes the workers' vLLM KV events) and ``sglang-router`` (SGLang's model
gateway; its ``cache_aware`` policy keeps an approximate radix tree of the text it routed). Any other router
is a ``cmd:`` template whose ``{flags}``, ``{sglang_flags}``, ``{workers}`` and ``{port}`` are filled in.
"""

from __future__ import annotations

import re
import shlex
import shutil
import string
import sys
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

from harness.procs.fleet import FleetInfo
from harness.run.pools import AGGREGATED
from harness.router_contract import CMD_CONTRACT, PLACEHOLDERS, READY_TIMEOUT_S

__all__ = ["RouterSpec", "KNOWN_ROUTERS", "READY_PATHS", "READY_TIMEOUT_S", "PLACEHOLDERS", "CMD_CONTRACT",
           "parse_router", "fleet_flags", "fill_command", "flag_caveats", "router_command", "router_folder",
           "unique_labels", "RouterSpecError"]

KNOWN_ROUTERS = ("vllm-router", "sglang-router")


class RouterSpecError(ValueError):
    """A ``--router`` value that names no router kvemu can start."""


class RouterSpec(msgspec.Struct, frozen=True):
    """One router to put in front of a fleet: ``kvemu``, a known router with a policy, or a command template."""

    kind: str
    """``kvemu``, ``vllm-router``, ``sglang-router`` or ``cmd``."""
    policy: str = ""
    command: str = ""
    """``cmd``: the command line, with ``{flags}`` etc. to fill in."""

    @property
    def label(self) -> str:
        """How reports name it: ``vllm-router:kv_aware``, ``kvemu``, ``cmd:<program>`` (an interpreter's script
        or module: ``cmd:my_proxy.py`` for ``python my_proxy.py {workers}``). Not unique: see ``unique_labels``."""
        if self.kind == "cmd":
            return f"cmd:{_program(shlex.split(self.command))}"
        return f"{self.kind}:{self.policy}" if self.policy else self.kind


_INTERPRETER = re.compile(r"(python|pypy|node|bash|sh|zsh|ruby|perl|bun|deno)[\d.]*(\.exe)?")
"""Programs that run the script (or ``-m`` module) they are given: a router run by one is named by its script."""


def _program(words: list[str]) -> str:
    """What a command runs: its program's name, or for an interpreter its script or ``-m`` module."""
    if not words:
        return ""
    first = Path(words[0]).name
    if _INTERPRETER.fullmatch(first):
        for i, word in enumerate(words[1:], 1):
            if word == "-m" and i + 1 < len(words):
                return words[i + 1]
            if not word.startswith("-"):
                return Path(word).name
    return first


def router_folder(label: str) -> str:
    """The folder of a router's report under bench-router's output: its label, made a file name."""
    return label.replace(":", "-").replace("/", "-")


def unique_labels(labels: list[str]) -> list[str]:
    """``labels`` with a repeat (of a label, or of its folder) given ``-2``, ``-3``...: no two routers of one
    bench share a row or a folder, so none overwrites another's report."""
    taken: set[str] = set()
    out = []
    for label in labels:
        candidate, n = label, 1
        while router_folder(candidate) in taken:
            n += 1
            candidate = f"{label}-{n}"
        taken.add(router_folder(candidate))
        out.append(candidate)
    return out


POLICIES = {
    "vllm-router": ("random", "round_robin", "cache_aware", "kv_aware", "power_of_two", "consistent_hash",
                    "sticky_least_loaded"),
    "sglang-router": ("random", "round_robin", "cache_aware", "power_of_two"),
}
DEFAULT_POLICY = {"vllm-router": "kv_aware", "sglang-router": "cache_aware"}


def parse_router(text: str) -> RouterSpec:
    """``kvemu``, ``vllm-router[:POLICY]``, ``sglang-router[:POLICY]`` or ``cmd:COMMAND`` (``RouterSpecError``
    naming the choices otherwise)."""
    if text == "kvemu":
        return RouterSpec("kvemu")
    if text.startswith("cmd:"):
        command = text[4:].strip()
        if not command:
            raise RouterSpecError("--router cmd:COMMAND: the command is empty")
        fill_command(command, FleetInfo(model="m", workers=[], kv_events_version="0.33"), 1)  # its fields exist
        return RouterSpec("cmd", command=command)
    kind, _, policy = text.partition(":")
    if kind not in POLICIES:
        raise RouterSpecError(f"--router {text!r}: one of kvemu, {', '.join(k + '[:POLICY]' for k in KNOWN_ROUTERS)} "
                              "or 'cmd:COMMAND WITH {flags}'")
    policy = policy or DEFAULT_POLICY[kind]
    if policy not in POLICIES[kind]:
        raise RouterSpecError(f"--router {text!r}: {kind}'s policies are {', '.join(POLICIES[kind])}")
    return RouterSpec(kind, policy)


def fill_command(command: str, fleet: FleetInfo, port: int) -> str:
    """A ``cmd:`` router's command with its ``PLACEHOLDERS`` filled in; ``RouterSpecError`` naming an unknown
    one (or a malformed brace) and the known ones."""
    known = ", ".join(f"{{{k}}}" for k in PLACEHOLDERS)
    try:
        names = [field for _, field, _, _ in string.Formatter().parse(command) if field is not None]
    except ValueError as exc:
        raise RouterSpecError(f"--router cmd:{command}: {exc} (write {{{{ and }}}} for a literal brace)") from None
    for name in names:
        if name not in PLACEHOLDERS:
            raise RouterSpecError(f"--router cmd:{command}: unknown placeholder {{{name}}} in the cmd: router's "
                                  f"command; known: {known} (write {{{{ and }}}} for a literal brace)")
    return command.format(flags=shlex.join(fleet_flags("vllm-router", fleet)), port=port,
                          sglang_flags=shlex.join(fleet_flags("sglang-router", fleet)),
                          workers=" ".join(w.url for w in fleet.workers))


def _uniform_dp(workers: list) -> int:
    sizes = {w.dp_size for w in workers}
    return sizes.pop() if len(sizes) == 1 else 0


def fleet_flags(router: str, fleet: FleetInfo, policy: str | None = None) -> list[str]:
    """The arguments ``router`` (``vllm-router`` or ``sglang-router``) takes to put ``fleet`` behind it: its
    workers (prefill and decode lists for a disaggregated fleet), their DP size, and for vllm-router the KV-event
    and replay sources per worker and their block size."""
    agg, prefill, decode = fleet.pool(AGGREGATED), fleet.pool("prefill"), fleet.pool("decode")
    dp = _uniform_dp(agg or prefill + decode)
    if router not in KNOWN_ROUTERS:
        raise RouterSpecError(f"--print-flags {router!r}: one of {', '.join(KNOWN_ROUTERS)}")
    if agg:
        flags = ["--worker-urls", *[w.url for w in agg]]
    else:  # each router's PD mode: prefill and decode lists
        flags = ["--vllm-pd-disaggregation" if router == "vllm-router" else "--pd-disaggregation"]
        for w in prefill:  # sglang's bootstrap server is the prefill worker's own port (kvemu/kv/room)
            flags += ["--prefill", w.url, *([str(urlsplit(w.url).port)] if router == "sglang-router" else [])]
        flags += [x for w in decode for x in ("--decode", w.url)]
    if router == "vllm-router":
        if dp > 1:
            flags += ["--intra-node-data-parallel-size", str(dp)]
        sources = agg or prefill  # the ranks whose cache a request's prompt lands in
        if sources and (policy is None or policy == "kv_aware"):
            flags += ["--kv-event-block-size", str(sources[0].block_size), "--kv-event-model", fleet.model]
            name = "--kv-event-source" if agg else "--pd-kv-events"
            for w in sources:
                flags += [name, f"{w.url}={','.join(w.kv_events)}"]
            if agg:
                for w in agg:
                    if all(w.kv_replay):
                        flags += ["--kv-event-replay-source", f"{w.url}={','.join(w.kv_replay)}"]
    elif dp > 1:  # sglang-router asks each worker's /server_info for its DP size
        flags += ["--dp-aware"]
    if policy is not None:
        flags += ["--policy", policy]
    return flags


PD_KV_EVENT_BLOCK_SIZE = 16
"""vllm-router's ``--pd-kv-events`` hashes 16-token blocks whatever ``--kv-event-block-size`` says (its --help,
0.1.17; checked: with 64-token engine blocks its PD ``kv_aware`` credits no prefix at all)."""


def flag_caveats(router: str, fleet: FleetInfo, policy: str | None = None) -> list[str]:
    """What ``router`` cannot do for ``fleet`` with the flags it takes (a line each; empty: nothing known)."""
    prefill = fleet.pool("prefill")
    out = []
    if router == "vllm-router" and prefill and policy in (None, "kv_aware"):
        sizes = sorted({w.block_size for w in prefill})
        if sizes != [PD_KV_EVENT_BLOCK_SIZE]:
            out.append(f"vllm-router's PD mode reads KV events as {PD_KV_EVENT_BLOCK_SIZE}-token blocks (--pd-kv-events "
                       f"has no block size), and this fleet's prefill workers publish {'/'.join(map(str, sizes))}-token "
                       f"blocks: its kv_aware prefill policy will find no prefix (set the prefill engine's "
                       f"block_size to {PD_KV_EVENT_BLOCK_SIZE} to compare it fairly)")
    return out


def _executable(name: str) -> str:
    """A router's executable: beside this Python's (its virtual environment), else on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise RouterSpecError(f"{name} is not installed: pip install 'kvemu[routers]' (or pip install {name})")
    return found


READY_PATHS = {"vllm-router": ("/health", "/v1/models"), "sglang-router": ("/readiness", "/v1/models"),
               "cmd": ("/health",), "kvemu": ("/health", "/v1/models")}
"""What answers 200 once a router can route (sglang-router's ``/health`` does before any worker registered)."""


def router_command(spec: RouterSpec, fleet: FleetInfo, port: int, metrics_port: int | None) -> list[str]:
    """The command line that starts ``spec`` on 127.0.0.1:``port`` in front of ``fleet``, a known router's
    Prometheus endpoint on 127.0.0.1:``metrics_port`` (both routers default to 0.0.0.0:29000: runs side by side
    would collide; a ``cmd:`` router is given none). Not ``kvemu``: kvemu's own router is started by
    ``kvemu serve``."""
    if spec.kind in KNOWN_ROUTERS:
        if metrics_port is None:
            raise RouterSpecError(f"router {spec.kind!r} needs a port for its Prometheus endpoint")
        launch = ["launch"] if spec.kind == "sglang-router" else []
        return [_executable(spec.kind), *launch, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host",
                "127.0.0.1", "--prometheus-port", str(metrics_port), *fleet_flags(spec.kind, fleet, spec.policy)]
    if spec.kind == "cmd":
        return shlex.split(fill_command(spec.command, fleet, port))
    raise RouterSpecError(f"router {spec.kind!r} is not started as a command")
