"""results/README.md's fine-tune dose-response section prints only intervals its committed rows give back.

Every interval in the section (``mean [lo, hi]``) must be one that ``studies/finetune_dose.py
--sweep-table results/finetune_dose`` prints now, recomputed from the committed per-question rows
(``results/finetune_dose/rows_<model>.csv``, the same function and seed the run used). No model is run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import INTERVAL, intervals, intervals_not_in, results_section, study_module

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## The fine-tune dose-response"


@pytest.fixture(scope="module")
def table() -> str:
    finetune_dose = study_module("finetune_dose")
    return finetune_dose.sweep_table(ROOT / "results" / "finetune_dose")


def test_every_interval_in_the_section_is_recomputed_from_the_rows(table):
    text = results_section(HEADING)
    assert table.count("every interval recomputed from rows_") == 2, "both points committed their rows"
    assert len(intervals(text)) > 50, "the section prints the sweep table"
    assert not intervals_not_in(text, table), (
        "rerun: .venv/bin/python studies/finetune_dose.py --sweep-table results/finetune_dose"
    )
    rows = [line for line in text.splitlines() if line.startswith("| ") and INTERVAL.search(line)]
    assert rows and not [line for line in rows if line not in table.splitlines()]


def test_an_altered_interval_fails(table):
    text = results_section(HEADING)
    found = [m.group(0) for m in INTERVAL.finditer(text)][5]
    bumped = found.replace("]", "1]", 1)  # one more digit on the upper bound: no longer printed
    assert intervals_not_in(text.replace(found, bumped, 1), table) == intervals(bumped)
