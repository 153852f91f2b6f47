"""Pre-registration enforced by code (kvlab.findings.design): a design committed before its run, rows after it.

The teeth are a scratch git repository: rows committed before their design, or in the same commit,
are caught; a design with uncommitted changes is refused before a run; the project's own committed
results that carry a design all pass.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from kvlab.errors import DesignError
from kvlab.findings.design import load_design, order_problem, preregistration_problems, register

ROOT = Path(__file__).resolve().parents[2]

DESIGN = """name = "needle"
primary = "exact match"
arms = ["naive", "rerotate", "reprefill"]
family = ["rerotate - naive", "reprefill - naive"]
n_questions = 60
n_caches = 20
"""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.org")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "README").write_text("x\n")
    _git(tmp_path, "add", "README")
    _git(tmp_path, "commit", "-qm", "start")
    return tmp_path


def _commit(repo: Path, message: str, **files: str) -> None:
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        _git(repo, "add", name)
    _git(repo, "commit", "-qm", message)


def _rows(record: dict) -> str:
    return json.dumps({"design": record, "rows": [1, 2]})


def test_a_design_committed_before_its_rows_passes(repo):
    _commit(repo, "design", **{"designs/needle.toml": DESIGN})
    record = register(repo / "designs" / "needle.toml", repo)
    _commit(repo, "rows", **{"results/needle.json": _rows(record)})
    assert preregistration_problems(repo) == []


def test_rows_committed_before_their_design_or_with_it_are_caught(repo):
    # Rows first: a design made to fit them, committed afterwards.
    _commit(repo, "rows", **{"results/early.json": "{}"})
    _commit(repo, "design", **{"designs/needle.toml": DESIGN})
    record = register(repo / "designs" / "needle.toml", repo)
    _commit(repo, "rows carry it", **{"results/early.json": _rows(record)})
    assert "does not come after its design's commit" in order_problem(repo, record, "results/early.json")
    # Design and rows in one commit: the rows' record names that commit as the design's.
    _commit(repo, "design and rows together", **{"designs/same.toml": DESIGN, "results/same.json": "{}"})
    same = {"path": "designs/same.toml", "commit": _git(repo, "rev-parse", "HEAD"),
            "sha256": hashlib.sha256(DESIGN.encode()).hexdigest()}  # fmt: skip
    _commit(repo, "rows name it", **{"results/same.json": _rows(same)})
    problems = preregistration_problems(repo)
    assert len(problems) == 2 and all("does not come after" in p for p in problems), problems


def test_a_design_edited_after_its_commit_is_refused_before_the_run_and_caught_after(repo):
    _commit(repo, "design", **{"designs/needle.toml": DESIGN})
    path = repo / "designs" / "needle.toml"
    path.write_text(DESIGN.replace("n_questions = 60", "n_questions = 40"))
    with pytest.raises(DesignError, match="uncommitted changes"):
        register(path, repo)
    # A result naming a file other than the committed one is caught.
    _git(repo, "checkout", "-q", "--", "designs/needle.toml")
    good = register(path, repo)
    _commit(repo, "rows", **{"results/needle.json": _rows({**good, "sha256": "0" * 64})})
    assert "is not the file the result names" in preregistration_problems(repo)[0]


@pytest.mark.parametrize(
    "text, words",
    [
        (DESIGN.replace('primary = "exact match"\n', ""), "says nothing of primary"),
        (DESIGN.replace('"reprefill - naive"', '"recompute - naive"'), "is not 'arm - arm'"),
        (DESIGN.replace("n_caches = 20", "n_caches = 0"), "n_caches must be a positive integer"),
        (DESIGN.replace("n_caches = 20", "n_caches = 20\nn_sets = 2.5"), "n_sets must be a positive integer"),
        (
            DESIGN.replace('"reprefill - naive"', '"reprefill - naive: truth NLL"'),
            "names an outcome not in its outcomes",
        ),
    ],
)
def test_an_incomplete_design_is_refused_by_name(tmp_path, text, words):
    (tmp_path / "d.toml").write_text(text)
    with pytest.raises(DesignError, match=words):
        load_design(tmp_path / "d.toml")


def test_a_comparison_may_name_one_of_the_designs_outcomes(tmp_path):
    text = DESIGN.replace('"reprefill - naive"', '"reprefill - naive: truth NLL"') + 'outcomes = ["truth NLL"]\n'
    (tmp_path / "d.toml").write_text(text)
    assert load_design(tmp_path / "d.toml")["family"][1] == "reprefill - naive: truth NLL"


def test_the_projects_designs_are_complete():
    designs = sorted((ROOT / "studies" / "designs").glob("*.toml"))
    assert designs, "studies/designs/ holds no design"
    for path in designs:
        load_design(path)


def test_an_untracked_design_is_refused(repo):
    (repo / "new.toml").write_text(DESIGN)
    with pytest.raises(DesignError, match="uncommitted changes \\(or is untracked\\)"):
        register(repo / "new.toml", repo)


def test_every_committed_result_that_carries_a_design_came_after_it():
    assert preregistration_problems(ROOT) == []


def test_a_design_study_refuses_an_uncommitted_design_before_it_loads_a_model(repo):
    from kvlab.lab.study import run_design_study

    (repo / "new.toml").write_text(DESIGN)
    with pytest.raises(DesignError, match="uncommitted changes"):
        run_design_study("s.py", repo / "new.toml", repo, repo, "no-such-model", lambda m, d, j: [])
    assert not (repo / "rows_no-such-model.csv").exists()
