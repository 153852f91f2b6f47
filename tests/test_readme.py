"""The README is executable: every command it shows runs, and its result tables match a run.

Commands come from the README itself (its ```bash blocks), so a command added there is
run here without anyone editing this file. ``make`` lines are checked against the
Makefile's targets; ``make test`` is CI's own entry point, and the ``kvlab`` commands
that ``make report`` runs are listed in the README and run here.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
KVLAB = [sys.executable, "-m", "kvlab.cli"]


def _fenced() -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced block, in order (an opening fence names its language)."""
    blocks, lang, body = [], None, []
    for line in README.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(body) + "\n"))
                lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, "README ends inside a fenced block"
    return blocks


def _blocks(lang: str) -> list[str]:
    return [text for block_lang, text in _fenced() if block_lang == lang]


def readme_commands() -> list[str]:
    """Every shell command line of the README's ```bash blocks (comments stripped)."""
    out = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


KVLAB_COMMANDS = [c for c in readme_commands() if re.match(r"(\.venv/bin/)?kvlab ", c)]
MAKE_COMMANDS = [c for c in readme_commands() if c.startswith("make ")]


def test_readme_shows_commands_and_every_line_is_one_we_run():
    assert KVLAB_COMMANDS and "make report" in MAKE_COMMANDS and "make test" in MAKE_COMMANDS
    other = [c for c in readme_commands() if c not in KVLAB_COMMANDS + MAKE_COMMANDS]
    # Anything else a reader is told to type must be runnable here too; list it explicitly.
    allowed = re.compile(r"^(pip install |conda env create |\.venv/bin/python |KVLAB_CACHE=|dask (scheduler|worker) )")
    assert all(allowed.match(c) for c in other), other


def test_make_targets_in_the_readme_exist():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    for cmd in MAKE_COMMANDS:
        assert cmd.split()[1] in targets, cmd


def test_make_report_runs_the_readme_commands():
    # `make report` is `kvlab models --prepare` then `kvlab report --out reports`; both are
    # README commands run by test_readme_kvlab_command.
    dry = subprocess.run(
        ["make", "-n", "-W", ".venv/.kvlab-setup", "report"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    recipe = [l.replace(".venv/bin/", "") for l in dry.splitlines() if "kvlab " in l and "pip" not in l]
    shown = [c.replace(".venv/bin/", "") for c in KVLAB_COMMANDS]
    assert recipe and all(r in shown for r in recipe), (recipe, shown)


@pytest.mark.real
@pytest.mark.parametrize("command", KVLAB_COMMANDS)
def test_readme_kvlab_command(command, tmp_path):
    argv = shlex.split(command)[1:]
    if "--out" in argv:  # write reports into the test's own folder, not the checkout
        argv[argv.index("--out") + 1] = str(tmp_path / "reports")
    elif argv[0] == "report":  # the default is ./reports: keep the checkout clean
        argv += ["--out", str(tmp_path / "reports")]
    if argv[0] == "report" and "--only" not in argv:
        # A report of every notebook runs each one once more; nbval already runs every notebook
        # (and test_every_notebook_runs_on_gemma3 on Gemma 3), so here the command runs as written
        # on its first notebook: what is tested is the command, not the notebooks again.
        argv += ["--only", "00_memos_defects"]
    run = subprocess.run(KVLAB + argv, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, f"{command}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    if argv[0] == "report":
        index = (tmp_path / "reports" / "index.html").read_text()
        assert "(no finding printed)" not in index


# -- the README's result tables against a run --------------------------------------------------


def _readme_table(first_header_cell: str) -> list[list[str]]:
    lines = README.splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip().startswith(f"| {first_header_cell} |"))
    rows = []
    for l in lines[start + 2 :]:
        if not l.strip().startswith("|"):
            break
        rows.append([c.strip() for c in l.strip().strip("|").split("|")])
    return rows


def test_readme_mismatch_table_matches_notebook_03():
    # nbval guards notebook 03's stored outputs against a fresh run; this ties the README to them.
    nb = nbformat.read(ROOT / "notebooks" / "03_fingerprint_kl.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    stored = {}
    for line in text.splitlines():
        # A row of the per-reader table: reader, n, mean KL [CI], max KL, flips [CI], columns
        # separated by two or more spaces.
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] in {"bf16", "fp16", "int8", "finetune"} and len(cells) == 5 and cells[1].isdigit():
            stored[cells[0]] = cells
    rows = _readme_table("reader")
    assert {r[0] for r in rows} == set(stored) and stored
    for r in rows:
        assert r == stored[r[0]], (r, stored[r[0]])


@pytest.mark.real
def test_readme_check_output_matches_a_run():
    block = next(b for b in _blocks("") if b.lstrip().startswith("$ kvlab check"))
    shown = {
        l.split()[0]: l.split()
        for l in block.splitlines()[1:]
        if l.split() and l.split()[0] in {"naive", "fail", "reprefill", "rerotate", "recompute"}
    }
    run = subprocess.run(KVLAB + ["check", "--json"], cwd=ROOT, capture_output=True, text=True, check=True)
    rows = {r["strategy"]: r for r in json.loads(run.stdout)}
    assert set(shown) == set(rows)
    for name, r in rows.items():
        words = shown[name]
        if "refused" in r:
            assert words[1] == "refused:" and " ".join(words[2:]).rstrip(".").rstrip() in r["refused"]
            continue
        # Every column but the last (wall time, which varies from run to run).
        want = [
            f"{r['max_k_phase']:.3e}",
            f"{r['max_v_phase']:.3e}",
            str(r["seq_len"]),
            f"{r['kl_mean']:.4f}",
            f"{r['kl_max']:.4f}",
            r["top1_agree"],
        ]
        assert words[1:7] == want, (name, words, want)
