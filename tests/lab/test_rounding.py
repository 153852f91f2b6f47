"""nbval's comparison of stored outputs: a printed decimal may differ in its last digit, nothing else may."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from kvlab.lab.rounding import same_but_last_digit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("ref", "test"),
    [
        ("KL 0.1785 [0.0540, 0.3173]", "KL 0.1785 [0.0540, 0.3174]"),
        ("rate 0.0999 of n=12", "rate 0.1000 of n=12"),  # the carry is one unit too
        ("change -0.001 nats", "change +0.000 nats"),
        ("same 0.25", "same 0.25"),
    ],
)
def test_one_unit_in_the_last_place_is_the_same_output(ref, test):
    assert same_but_last_digit(ref, test)


@pytest.mark.parametrize(
    ("ref", "test"),
    [
        ("KL 0.3173", "KL 0.3175"),  # two units
        ("born 1941", "born 1942"),  # an integer: a count, a year, a token id
        ("4/120 flips", "5/120 flips"),
        ("p 0.5", "p 0.50"),  # another precision is another output
        ("kvlab 1.2.3", "kvlab 1.2.4"),  # not a decimal
        ("1.5e-05", "1.6e-05"),  # e-notation is the sanitizer's (exponent only)
        ("KL 0.3173 nats", "KL 0.3174 bits"),
        ("a 0.1 b 0.2", "a 0.1 b"),
    ],
)
def test_any_other_difference_is_a_different_output(ref, test):
    assert not same_but_last_digit(ref, test)


def _notebook(path: Path, printed: str, stored: str) -> None:
    cell = nbformat.v4.new_code_cell(f"print({printed!r})", execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stored + "\n")]
    nb = nbformat.v4.new_notebook(cells=[cell])
    nb.metadata["kernelspec"] = {"name": "kvlab", "display_name": "Python (kvlab)", "language": "python"}
    nbformat.write(nb, path)


@pytest.mark.slow
def test_nbval_in_this_repository_compares_to_the_last_digit(tmp_path):
    for name, printed, passes in (("one_unit", "KL 0.3174", True), ("two_units", "KL 0.3175", False)):
        nb = tmp_path / f"{name}.ipynb"
        _notebook(nb, printed, "KL 0.3173")
        run = subprocess.run(
            # The notebook lies outside the repository, so its conftest.py is loaded by name.
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "--nbval", str(nb)],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert (run.returncode == 0) == passes, run.stdout[-2000:]
