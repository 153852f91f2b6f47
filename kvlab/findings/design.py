"""Pre-registration enforced by code: a study's design is a committed file, and its rows come after it.

A design (``studies/designs/NAME.toml``) names the study's arms, the family of paired comparisons
Holm-adjusts, the primary outcome and n (questions, caches) before anything is run.
:func:`register` is what a run calls first: it refuses a design file that git does not hold as
committed (untracked, or changed since its last commit) and returns the record a result carries
(``"design": {"path", "commit", "sha256"}``). :func:`preregistration_problems` is what the tests
call: every committed result that carries a design must have been added by a commit that has the
design's commit as a strict ancestor.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import tomllib
from pathlib import Path

from kvlab.errors import DesignError

#: What a design file must say before its run.
REQUIRED = ("name", "primary", "arms", "family", "n_questions", "n_caches")


def load_design(path) -> dict:
    """The design in ``path`` (TOML), checked: every key of :data:`REQUIRED`, comparisons naming its arms.

    A comparison is ``"arm_a - arm_b"`` (paired, per question, on the primary outcome) or
    ``"arm_a - arm_b: outcome"`` with ``outcome`` one of the design's ``outcomes``; ``family``
    lists them.

    Raises
    ------
    DesignError
        Naming the file and what is missing or wrong.
    """
    path = Path(path)
    try:
        design = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise DesignError(f"design {path}: cannot be read: {e}") from e
    missing = [k for k in REQUIRED if k not in design]
    if missing:
        raise DesignError(f"design {path}: says nothing of {', '.join(missing)} (a design names {', '.join(REQUIRED)})")
    arms = set(design["arms"])
    outcomes = set(design.get("outcomes", []))
    for comparison in design["family"]:
        pair, _, outcome = str(comparison).partition(":")
        parts = [p.strip() for p in pair.split(" - ")]
        if len(parts) != 2 or not set(parts) <= arms:
            raise DesignError(f"design {path}: comparison {comparison!r} is not 'arm - arm' of its arms {sorted(arms)}")
        if outcome and outcome.strip() not in outcomes:
            raise DesignError(
                f"design {path}: comparison {comparison!r} names an outcome not in its outcomes {sorted(outcomes)}"
            )
    for k in ("n_questions", "n_caches", *(["n_sets"] if "n_sets" in design else [])):
        if not isinstance(design[k], int) or design[k] < 1:
            raise DesignError(f"design {path}: {k} must be a positive integer, got {design[k]!r}")
    return design


def _git(repo: Path, *args: str) -> str:
    got = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if got.returncode != 0:
        raise DesignError(f"git {' '.join(args)} in {repo}: {got.stderr.strip() or got.returncode}")
    return got.stdout.strip()


def register(path, repo) -> dict:
    """The record a result carries for the design ``path``, refusing a design git does not hold as committed.

    Returns
    -------
    dict
        ``{"path": path relative to repo, "commit": the last commit that changed it, "sha256": of its bytes}``.

    Raises
    ------
    DesignError
        The design is unreadable or incomplete (:func:`load_design`), untracked, or has uncommitted changes.
    """
    repo, path = Path(repo).resolve(), Path(path).resolve()
    load_design(path)
    rel = path.relative_to(repo).as_posix()
    if _git(repo, "status", "--porcelain", "--", rel):
        raise DesignError(f"design {rel} has uncommitted changes (or is untracked): commit it before its run")
    commit = _git(repo, "log", "-1", "--format=%H", "--", rel)
    if not commit:
        raise DesignError(f"design {rel} is in no commit: commit it before its run")
    return {"path": rel, "commit": commit, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def added_by(repo, rel: str) -> str | None:
    """The commit that first added ``rel`` (a path relative to ``repo``), or None if no commit holds it."""
    found = _git(Path(repo), "log", "--diff-filter=A", "--format=%H", "--", rel).splitlines()
    return found[-1] if found else None


def order_problem(repo, design: dict, rows: str) -> str | None:
    """Why ``rows`` (a committed result's path) breaks its design's pre-registration, or None.

    The design's commit must be a strict ancestor of the commit that added the rows, and the design
    file at that commit must be the one the result names (its sha256).
    """
    repo = Path(repo)
    added = added_by(repo, rows)
    if added is None:
        return f"{rows}: not committed"
    commit = design["commit"]
    ancestor = subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", commit, added]).returncode == 0
    if commit == added or not ancestor:
        return f"{rows}: added by {added[:10]}, which does not come after its design's commit {commit[:10]}"
    blob = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{design['path']}"], capture_output=True)
    if blob.returncode != 0 or hashlib.sha256(blob.stdout).hexdigest() != design["sha256"]:
        return f"{rows}: its design {design['path']} at {commit[:10]} is not the file the result names"
    return None


def preregistration_problems(repo, results="results") -> list[str]:
    """Every committed result under ``results`` (JSON) that carries a design and breaks its pre-registration."""
    repo = Path(repo)
    problems = []
    for path in sorted((repo / results).rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and isinstance(data.get("design"), dict):
            why = order_problem(repo, data["design"], path.relative_to(repo).as_posix())
            if why:
                problems.append(why)
    return problems
