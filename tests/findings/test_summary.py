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


def test_the_order_line_quotes_the_order_arm_s_family_recomputed_from_its_rows():
    from kvlab.findings import order_table
    from kvlab.findings.design import load_design
    from kvlab.findings.rows import read_rows
    from kvlab.measure.stats import fmt_ci

    design = load_design(ROOT / "studies" / "designs" / "order_nearness.toml")
    line = next(l for l in (ROOT / "results" / "SUMMARY.md").read_text().splitlines() if "The order arm" in l)
    for m in ("smollm2-135m", "gemma3-270m"):
        rows = read_rows(ROOT / "results" / "order_nearness" / f"rows_{m}.csv", text=summary.TEXT)
        for label in design["family"]:
            first, second = (s.strip() for s in label.split(" - "))
            ci, _ = order_table.contrast(rows, first, second)
            assert f"{fmt_ci(ci, '+.3f')} on {summary.SHORT[m]}" in line
        # teeth: swap naive and rerotate in one layout and the quoted order interval is no longer the rows'
        swapped = [
            r | {"strategy": {"naive": "rerotate", "rerotate": "naive"}.get(r["strategy"], r["strategy"])}
            if r["layout"] == "first"
            else r
            for r in rows
        ]
        ci, _ = order_table.contrast(swapped, "first", "last+filler")
        assert f"{fmt_ci(ci, '+.3f')} on {summary.SHORT[m]}" not in line
    said = order_table.findings(rows, design)
    assert ("order and nearness both move it" in line) == (said["order"] and said["nearness"])
