"""The quantised K-shift section prints its tables from the committed run, and says what its pairs show.

No model is run: ``results/quantised_kshift.json`` (every probe's KL per comparison) is read back,
the section is compared with what ``studies/quantised_kshift.py --markdown`` prints from it, and
the words on the paired table are checked against the families it prints.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from conftest import study_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def study():
    return study_module("quantised_kshift")


@pytest.fixture(scope="module")
def rows():
    return json.loads((ROOT / "results" / "quantised_kshift.json").read_text())["rows"]


def test_both_tables_are_printed_from_the_committed_run(study, rows):
    page = (ROOT / "results" / "README.md").read_text()
    for table in (study.markdown(rows), study.paired_markdown(rows)):
        assert table in page, "regenerate: .venv/bin/python studies/quantised_kshift.py --markdown"
    assert len(study.measured(rows)) == 12 and all(r["n"] == 8 for r in study.measured(rows))


def test_the_pairs_are_probe_by_probe_and_a_changed_probe_changes_the_table(study, rows):
    printed = study.paired_markdown(rows)
    changed = copy.deepcopy(rows)
    cell = next(r for r in changed if r["model"] == "gemma3-270m" and r["tokens"] == 512 and r["type_k"] == "q8_0")
    cell["k_shift"]["kls"][0] += 0.01
    assert study.paired_markdown(changed) != printed


def test_the_words_on_the_paired_table_hold(study, rows):
    def resolved(key, k):
        return [(f["model"], f["tokens"]) for f in study.family(rows, key) if f["type_k"] == k and f["p_holm"] <= 0.05]

    # "q8_0 ... resolved in one cell of four (Gemma 3 at 2 x 512, in both columns)"
    assert resolved("k_shift", "q8_0") == resolved("shift_joined", "q8_0") == [("gemma3-270m", 512)]
    # "q4_0's excess in the K-shift's own error is resolved in every cell; ... in two of four"
    assert len(resolved("k_shift", "q4_0")) == 4 and len(resolved("shift_joined", "q4_0")) == 2
    assert all(f["ci"].mean > 0 for f in study.family(rows, "k_shift") if f["p_holm"] <= 0.05)
