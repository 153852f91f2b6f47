"""results/README.md's recompute-curve section prints only intervals its committed rows give back.

Every interval in the section (``mean [lo, hi]``) must be one that ``studies/recompute_curve.py
--sweep-table results/recompute_curve`` prints now, recomputed from each point's committed rows
(``results/recompute_curve/rows_<model>_<policy>.csv``), r90 anchored at r*. No model is run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import INTERVAL, intervals, intervals_not_in, results_section, study_module
from kvlab.findings import curve

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## The recompute curve"


@pytest.fixture(scope="module")
def study():
    recompute_curve = study_module("recompute_curve")
    return recompute_curve


@pytest.fixture(scope="module")
def table(study) -> str:
    return study.sweep_table(ROOT / "results" / "recompute_curve")


def test_every_interval_in_the_section_is_recomputed_from_the_rows(table):
    text = results_section(HEADING)
    assert len(intervals(text)) > 60, "the section prints the sweep table"
    assert not intervals_not_in(text, table), (
        "rerun: .venv/bin/python studies/recompute_curve.py --sweep-table results/recompute_curve"
    )
    rows = [line for line in text.splitlines() if line.startswith("| ") and INTERVAL.search(line)]
    assert rows and not [line for line in rows if line not in table.splitlines()]


def test_every_point_committed_rows_and_r90_lies_below_its_r_star(study):
    from kvlab.findings import strata
    from kvlab.sweep.point import read_points

    folder = ROOT / "results" / "recompute_curve"
    points = [p for p in read_points(folder) if p["status"] == "ok"]
    assert len(points) == 6
    for p in points:
        par = p["parameters"]
        rows = strata.read_rows(study.point_rows_path(folder, par["model_name"], par["policy"]))
        r90 = curve.r90(rows, par["policy"], par["ratios"], 0)
        assert 0 < r90["lo"] <= r90["mean"] <= r90["hi"] <= r90["r_star_max"] < 1


def test_an_altered_interval_fails(table):
    text = results_section(HEADING)
    found = [m.group(0) for m in INTERVAL.finditer(text)][3]
    bumped = found.replace("]", "1]", 1)
    assert intervals_not_in(text.replace(found, bumped, 1), table) == intervals(bumped)


def test_r90_lies_in_the_segment_it_names():
    # The curve through (0, 0), the measured points and (r*, 1): the crossing and its segment agree.
    ratios, end = (0.1, 0.5, 0.6), 0.74
    assert curve.bracket(ratios, (0.2, 0.95, 0.99), end=end) == (0.1, 0.5)
    assert curve.bracket(ratios, (0.2, 0.5, 0.8), end=end) == (0.6, None)
    assert curve.bracket(ratios, (0.95, 0.97, 0.99), end=end) == (0.0, 0.1)
    for shares in ((0.2, 0.95, 0.99), (0.2, 0.5, 0.8), (0.95, 0.97, 0.99), (0.3, 0.89, 0.9)):
        lo, hi = curve.bracket(ratios, shares, end=end)
        assert lo <= curve.crossing(ratios, shares, end=end) <= (end if hi is None else hi)
