"""Committed per-question rows: read back as written, and a stopped run keeps only whole sets."""

from __future__ import annotations

import pytest

from kvlab.findings.rows import read_rows, run_sets, write_rows


def test_rows_read_back_to_the_same_values(tmp_path):
    rows = [
        {"set": 0, "kl": 0.1 + 0.2, "em": True, "answer": "1893"},
        {"set": 1, "kl": 1e-300, "em": False, "answer": "x"},
    ]
    back = read_rows(write_rows(tmp_path / "r.csv", rows), text=("answer",))
    assert back == rows  # repr-written floats read back to the same double; answers stay text


def test_a_stopped_run_keeps_the_sets_it_finished(tmp_path):
    path = tmp_path / "r.csv"

    def one_set(j):
        if j == 2:
            raise KeyboardInterrupt  # the run is stopped inside set 2
        return [{"set": j, "question": q} for q in range(3)]

    with pytest.raises(KeyboardInterrupt):
        run_sets(path, range(4), one_set)
    assert {r["set"] for r in read_rows(path)} == {0, 1} and len(read_rows(path)) == 6
    rows, walls = run_sets(path, [5, 6], lambda j: [{"set": j, "question": 0}])
    assert rows == read_rows(path) == [{"set": 5, "question": 0}, {"set": 6, "question": 0}] and len(walls) == 2
