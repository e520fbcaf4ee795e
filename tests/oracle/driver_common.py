"""What the oracle drivers (``vllm_driver.py``, ``sglang_driver.py``) share: the workload's checks, the KV
events as JSON, and the process's modes (one workload, ``--batch``, ``--serve``).

Standard library only: each driver runs in its own oracle venv and imports this module as a sibling of its
script (``import driver_common``); kvemu's python can import it as ``tests.oracle.driver_common``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

VOCAB_SIZE = 1 << 20
REQUEST_KEYS = {"id", "prompt", "output", "arrive_step", "priority", "abort_step"}
POSITIVE_KEYS = ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len")


class WorkloadError(ValueError):
    """The workload is malformed or asks for what the driver does not cover, or the engine resolved a setting
    other than the one asked for."""


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def expect(engine: str, what: str, got: Any, want: Any) -> None:
    if got != want:
        raise WorkloadError(f"{engine} resolved {what} = {got!r}, but the workload asks for {want!r}")


def check_workload(workload: Any, required: dict[str, type],
                   optional: dict[str, tuple[type | tuple[type, ...], Any]]) -> dict[str, Any]:
    """The checks both drivers make: known keys of the right types (every ``required`` config key present,
    ``optional`` ones defaulted), positive sizes, and well-formed requests (distinct string ids, non-empty token
    lists within the vocabulary, prompts shorter than ``max_model_len``, ``arrive_step`` >= 0, an int
    ``priority``, ``abort_step`` null or >= ``arrive_step``). Returns ``{"config", "requests", "max_steps"}``."""
    if not isinstance(workload, dict):
        raise WorkloadError("a workload is a JSON object")
    unknown = set(workload) - {"config", "requests", "max_steps"}
    if unknown:
        raise WorkloadError(f"unknown workload keys: {sorted(unknown)}")
    config = workload.get("config")
    if not isinstance(config, dict):
        raise WorkloadError("workload['config'] must be an object")
    unknown = set(config) - set(required) - set(optional)
    if unknown:
        raise WorkloadError(f"unknown config keys: {sorted(unknown)}")
    resolved: dict[str, Any] = {}
    for key, kind in required.items():
        if key not in config:
            raise WorkloadError(f"config[{key!r}] is required (every scheduling setting is explicit)")
        value = config[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise WorkloadError(f"config[{key!r}] must be {kind.__name__}, got {value!r}")
        resolved[key] = value
    for key, (kinds, default) in optional.items():
        value = config.get(key, default)
        if (value is not None or default is not None) and (
                not isinstance(value, kinds) or isinstance(value, bool) is not (kinds is bool)):
            raise WorkloadError(f"config[{key!r}] has the wrong type: {value!r}")
        resolved[key] = value
    for key in POSITIVE_KEYS:
        if resolved[key] < 1:
            raise WorkloadError(f"config[{key!r}] must be >= 1")
    requests = workload.get("requests")
    if not isinstance(requests, list):
        raise WorkloadError("workload['requests'] must be a list")
    seen: set[str] = set()
    for req in requests:
        if not isinstance(req, dict) or set(req) - REQUEST_KEYS or not {"id", "prompt", "output"} <= set(req):
            raise WorkloadError(f"a request has keys {sorted(REQUEST_KEYS)} (id, prompt, output required): {req!r}")
        rid = req["id"]
        if not isinstance(rid, str) or rid in seen:
            raise WorkloadError(f"request ids are distinct strings: {rid!r}")
        seen.add(rid)
        for key in ("prompt", "output"):
            tokens = req[key]
            if not isinstance(tokens, list) or not tokens or not all(
                    is_int(t) and 0 <= t < VOCAB_SIZE for t in tokens):
                raise WorkloadError(f"request {rid}: {key} must be a non-empty list of token ids in "
                                    f"[0, {VOCAB_SIZE})")
        if len(req["prompt"]) >= resolved["max_model_len"]:
            raise WorkloadError(f"request {rid}: its prompt does not fit max_model_len")
        for key in ("arrive_step", "priority"):
            value = req.get(key, 0)
            if not is_int(value) or (key == "arrive_step" and value < 0):
                raise WorkloadError(f"request {rid}: {key} must be an int (arrive_step >= 0)")
        abort = req.get("abort_step")
        if abort is not None and (not is_int(abort) or abort < req.get("arrive_step", 0)):
            raise WorkloadError(f"request {rid}: abort_step must be null or an int >= arrive_step")
    max_steps = workload.get("max_steps", 100_000)
    if not is_int(max_steps) or max_steps < 1:
        raise WorkloadError("max_steps must be a positive int")
    return {"config": resolved, "requests": requests, "max_steps": max_steps}


class EventRecorder:
    """Stands in for an engine's KV-event publisher: keeps the published event batches in memory, and gives
    them as JSON lists. ``kinds`` are the engine's (BlockStored, BlockRemoved, AllBlocksCleared) classes, which
    vLLM and SGLang define alike (``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``)."""

    def __init__(self, kinds: tuple[type, type, type]) -> None:
        self.kinds = kinds
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass

    def take(self) -> list[list[Any]]:
        stored, removed, cleared = self.kinds
        out: list[list[Any]] = []
        for batch in self.batches:
            for event in batch.events:
                if isinstance(event, stored):
                    out.append(["stored", list(event.block_hashes), event.parent_block_hash,
                                list(event.token_ids), event.block_size])
                elif isinstance(event, removed):
                    out.append(["removed", list(event.block_hashes)])
                elif isinstance(event, cleared):
                    out.append(["cleared"])
                else:
                    raise RuntimeError(f"unexpected KV event {event!r}")
        self.batches.clear()
        return out


Records = list[dict[str, Any]]


def driver_main(argv: list[str], name: str, check: Callable[[Any], dict[str, Any]],
                start: Callable[[str], None], run: Callable[[dict[str, Any], str, int], Records]) -> int:
    """A driver's process: one workload on stdin, ``--batch`` (a JSON list, each record tagged ``"workload":
    i``) or ``--serve`` (a workload a line, each answered by its records and ``{"end": true}``, or ``{"end":
    true, "error": reason}`` for a refused one). ``start(work_dir)`` runs once (imports, the model config);
    ``run(checked_workload, work_dir, index)`` gives one workload's records. The engine's logging goes to
    stderr: stdout carries only the records. Exit 2 for a refused workload (outside ``--serve``)."""
    batch = argv[1:] == ["--batch"]
    serve = argv[1:] == ["--serve"]
    if argv[1:] and not (batch or serve):
        print(f"usage: {name} [--batch | --serve] < workload.json", file=sys.stderr)
        return 2
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        with tempfile.TemporaryDirectory(prefix="kvemu-oracle-") as work:
            if serve:
                _serve(out, check, start, run, work)
            else:
                raw = json.load(sys.stdin)
                if batch and not isinstance(raw, list):
                    raise WorkloadError("--batch reads a JSON list of workloads")
                checked = [check(w) for w in (raw if batch else [raw])]
                start(work)
                for index, workload in enumerate(checked):
                    for record in run(workload, work, index):
                        if batch:
                            record = {"workload": index, **record}
                        out.write(json.dumps(record, separators=(",", ":")) + "\n")
                    out.flush()
    except WorkloadError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    out.close()
    return 0


def _serve(out: Any, check: Callable[[Any], dict[str, Any]], start: Callable[[str], None],
           run: Callable[[dict[str, Any], str, int], Records], work: str) -> None:
    start(work)
    for index, line in enumerate(sys.stdin):
        if not line.strip():
            continue
        try:
            records = run(check(json.loads(line)), work, index)
        except WorkloadError as exc:
            out.write(json.dumps({"end": True, "error": str(exc)}) + "\n")
            out.flush()
            continue
        for record in records:
            out.write(json.dumps(record, separators=(",", ":")) + "\n")
        out.write('{"end":true}\n')
        out.flush()
