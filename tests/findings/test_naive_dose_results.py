"""results/README.md's naive-dose section prints only intervals its committed outputs give back.

Every interval in the section (``mean [lo, hi]``) must be one that ``studies/naive_dose.py --sweep-table
results/naive_dose`` prints now: the count axis's recomputed from the committed per-question rows
(``results/naive_dose/rows_<model>.csv``, the same function and seed the table used), the length axis's
(the first design's run, which committed no rows) read from its points' records. No model is run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import INTERVAL, intervals, intervals_not_in, results_section, study_module

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## The dose-response of a naive merge"


@pytest.fixture(scope="module")
def table() -> str:
    naive_dose = study_module("naive_dose")
    return naive_dose.sweep_table(ROOT / "results" / "naive_dose")


def test_every_interval_in_the_section_is_recomputed(table):
    text = results_section(HEADING)
    assert len(intervals(text)) > 100, "the section prints the sweep table"
    assert not intervals_not_in(text, table), (
        "rerun: .venv/bin/python studies/naive_dose.py --sweep-table results/naive_dose"
    )
    # Every table row of the section is the sweep table's, character for character.
    rows = [line for line in text.splitlines() if line.startswith("| ") and INTERVAL.search(line)]
    assert rows and not [line for line in rows if line not in table.splitlines()]


def test_an_altered_number_fails(table):
    text = results_section(HEADING)
    for found in intervals(text):
        digit = re.search(r"(\d)(?= \[)", found)
        bumped = found[: digit.start()] + str((int(digit.group(1)) + 1) % 10) + found[digit.end() :]
        if intervals(bumped)[0] not in intervals(table):
            break
    altered = text.replace(found, bumped, 1)
    assert intervals_not_in(altered, table) == intervals(bumped)
