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
