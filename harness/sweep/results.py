"""A sweep's output directory: the runs already finished (for resume), and sweep.csv / sweep.json.

Every finished run is appended to ``sweep-log.jsonl`` at once (one ``PointResult`` a line, keys sorted), and
``sweep.csv`` and ``sweep.json`` are rewritten from all results at most every ``REWRITE_INTERVAL_S`` and at the
end, each through a temporary file renamed over the old one, so a reader never sees half a file. A later sweep of the same name into the same directory reuses every run whose
resolved scenario and seed (``PointSpec.key``) finished ``ok`` with all the figures now asked for; failed,
partial and unfinished runs run again. An earlier result is decoded against ``PointResult``'s bounds (the files
are untrusted): a line torn by a kill, or one past a bound, is not reused (its run runs again) and is named,
with the field at fault, in ``SweepStore.refused``.

sweep.csv holds no wall-clock figure, so the same sweep gives the same bytes on any executor: one row per
run, by point then seed; columns ``point``, one per axis key, ``seed``, ``status``, the requested figures,
``error``. sweep.json adds the spec, every recorded figure and each run's wall times.
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta

from harness.report.files import OutputError, claim_outdir
from harness.sweep.spec import MAX_RUNS, Figure, PointResult, PointSpec, Sweep, SweepError, WallMs, WallSeconds

__all__ = ["SweepStore", "SweepTiming", "csv_text", "LOG", "CSV", "JSON", "MARKDOWN", "REWRITE_INTERVAL_S", "FORMAT",
           "MAX_REFUSED", "MAX_RESULTS_BYTES"]

LOG = "sweep-log.jsonl"
CSV = "sweep.csv"
JSON = "sweep.json"
MARKDOWN = "sweep.md"
FORMAT = "kvemu-sweep/1"
REWRITE_INTERVAL_S = 1.0
"""sweep.csv and sweep.json are rewritten at most this often while runs finish (the log has every run)."""
_T = TypeVar("_T")
MAX_REFUSED = 20
MAX_RESULTS_BYTES = 1 << 30
"""Largest earlier sweep.json or log read on resume (1 GiB: 10,000 runs of about 100 KiB, each far past a real
one); a larger file is refused whole and its runs run again."""
"""Most refused earlier results ``SweepStore.refused`` describes (it counts the rest)."""


class SweepTiming(msgspec.Struct, kw_only=True, frozen=True):
    """How a sweep went (sweep.json's ``timing``): where it ran, its wall time, runs ran and reused, its stop."""

    executor: str
    wall_time_s: float
    runs_ran: int
    runs_reused: int
    interrupted: str | None


class _Document(msgspec.Struct):
    """What an earlier sweep.json holds that resume reads: its runs (each decoded on its own)."""

    runs: Annotated[list[msgspec.Raw], Meta(max_length=MAX_RUNS)] = []


class _Timing(msgspec.Struct, frozen=True):
    wall_time_s: WallSeconds | None = None
    run_wall_time_ms: WallMs | None = None


class _StoredRun(PointResult, kw_only=True, frozen=True):
    """A run as sweep.json holds it: its wall times under ``timing``."""

    timing: _Timing = _Timing()

    def result(self) -> PointResult:
        """The run as a ``PointResult`` (its wall times lifted from ``timing``)."""
        fields = {name: getattr(self, name) for name in PointResult.__struct_fields__}
        return PointResult(**{**fields, "wall_time_s": self.timing.wall_time_s,
                              "run_wall_time_ms": self.timing.run_wall_time_ms})


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _cell(value: Figure) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _last_byte(path: Path) -> bytes:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def _decode(data: bytes | msgspec.Raw, kind: type[_T]) -> _T:
    """``data`` decoded as ``kind``; ``msgspec.DecodeError`` says why not, naming the field at fault where the
    JSON is whole (``NaN`` and ``Infinity``, not JSON to msgspec, are read by the stdlib to find their field)."""
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError as exc:
        try:
            msgspec.convert(json.loads(bytes(data)), kind)
        except (ValueError, RecursionError, msgspec.ValidationError) as loose:  # torn, or the field at fault
            raise (loose if isinstance(loose, msgspec.ValidationError) else exc) from None
        raise  # (whatever else msgspec refuses stays refused)


def _json(result: PointResult) -> str:
    """A sweep-log.jsonl line: the result's keys sorted, as the stdlib writes them (the bytes earlier kvemu wrote)."""
    return json.dumps(msgspec.to_builtins(result), sort_keys=True, allow_nan=False)


def csv_text(sweep: Sweep, runs: list[PointSpec], results: dict[str, PointResult]) -> str:
    """sweep.csv: a row per planned run (``pending`` where no result yet), no wall-clock figure."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    figures = list(sweep.spec.figures)
    writer.writerow(["point", *sweep.axes, "seed", "status", *figures, "error"])
    for run in runs:
        result = results.get(run.key)
        values = result.figures if result else {}
        writer.writerow([run.point, *(run.axes[a] for a in sweep.axes), run.seed,
                         result.status if result else "pending", *(_cell(values.get(f)) for f in figures),
                         _cell(result.error) if result else ""])
    return out.getvalue()


class SweepStore:
    """The results of one sweep in ``outdir``: reused from an earlier attempt, recorded as runs finish."""

    def __init__(self, outdir: Path, sweep: Sweep, runs: list[PointSpec], *, force: bool = False) -> None:
        """Take ``outdir`` for ``sweep`` (refusing one that holds something else unless ``force``) and load the
        runs an earlier attempt finished there."""
        self.outdir = Path(outdir)
        self.sweep = sweep
        self.runs = runs
        self.results: dict[str, PointResult] = {}
        self.timing: SweepTiming | None = None
        self.refused: list[str] = []
        """The first ``MAX_REFUSED`` earlier results refused because they do not decode: where (file and line),
        and why (the field at fault)."""
        self.refusals = 0
        """How many earlier results were refused."""
        self._written = 0.0
        self._claim(force)
        wanted = {run.key: run for run in runs}
        for result in self._previous() if not force else []:
            run = wanted.get(result.key)
            if run is not None and result.status == "ok" and set(run.figures) <= set(result.figures):
                self.results[run.key] = result.relabel(run)
        self.reused = len(self.results)
        self._log = (self.outdir / LOG).open("a" if not force else "w", encoding="utf-8")
        if self._log.tell() and _last_byte(self.outdir / LOG) != b"\n":
            self._log.write("\n")  # a line torn by a kill ends here: the next result starts a line of its own
        self.write()

    def _claim(self, force: bool) -> None:
        outdir = self.outdir
        existing = [p.name for p in outdir.iterdir()] if outdir.is_dir() else []
        try:
            claim_outdir(outdir, force=force, ours=(LOG, JSON), what="kvemu sweep", into="write this sweep there")
        except OutputError as exc:
            raise SweepError(str(exc)) from None
        if not existing or force:
            return
        try:
            previous = json.loads((outdir / JSON).read_text(encoding="utf-8"))
            name = previous["name"] if previous.get("format") == FORMAT else None
        except (OSError, ValueError, KeyError, TypeError):
            name = None
        if name is None and LOG not in existing:
            raise SweepError(f"{outdir} holds no kvemu sweep ({JSON} is not one): choose another -o OUTDIR, or pass "
                             "--force to write this sweep there")
        if name is not None and name != self.sweep.name:
            raise SweepError(f"{outdir} holds sweep {name!r}, not {self.sweep.name!r}: choose another -o OUTDIR, "
                             "or pass --force to replace its results")

    def _previous(self) -> list[PointResult]:
        """Results found in sweep.json, then the log (later lines win); what does not decode is refused."""
        found: list[PointResult] = []
        document = _Document()
        try:
            document = msgspec.json.decode(self._bounded(JSON), type=_Document)
        except OSError:
            pass  # (no earlier sweep.json)
        except msgspec.DecodeError as exc:
            self._refuse(JSON, exc)
        for i, raw in enumerate(document.runs):
            try:
                stored = _decode(raw, _StoredRun)
            except msgspec.DecodeError as exc:
                self._refuse(f"{JSON} runs[{i}]", exc)
                continue
            found.append(stored.result())
        try:
            lines = self._bounded(LOG).splitlines()
        except OSError:
            lines = []
        except msgspec.DecodeError as exc:
            self._refuse(LOG, exc)
            lines = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                found.append(_decode(line, PointResult))
            except msgspec.DecodeError as exc:  # a line torn by a kill, or one past a bound
                self._refuse(f"{LOG} line {number}", exc)
        return found

    def _bounded(self, name: str) -> bytes:
        """An earlier file's bytes; ``msgspec.DecodeError`` (refused, as a line past a bound is) past
        ``MAX_RESULTS_BYTES``, ``OSError`` when it is missing or unreadable."""
        path = self.outdir / name
        with path.open("rb") as f:
            data = f.read(MAX_RESULTS_BYTES + 1)
        if len(data) > MAX_RESULTS_BYTES:
            raise msgspec.DecodeError(f"larger than {MAX_RESULTS_BYTES:,} bytes: not read")
        return data

    def _refuse(self, where: str, exc: msgspec.DecodeError) -> None:
        self.refusals += 1
        if len(self.refused) < MAX_REFUSED:
            self.refused.append(f"{where}: {str(exc)[:500]}")

    def todo(self) -> list[PointSpec]:
        """The runs still to do, in plan order (each key once: identical runs share one result)."""
        seen: set[str] = set()
        out = []
        for run in self.runs:
            if run.key not in self.results and run.key not in seen:
                seen.add(run.key)
                out.append(run)
        return out

    def record(self, result: PointResult) -> None:
        """Keep a finished run's result: in the log now, in sweep.csv/json at the next rewrite."""
        self.results[result.key] = result
        self._log.write(_json(result) + "\n")
        self._log.flush()
        if time.monotonic() - self._written >= REWRITE_INTERVAL_S:
            self.write()

    def counts(self) -> Counter[str]:
        """Runs by status (``ok``, ``partial``, ``failed``, ``pending``)."""
        return Counter((self.results[r.key].status if r.key in self.results else "pending") for r in self.runs)

    def ordered(self) -> list[PointResult]:
        """One result per planned run, by point then seed (``pending`` placeholders for runs not finished)."""
        return [self.results[run.key].relabel(run) if run.key in self.results else PointResult.pending(run)
                for run in self.runs]

    def write(self, timing: SweepTiming | None = None) -> None:
        """Rewrite sweep.csv and sweep.json from every result so far (``timing``: the sweep's, when it ends)."""
        if timing is not None:
            self.timing = timing
        _atomic_write(self.outdir / CSV, csv_text(self.sweep, self.runs, self.results))
        runs = []
        for result in self.ordered():
            run = {k: v for k, v in msgspec.to_builtins(result).items() if k not in ("wall_time_s", "run_wall_time_ms")}
            run["timing"] = {"wall_time_s": result.wall_time_s, "run_wall_time_ms": result.run_wall_time_ms}
            runs.append(run)
        document = {"format": FORMAT, "name": self.sweep.name, "source": self.sweep.source,
                    "base": self.sweep.base_source, "spec": msgspec.to_builtins(self.sweep.spec),
                    "axes": self.sweep.axes, "figures": list(self.sweep.spec.figures),
                    "counts": dict(sorted(self.counts().items())), "runs": runs}
        if self.timing is not None:
            document["timing"] = msgspec.to_builtins(self.timing)
        _atomic_write(self.outdir / JSON, json.dumps(document, indent=1, sort_keys=True, allow_nan=False) + "\n")
        self._written = time.monotonic()

    def close(self) -> None:
        """Close the log (the files stay)."""
        self._log.close()
