"""``-o OUTDIR`` never scatters a report into a folder of other files (``-o examples`` once put 9 report files
into the source tree): every command that writes a report folder refuses a non-empty one holding no earlier kvemu
output unless ``--force``, as ``kvemu sweep`` does (``claim_outdir``)."""

import pytest

from harness.report.files import REPORT_FILES, OutputError, claim_outdir
from tests.harness.test_cli import TINY, kvemu

REFUSING = {
    "run": ["run", *TINY, "--quiet"],
    "loadgen": ["loadgen", "--router", "tcp://127.0.0.1:9", *TINY],
    "up": ["up", *TINY],
    "bench-router": ["bench-router", "--router", "kvemu", *TINY],
    "plan": ["plan", *TINY, "--sla", "e2e_ms=1000", "--max-workers", "1"],
}


def _foreign(folder):
    folder.mkdir()
    (folder / "notes.md").write_text("mine\n")
    return folder


@pytest.mark.parametrize("command", list(REFUSING))
def test_a_folder_of_other_files_is_refused_naming_force(tmp_path, command):
    src = _foreign(tmp_path / "src")
    proc = kvemu(*REFUSING[command], "-o", "src", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "src is not empty and holds no earlier kvemu report" in proc.stderr and "--force" in proc.stderr
    assert sorted(p.name for p in src.iterdir()) == ["notes.md"]  # nothing written, nothing started


def test_run_writes_over_its_earlier_report_and_into_a_foreign_folder_with_force(tmp_path):
    first = kvemu("run", *TINY, "--quiet", "-o", "rep", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (tmp_path / "rep" / "summary.json").write_text("{}")
    again = kvemu("run", *TINY, "--quiet", "-o", "rep", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert '"num_requests"' in (tmp_path / "rep" / "summary.json").read_text()  # written over, as before
    _foreign(tmp_path / "src")
    forced = kvemu("run", *TINY, "--quiet", "--force", "-o", "src", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert {"notes.md", "summary.json", "report.md"} <= {p.name for p in (tmp_path / "src").iterdir()}


@pytest.mark.parametrize("marker", sorted(REPORT_FILES))
def test_claim_takes_an_empty_or_absent_folder_an_earlier_report_and_anything_with_force(tmp_path, marker):
    assert claim_outdir(tmp_path / "new" / "deep").is_dir()
    earlier = _foreign(tmp_path / "earlier")
    (earlier / marker).write_text("{}")
    assert claim_outdir(earlier) == earlier  # up's, loadgen's, bench-router's or plan's earlier output
    foreign = _foreign(tmp_path / "foreign")
    with pytest.raises(OutputError, match="--force"):
        claim_outdir(foreign)
    assert claim_outdir(foreign, force=True) == foreign
