"""results/SUMMARY.md is what kvlab.findings.summary prints from the committed rows."""

from __future__ import annotations

from pathlib import Path

from kvlab.findings import summary

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_summary_is_what_the_rows_give():
    page = summary.render(ROOT / "results")
    assert (ROOT / "results" / "SUMMARY.md").read_text() == page, "run .venv/bin/python studies/summary.py"
    # Each finding states its caches, questions and interval, and an action for a cache store.
    findings = [l for l in page.splitlines() if l[:3] in {f"{i}. " for i in range(1, 6)}]
    assert len(findings) == 5 and all("caches" in l and "questions" in l and "[" in l for l in findings)
    assert page.count("*For a cache store:*") == 5 and "## Open questions" in page and "SmolLM2 puzzle" in page


def test_the_findings_page_links_the_summary_first():
    head = (ROOT / "results" / "README.md").read_text()[:600]
    assert "[SUMMARY.md](SUMMARY.md)" in head


def test_the_offset_or_order_line_says_what_the_dose_rows_show():
    from kvlab.findings.longctx import pairs
    from kvlab.findings.strata import read_rows
    from kvlab.measure.stats import paired_diff_ci

    rows = read_rows(ROOT / "results" / "naive_dose" / "rows_smollm2-135m.csv")

    def diff(where):
        x, y, labels = pairs(rows, "naive", "rerotate", "span_kl", {"relative": where}, ("set",))
        return paired_diff_ci(x, y, clusters=labels, seed=0)

    # The line's words, typed once: early passages naive closer, late and last rerotate closer.
    assert diff("first").hi < 0 and diff("early").hi < 0
    assert diff("late").lo > 0 and diff("last").lo > 0
