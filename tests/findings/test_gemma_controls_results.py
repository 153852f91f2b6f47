"""results/README.md's Gemma 3 controls section prints what its committed rows give, and nothing else.

``studies/gemma_controls.py --markdown results/gemma_controls`` recomputes the section's tables and
measured lines from the per-question rows each sweep point committed
(``results/gemma_controls/rows_<model>_<tokens>.csv``), with the functions and seed the run used.
No model is run but for reading Gemma 3's config.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

import kvlab
from conftest import results_section, study_module

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "results" / "gemma_controls"
HEADING = "## Gemma 3 controls"


@pytest.fixture(scope="module")
def study():
    return study_module("gemma_controls")


def test_the_section_is_printed_from_the_committed_rows(study):
    printed = study.markdown(FOLDER)
    assert printed in results_section(HEADING), (
        "regenerate: .venv/bin/python studies/gemma_controls.py --markdown results/gemma_controls"
    )
    # Every point's table row is recomputed from its rows, none from a summary record.
    table = [line for line in printed.splitlines() if line.startswith("| ") and line.endswith(" |")]
    assert sum(line.endswith("| rows |") for line in table) == 4


def test_the_rows_hold_the_named_design(study):
    loaded = study.point_rows(FOLDER)
    assert [t for t, _, _ in loaded] == [200, 250, 270, 512]
    for _, _, rows in loaded:
        assert len({r["set"] for r in rows}) == 20
        per: dict[tuple, set] = {}
        for r in rows:
            per.setdefault((r["set"], r["question"]), set()).add(r["strategy"])
        assert {frozenset(s) for s in per.values()} == {frozenset(study.strategies())}
        assert len(per) == 120


def test_the_window_is_gemma_3s():
    model = kvlab.load_model("gemma3-270m")
    config = getattr(model.config, "text_config", model.config)
    assert config.sliding_window == study_module("gemma_controls").WINDOW


def test_one_changed_score_changes_the_section(study, tmp_path):
    # Teeth: the section follows the rows; a copy with one question's span KL raised prints otherwise.
    copy = tmp_path / "gemma_controls"
    shutil.copytree(FOLDER, copy, ignore=shutil.ignore_patterns("*.html", "*.png", "*.ipynb"))
    path = copy / "rows_gemma3-270m_512.csv"
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    at = next(r for r in rows if r["strategy"] == "naive")
    at["span_kl"] = str(float(at["span_kl"]) + 0.5)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert study.markdown(copy) not in results_section(HEADING)


def test_a_point_without_rows_is_refused(study, tmp_path):
    copy = tmp_path / "gemma_controls"
    shutil.copytree(FOLDER, copy, ignore=shutil.ignore_patterns("*.html", "*.png", "*.ipynb"))
    (copy / "rows_gemma3-270m_250.csv").unlink()
    with pytest.raises(kvlab.KvlabError, match="250 tokens committed no rows"):
        study.markdown(copy)
