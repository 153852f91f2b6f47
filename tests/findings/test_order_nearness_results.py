"""results/README.md's order-or-nearness section is recomputed from the committed rows (studies/order_nearness.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import bump_last_interval, intervals, intervals_not_in, results_section, section_problems, study_module
from kvlab.findings.design import load_design
from kvlab.findings.order_arm import LAYOUTS
from kvlab.findings.rows import read_rows

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Order or nearness"
RESULTS = ROOT / "results" / "order_nearness"


@pytest.fixture(scope="module")
def study():
    return study_module("order_nearness")


@pytest.fixture(scope="module")
def section(study) -> str:
    return study.section(RESULTS)


def test_every_interval_and_table_row_in_the_section_is_recomputed(section):
    assert len(intervals(results_section(HEADING))) > 30, "the section prints its tables"
    assert section_problems(HEADING, section) == ([], []), "rerun: .venv/bin/python studies/order_nearness.py --section"


def test_an_altered_number_fails(section):
    altered, _ = bump_last_interval(HEADING)
    assert intervals_not_in(altered, section)


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_the_rows_are_the_design_s_and_hold_p_at_one_offset_per_set(study, model):
    design = load_design(study.DESIGN)
    doc = json.loads((RESULTS / f"rows_{model}.json").read_text())
    assert doc["design"]["path"] == "studies/designs/order_nearness.toml"
    rows = read_rows(RESULTS / f"rows_{model}.csv", text=study.TEXT)
    assert {r["set"] for r in rows} == set(range(design["n_caches"]))
    assert {r["layout"] for r in rows} == set(LAYOUTS)
    for j in range(design["n_caches"]):
        assert len({r["p_offset"] for r in rows if r["set"] == j}) == 1
    for lay in LAYOUTS:
        assert len([r for r in rows if r["layout"] == lay and r["strategy"] == "reprefill"]) == design["n_questions"]
