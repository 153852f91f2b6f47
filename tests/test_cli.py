"""The ``kvlab`` command's own options."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvlab import cli

ROOT = Path(__file__).resolve().parents[1]


def test_version_prints_the_installed_version_with_no_command(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr()
    version = importlib.metadata.version("kvlab")
    assert (out.out, out.err) == (f"kvlab {version}\n", "")
    assert version == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_version_from_the_command_line():
    run = subprocess.run([sys.executable, "-m", "kvlab.cli", "--version"], capture_output=True, text=True)
    assert (run.returncode, run.stdout, run.stderr) == (0, f"kvlab {importlib.metadata.version('kvlab')}\n", "")


def test_no_command_is_still_an_error(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([])
    assert done.value.code == 2 and "the following arguments are required: command" in capsys.readouterr().err
