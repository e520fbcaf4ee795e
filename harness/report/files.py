"""A run's report on disk: summary.json, requests.jsonl, report.md, the plots and the resolved scenario
(scenario.yaml) in one directory.

The plots are drawn by ``harness.report.plots``; this module imports neither matplotlib nor numpy until a report
is written. A report is never lost to a directory that became unwritable during the run (``save_report``).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec

from kvemu.errors import KvemuError
from kvemu.records import RequestRecord, flat_json, records_jsonl, sequences_as_lists

from harness.report.plots import start_plots
from harness.report.sla import Sla
from harness.report.run_data import RunData
from harness.report.summary import dumps_summary, sorted_records, summarize
from harness.report.summary_types import Summary
from harness.report.markdown import render_markdown
from harness.report.what_ran import SCENARIO_FILE, scenario_yaml


def write_requests(records: Iterable[RequestRecord], path: Path, sla: Sla | None = None,
                   phases: dict[str, str] | None = None, replica_of: dict[str, int] | None = None) -> int:
    """Write one msgspec-encoded record per line (field order of ``RequestRecord``, then ``met_sla`` when the
    run has an SLA, ``phase`` when it ran on lanes, ``router_replica`` when it had router replicas), by arrival then
    id."""
    ordered: list[RequestRecord] = sorted_records(records)
    encoder = msgspec.json.Encoder(enc_hook=sequences_as_lists)
    columns: list[tuple[bytes, Callable[[RequestRecord], object]]] = []
    if sla is not None:
        columns.append((b',"met_sla":', sla.met))
    if phases is not None:
        columns.append((b',"phase":', lambda r: phases.get(r.request_id, "profile")))
    if replica_of is not None:
        columns.append((b',"router_replica":', lambda r: replica_of.get(r.request_id)))
    encode = encoder.encode
    with path.open("wb") as f:
        for i in range(0, len(ordered), RECORDS_PER_WRITE):
            part = ordered[i:i + RECORDS_PER_WRITE]
            if not columns:
                f.write(records_jsonl(part, encoder))
            else:  # (the record's object, its closing brace replaced by the extra columns)
                f.write(b"".join(flat_json(r, encoder)[:-1]
                                 + b"".join(key + encode(column(r)) for key, column in columns)
                                 + b"}\n" for r in part))
    return len(ordered)


RECORDS_PER_WRITE = 64
"""requests.jsonl is encoded and written this many records at a time: the hour's 65 MB in one piece cost three
passes over fresh memory (encode, flatten, write), 0.75 s against 0.26 s in pieces."""


class OutputError(KvemuError, OSError):
    """The report directory cannot be created or written."""


REPORT_FILES = frozenset({"summary.json", "routers.json", "plan.json"})
"""Files that mark a folder as an earlier kvemu report (a run's, ``up``'s or ``loadgen``'s; ``bench-router``'s;
``plan``'s): one holding any of them is written over; ``claim_outdir``."""


def claim_outdir(outdir: str | Path, *, force: bool = False, ours: Iterable[str] = REPORT_FILES,
                 what: str = "earlier kvemu report", into: str = "write the report there") -> Path:
    """``prepare_outdir``, refusing first a folder that is not empty and holds none of ``ours`` (an earlier
    kvemu output) unless ``force``: ``-o examples`` must not scatter a report's files into a source tree."""
    outdir = Path(outdir)
    try:
        existing = {p.name for p in outdir.iterdir() if not p.name.startswith(".kvemu-write-check-")}
    except OSError:  # absent (created below), or not a folder (prepare_outdir says so)
        existing = set()
    if existing and not force and existing.isdisjoint(ours):
        raise OutputError(f"{outdir} is not empty and holds no {what}: choose another -o OUTDIR, or pass "
                          f"--force to {into}")
    return prepare_outdir(outdir)


def prepare_outdir(outdir: str | Path) -> Path:
    """Create the report directory and prove it writable now, so a bad path fails before the run, not after it."""
    outdir = Path(outdir)
    what = "cannot be created"
    try:
        outdir.mkdir(parents=True, exist_ok=True)
        what = "is not writable"
        probe = outdir / f".kvemu-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except FileExistsError:
        raise OutputError(f"report directory {outdir}: a file of that name exists") from None
    except NotADirectoryError:
        raise OutputError(f"report directory {outdir}: part of the path is a file, not a directory") from None
    except OSError as exc:
        raise OutputError(f"report directory {outdir} {what}: {exc.strerror or exc}") from None
    return outdir


def write_report(data: RunData, outdir: Path) -> Summary:
    """Write summary.json, requests.jsonl, report.md, the plots and scenario.yaml into ``outdir``; return the
    summary. A run's results are never lost to a directory that became unwritable meanwhile: see ``save_report``."""
    return save_report(data, outdir)[0]


def save_report(data: RunData, outdir: Path) -> tuple[Summary, Path | None]:
    """``write_report``, and where the report went: ``outdir``; or, when that cannot be written (removed, made
    read-only or replaced by a file while the run went), a new directory under the system's temporary directory,
    named on stderr in one line; or None when that fails too, and the summary is printed on stderr instead."""
    made: list[Summary] = []  # summarized once, while the first attempt's plots are drawn

    def summary_now() -> Summary:
        if not made:
            made.append(summarize(data))
        return made[0]

    outdir = Path(outdir)
    try:
        _write_files(data, summary_now, outdir)
        return summary_now(), outdir
    except OSError as exc:
        why = _why_unwritable(exc)
    try:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", data.scenario_name)[:60] or "run"
        fallback = Path(tempfile.mkdtemp(prefix=f"kvemu-report-{name}-"))
        _write_files(data, summary_now, fallback)
    except OSError as exc:
        print(f"kvemu: cannot write the report in {outdir} ({why}) nor in a temporary directory "
              f"({_why_unwritable(exc)}); its summary follows", file=sys.stderr, flush=True)
        summary = summary_now()
        print(dumps_summary(summary), file=sys.stderr, end="", flush=True)
        return summary, None
    print(f"kvemu: cannot write the report in {outdir} ({why}); wrote it to {fallback} instead", file=sys.stderr,
          flush=True)
    return summary_now(), fallback


def _write_files(data: RunData, summary_now: Callable[[], Summary], outdir: Path) -> None:
    """The report's files in ``outdir``; the plots are handed to the renderer first, so that it draws them while
    this process summarizes (``summary_now``) and writes requests.jsonl."""
    outdir.mkdir(parents=True, exist_ok=True)
    finish_plots = start_plots(data, outdir)  # drawn meanwhile by a background renderer, if there is one
    try:
        summary = summary_now()
        (outdir / "summary.json").write_text(dumps_summary(summary))
        write_requests(data.records, outdir / "requests.jsonl", data.sla, data.phases,
                       data.replicas.replica_of if data.replicas is not None else None)
    finally:
        plots = finish_plots()  # the renderer is done with this job either way
    (outdir / "report.md").write_text(render_markdown(summary, data, plots))
    if data.scenario is not None:  # what ran, loadable again (summary.json keeps the figures alone)
        (outdir / SCENARIO_FILE).write_text(scenario_yaml(data.scenario, data.origin))


def _why_unwritable(exc: OSError) -> str:
    if isinstance(exc, (FileExistsError, NotADirectoryError)):
        return "part of the path is a file, not a directory"
    return exc.strerror or str(exc)
