"""A sweep's output directory: the runs already finished (for resume), and sweep.csv / sweep.json.

Every finished run is appended to ``sweep-log.jsonl`` at once (one JSON object a line; a line torn by a kill
is ignored), and ``sweep.csv`` and ``sweep.json`` are rewritten from all results at most every
``REWRITE_INTERVAL_S`` and at the end, each through a temporary file renamed over the old one, so a reader
never sees half a file. A later sweep of the same name into the same directory reuses every run whose
resolved scenario and seed (``PointSpec.key``) finished ``ok`` with all the figures now asked for; failed,
partial and unfinished runs run again.

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
from typing import Any

import msgspec

from harness.report.files import OutputError, claim_outdir
from harness.sweep.spec import PointSpec, Sweep, SweepError

__all__ = ["SweepStore", "csv_text", "LOG", "CSV", "JSON", "MARKDOWN", "REWRITE_INTERVAL_S", "FORMAT"]

LOG = "sweep-log.jsonl"
CSV = "sweep.csv"
JSON = "sweep.json"
MARKDOWN = "sweep.md"
FORMAT = "kvemu-sweep/1"
REWRITE_INTERVAL_S = 1.0
"""sweep.csv and sweep.json are rewritten at most this often while runs finish (the log has every run)."""


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def csv_text(sweep: Sweep, runs: list[PointSpec], results: dict[str, dict[str, Any]]) -> str:
    """sweep.csv: a row per planned run (``pending`` where no result yet), no wall-clock figure."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    figures = list(sweep.spec.figures)
    writer.writerow(["point", *sweep.axes, "seed", "status", *figures, "error"])
    for run in runs:
        result = results.get(run.key)
        values = result["figures"] if result else {}
        writer.writerow([run.point, *(run.axes[a] for a in sweep.axes), run.seed,
                         result["status"] if result else "pending", *(_cell(values.get(f)) for f in figures),
                         _cell(result["error"]) if result else ""])
    return out.getvalue()


class SweepStore:
    """The results of one sweep in ``outdir``: reused from an earlier attempt, recorded as runs finish."""

    def __init__(self, outdir: Path, sweep: Sweep, runs: list[PointSpec], *, force: bool = False) -> None:
        """Take ``outdir`` for ``sweep`` (refusing one that holds something else unless ``force``) and load the
        runs an earlier attempt finished there."""
        self.outdir = Path(outdir)
        self.sweep = sweep
        self.runs = runs
        self.results: dict[str, dict[str, Any]] = {}
        self.meta: dict[str, Any] = {}
        self._written = 0.0
        self._claim(force)
        wanted = {run.key: run for run in runs}
        for result in self._previous() if not force else []:
            run = wanted.get(result.get("key", ""))
            if (run is not None and result.get("status") == "ok"
                    and set(run.figures) <= set(result.get("figures") or {})):
                self.results[run.key] = self._relabel(result, run)
        self.reused = len(self.results)
        self._log = (self.outdir / LOG).open("a" if not force else "w", encoding="utf-8")
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

    def _previous(self) -> list[dict[str, Any]]:
        """Results found in sweep.json, then the log (later lines win)."""
        found: list[dict[str, Any]] = []
        try:
            found += json.loads((self.outdir / JSON).read_text(encoding="utf-8")).get("runs", [])
        except (OSError, ValueError, AttributeError):
            pass
        try:
            lines = (self.outdir / LOG).read_text(encoding="utf-8").splitlines()
        except OSError:
            lines = []
        for line in lines:
            try:
                found.append(json.loads(line))
            except ValueError:
                continue  # a line torn by a kill
        return [r for r in found if isinstance(r, dict)]

    @staticmethod
    def _relabel(result: dict[str, Any], run: PointSpec) -> dict[str, Any]:
        """An earlier result under this sweep's numbering (the sweep file may have changed since)."""
        return {**result, "point": run.point, "seed": run.seed, "axes": dict(run.axes)}

    def todo(self) -> list[PointSpec]:
        """The runs still to do, in plan order (each key once: identical runs share one result)."""
        seen: set[str] = set()
        out = []
        for run in self.runs:
            if run.key not in self.results and run.key not in seen:
                seen.add(run.key)
                out.append(run)
        return out

    def record(self, result: dict[str, Any]) -> None:
        """Keep a finished run's result: in the log now, in sweep.csv/json at the next rewrite."""
        self.results[result["key"]] = result
        self._log.write(json.dumps(result, sort_keys=True, allow_nan=False) + "\n")
        self._log.flush()
        if time.monotonic() - self._written >= REWRITE_INTERVAL_S:
            self.write()

    def counts(self) -> Counter[str]:
        """Runs by status (``ok``, ``partial``, ``failed``, ``pending``)."""
        return Counter((self.results[r.key]["status"] if r.key in self.results else "pending") for r in self.runs)

    def ordered(self) -> list[dict[str, Any]]:
        """One result per planned run, by point then seed (``pending`` placeholders for runs not finished)."""
        out = []
        for run in self.runs:
            result = self.results.get(run.key)
            if result is None:
                result = {"point": run.point, "seed": run.seed, "axes": dict(run.axes), "key": run.key,
                          "status": "pending", "error": None, "figures": {}, "wall_time_s": None,
                          "run_wall_time_ms": None}
            out.append(self._relabel(result, run))
        return out

    def write(self, timing: dict[str, Any] | None = None) -> None:
        """Rewrite sweep.csv and sweep.json from every result so far (``timing``: the sweep's, when it ends)."""
        if timing is not None:
            self.meta["timing"] = timing
        _atomic_write(self.outdir / CSV, csv_text(self.sweep, self.runs, self.results))
        runs = []
        for result in self.ordered():
            run = {k: v for k, v in result.items() if k not in ("wall_time_s", "run_wall_time_ms")}
            run["timing"] = {"wall_time_s": result.get("wall_time_s"),
                             "run_wall_time_ms": result.get("run_wall_time_ms")}
            runs.append(run)
        document = {"format": FORMAT, "name": self.sweep.name, "source": self.sweep.source,
                    "base": self.sweep.base_source, "spec": msgspec.to_builtins(self.sweep.spec),
                    "axes": self.sweep.axes, "figures": list(self.sweep.spec.figures),
                    "counts": dict(sorted(self.counts().items())), "runs": runs, **self.meta}
        _atomic_write(self.outdir / JSON, json.dumps(document, indent=1, sort_keys=True, allow_nan=False) + "\n")
        self._written = time.monotonic()

    def close(self) -> None:
        """Close the log (the files stay)."""
        self._log.close()
