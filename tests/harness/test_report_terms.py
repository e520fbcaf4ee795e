"""report.md defines every term it uses (and only those), and a table of nothing but zeros is one "(none)" line."""

from harness.report.markdown import GLOSSARY, render_markdown, table
from harness.report.run_data import RunData
from harness.report.summary import summarize

from tests.harness.test_report import sample_run


def _md(data: RunData) -> str:
    return render_markdown(summarize(data), data, ())


def _terms(md: str) -> list[str]:
    section = md.split("\n## Terms\n", 1)[1]
    return [line.split("**")[1] for line in section.splitlines() if line.startswith("- **")]


def test_every_latency_and_routing_term_the_report_uses_is_defined_at_its_end():
    md = _md(sample_run())
    terms = _terms(md)
    for term in ("TTFT", "TTST", "TPOT", "ITL", "E2E", "prefix cache reuse", "routing regret; lost, novel blocks",
                 "attempts, retried requests", "KV events"):
        assert term in terms, term
    reasons = md.split("Routing reasons: ", 1)[1].split("\n", 1)[0]
    for term in terms:
        if term.startswith("routing reason "):  # only the reasons this run's routing gave
            assert term.removeprefix("routing reason ") in reasons, term
    assert md.rstrip().endswith(next(m for t, _, m in GLOSSARY if t == terms[-1]))


def test_terms_the_report_does_not_use_are_not_defined():
    md = _md(sample_run())
    assert "goodput" not in md and "SLA, goodput" not in _terms(md)
    assert "`softmax`" not in md and "routing reason `softmax`" not in _terms(md)


def test_a_table_of_zeros_and_blanks_is_one_line_saying_none():
    assert table(["counter", "value"], [("hits", "0"), ("waits", "—"), ("share", "0.0%"), ("wait", "0.00 ms")]) \
        == ["(none)"]
    assert table(["counter", "value"], [("hits", "0"), ("waits", "3")])[2:] == ["| hits | 0 |", "| waits | 3 |"]
    md = _md(RunData(scenario_name="idle", affinity={"binds": 0, "hits": 0}))
    assert "## Session affinity\n\n(none)\n" in md
    assert "## Headline\n\n(none)\n" in md  # nothing ran: no column of zeros
    assert "| binds |" not in md and "| requests compared" not in md
