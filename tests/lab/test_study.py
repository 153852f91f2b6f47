"""A set study's command line and run record (kvlab.lab.study), as the scripts in studies/ use them."""

from __future__ import annotations

import json

import pytest

from kvlab.findings.rows import read_rows
from kvlab.lab.study import run_set_study, set_study_parser


def _one_set(model, j):
    return [{"set": j, "question": q, "model": model.name} for q in range(2)]


def test_a_run_writes_its_rows_and_its_record(tmp_path):
    args = set_study_parser("Doc.\n\nMore.", tmp_path, sets="haystacks", tokens=64).parse_args(
        ["--model", "tiny-llama", "--haystacks", "3"]
    )
    assert (args.sets, args.tokens, args.first_set, args.out) == (3, 64, 0, tmp_path)
    rows, model = run_set_study(
        "studies/x.py", tmp_path / "x_tiny-llama.csv", args, _one_set, sets="haystacks", counts=[2, 4]
    )
    assert model.name == "tiny-llama" and [r["set"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert read_rows(tmp_path / "x_tiny-llama.csv", text=("model",)) == rows
    record = json.loads((tmp_path / "x_tiny-llama.json").read_text())
    assert list(record)[:6] == ["model", "haystacks", "first_set", "tokens", "counts", "set_wall_s"]
    assert record["haystacks"] == 3 and record["counts"] == [2, 4] and len(record["set_wall_s"]) == 3
    assert {"command", "cpu", "wall_s"} <= set(record)


def test_a_split_run_writes_its_own_part(tmp_path):
    args = set_study_parser("Doc.", tmp_path).parse_args(["--model", "tiny-llama", "--sets", "2", "--first-set", "5"])
    rows, _ = run_set_study("studies/x.py", tmp_path / "x.csv", args, _one_set)
    assert {r["set"] for r in rows} == {5, 6}
    assert not (tmp_path / "x.csv").exists() and (tmp_path / "x.part5.csv").exists()
    assert json.loads((tmp_path / "x.part5.json").read_text())["first_set"] == 5


def test_a_study_that_cannot_be_split_offers_no_first_set(tmp_path, capsys):
    ap = set_study_parser("Doc.", tmp_path, split=False)
    with pytest.raises(SystemExit):
        ap.parse_args(["--first-set", "3"])
    args = ap.parse_args(["--model", "tiny-llama", "--sets", "2"])
    rows, _ = run_set_study("studies/x.py", tmp_path / "x.csv", args, lambda m, j: [] if j else [{"set": j}])
    assert rows == [{"set": 0}] and "first_set" not in json.loads((tmp_path / "x.json").read_text())
