"""results/README.md's recompute-mask section prints only what the committed rows give back.

Every table line and interval of the section must be one that ``studies/recompute_mask.py --table
smollm2-135m gemma3-270m`` prints now, recomputed from ``results/recompute_mask_<model>.csv``
(one row per question and strategy, with its set). No model is run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import INTERVAL, intervals, intervals_not_in, results_section, study_module

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## The recompute-mask defect"
MODELS = ("smollm2-135m", "gemma3-270m")


@pytest.fixture(scope="module")
def study():
    return study_module("recompute_mask")


@pytest.fixture(scope="module")
def table(study) -> str:
    return study.markdown(list(MODELS))


def test_the_section_is_the_table_the_rows_give(table):
    text = results_section(HEADING)
    lines = [line for line in text.splitlines() if line.startswith(("| ", "- ")) and INTERVAL.search(line)]
    assert len(lines) == len(table.splitlines()) - 3, "rerun: .venv/bin/python studies/recompute_mask.py --table " + (
        " ".join(MODELS)
    )
    assert not [line for line in lines if line not in table.splitlines()]
    assert not intervals_not_in(text, table)


def test_the_rows_are_the_design_the_section_states(study):
    from kvlab.findings import strata

    for model in MODELS:
        rows = strata.read_rows(study.rows_path(ROOT / "results", model))
        causal, defect = study.names(0.15)
        assert {r["strategy"] for r in rows} == {"rerotate", causal, defect, "reprefill"}
        assert {r["set"] for r in rows} == set(range(20)) and {r["n_fragments"] for r in rows} == {4}
        assert len(rows) == 4 * 120  # 6 questions per set, every strategy
        # The reference is the joined prefill itself: reprefill's KL is zero on every question.
        assert all(r["span_kl"] == 0 for r in rows if r["strategy"] == "reprefill")


def test_an_altered_interval_fails(table):
    text = results_section(HEADING)
    found = [m.group(0) for m in INTERVAL.finditer(text)][2]
    bumped = found.replace("]", "1]", 1)
    assert intervals_not_in(text.replace(found, bumped, 1), table) == intervals(bumped)
