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

from conftest import INTERVAL, intervals, study_module

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## The dose-response of a naive merge"


def section(heading: str = HEADING) -> str:
    """The part of results/README.md from ``heading`` to the next second-level heading."""
    page = (ROOT / "results" / "README.md").read_text()
    start = page.index(heading)
    end = page.find("\n## ", start + len(heading))
    return page[start : end if end > 0 else None]


@pytest.fixture(scope="module")
def table() -> str:
    naive_dose = study_module("naive_dose")
    return naive_dose.sweep_table(ROOT / "results" / "naive_dose")


def missing(text: str, table: str) -> list[str]:
    """The intervals of ``text`` that ``table`` does not print."""
    have = set(intervals(table))
    return [c for c in intervals(text) if c not in have]


def test_every_interval_in_the_section_is_recomputed(table):
    text = section()
    assert len(intervals(text)) > 100, "the section prints the sweep table"
    assert not missing(text, table), "rerun: .venv/bin/python studies/naive_dose.py --sweep-table results/naive_dose"
    # Every table row of the section is the sweep table's, character for character.
    rows = [line for line in text.splitlines() if line.startswith("| ") and INTERVAL.search(line)]
    assert rows and not [line for line in rows if line not in table.splitlines()]


def test_an_altered_number_fails(table):
    text = section()
    for found in intervals(text):
        digit = re.search(r"(\d)(?= \[)", found)
        bumped = found[: digit.start()] + str((int(digit.group(1)) + 1) % 10) + found[digit.end() :]
        if intervals(bumped)[0] not in intervals(table):
            break
    altered = text.replace(found, bumped, 1)
    assert missing(altered, table) == intervals(bumped)
