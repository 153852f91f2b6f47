"""results/README.md's needle section is recomputed from the committed pilot and run rows (studies/needle.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import bump_last_interval, intervals, intervals_not_in, results_section, section_problems, study_module
from kvlab.findings.design import load_design
from kvlab.findings.needle_table import BAND, arms
from kvlab.findings.rows import read_rows

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Needles with room to fail"
RESULTS = ROOT / "results" / "needle"


@pytest.fixture(scope="module")
def needle():
    return study_module("needle")


@pytest.fixture(scope="module")
def section(needle) -> str:
    return needle.section(RESULTS)


def test_every_interval_and_table_row_in_the_section_is_recomputed(section):
    assert len(intervals(results_section(HEADING))) > 60, "the section prints its tables"
    assert section_problems(HEADING, section) == ([], []), "rerun: .venv/bin/python studies/needle.py --section"


def test_an_altered_number_fails(section):
    altered, _ = bump_last_interval(HEADING)
    assert intervals_not_in(altered, section)


def test_the_pilot_is_labelled_and_reads_no_haystack_of_the_run(needle):
    design = load_design(needle.DESIGN)
    run = set(range(design["n_sets"]))
    for rnd in needle.PILOT:
        for m in design["models"]:
            doc = json.loads((RESULTS / f"pilot{rnd}_{m}.json").read_text())
            assert doc["pilot"] is True and doc["round"] == rnd and "design" not in doc
            assert not run & set(doc["haystacks"])
            rows = read_rows(RESULTS / f"pilot{rnd}_{m}.csv", text=needle.TEXT)
            assert {r["set"] for r in rows} == set(doc["haystacks"])


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_the_run_reads_its_design_and_says_whether_its_reference_is_in_the_band(needle, model):
    design = load_design(needle.DESIGN)
    doc = json.loads((RESULTS / f"rows_{model}.json").read_text())
    assert doc["design"]["path"] == "studies/designs/needle.toml"
    rows = read_rows(RESULTS / f"rows_{model}.csv", text=needle.TEXT)
    assert {r["set"] for r in rows} == set(range(design["n_sets"]))
    assert {r["strategy"] for r in rows} == set(design["arms"])
    assert len({(r["set"], r["cache"]) for r in rows}) == design["n_caches"]
    assert len([r for r in rows if r["strategy"] == "reprefill"]) == design["n_questions"]
    ref = next(a for a in arms(rows, design) if a["arm"] == "reprefill")["em"]
    inside = BAND[0] <= ref.mean <= BAND[1]
    said = next(c for c in needle.conclusions(rows, model, design) if "band" in c)
    assert ("inside" if inside else "outside") in said


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_the_sides_run_pairs_each_needle_across_the_two_sides(needle, model):
    design = load_design(needle.SIDES)
    doc = json.loads((RESULTS / "sides" / f"rows_{model}.json").read_text())
    assert doc["design"]["path"] == "studies/designs/needle_sides.toml"
    rows = read_rows(RESULTS / "sides" / f"rows_{model}.csv", text=needle.TEXT)
    assert len(rows) == design["n_caches"] and {r["set"] for r in rows} == set(range(design["n_sets"]))
    for h in range(design["n_sets"]):
        before, after = (next(r for r in rows if r["set"] == h and r["strategy"] == s) for s in ("before", "after"))
        # the same needle, town, value and form on both sides; only the distractors' side moves
        assert (before["question"], before["truth"], before["template"]) == (
            after["question"],
            after["truth"],
            after["template"],
        )
        assert (
            before["distractors"] == after["distractors"] and before["needle_fragment"] == after["needle_fragment"] == 1
        )
