"""kvlab sweep overhead: what one grid point costs besides its own work, and a small grid's wall time.

Per-point overhead, each a papermill run of a generated notebook (kernel kvlab):
  kernel      start a kernel and run an empty cell
  + kvlab     ... and ``import kvlab`` (torch, transformers)
  + model     ... and ``kvlab.load_model(model_name)`` (tiny-llama, smollm2-135m)
Grid: tests/fixtures/sweep_fixture.ipynb on tiny-llama at offsets 4, 8, 16, 32 (4 points),
run by ``kvlab.sweep`` on a fresh LocalCluster with 1 and with 2 workers (cluster start included).

Usage (from the repository root): python -m benchmarks.sweep [--reps N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import nbformat
import papermill as pm

ROOT = Path(__file__).resolve().parents[1]


def _notebook(folder: Path, body: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "kvlab", "display_name": "Python (kvlab)", "language": "python"}
    params = nbformat.v4.new_code_cell('model_name = "tiny-llama"')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(body)]
    path = folder / f"nb{abs(hash(body))}.ipynb"
    nbformat.write(nb, path)
    return path


def _papermill(path: Path, **params) -> float:
    t0 = time.perf_counter()
    pm.execute_notebook(
        str(path),
        str(path.with_suffix(".out.ipynb")),
        parameters=params,
        kernel_name="kvlab",
        progress_bar=False,
        log_output=False,
        cwd=str(path.parent),
    )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    from kvlab.sweep.run import run_study
    from kvlab.sweep.study import load_study

    print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f} at start")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cases = [
            ("kernel", _notebook(tmp, "pass"), {}),
            ("kernel + import kvlab", _notebook(tmp, "import kvlab"), {}),
            (
                "+ load tiny-llama",
                _notebook(tmp, "import kvlab\nm = kvlab.load_model(model_name)"),
                {"model_name": "tiny-llama"},
            ),
            (
                "+ load smollm2-135m",
                _notebook(tmp, "import kvlab\nm = kvlab.load_model(model_name)"),
                {"model_name": "smollm2-135m"},
            ),
        ]
        print("per-point overhead (papermill run, s; median of reps):")
        for name, path, params in cases:
            times = [_papermill(path, **params) for _ in range(args.reps)]
            print(f"  {name:<24} {statistics.median(times):6.1f}   ({', '.join(f'{t:.1f}' for t in times)})")
        study = tmp / "grid.toml"
        study.write_text(
            f'notebook = "{ROOT / "tests/fixtures/sweep_fixture.ipynb"}"\n[grid]\noffset = [4, 8, 16, 32]\n'
        )
        print("grid of 4 points (fixture notebook, tiny-llama), cluster start included:")
        for workers in (1, 2):
            t0 = time.perf_counter()
            res = run_study(
                load_study(study, output=tmp / f"out{workers}"), workers=workers, force=True, progress=False
            )
            wall = time.perf_counter() - t0
            per = statistics.median(r["wall_s"] for r in res.records)
            print(f"  {workers} worker(s): {wall:6.1f} s wall, {len(res.failed)} failed, median point {per:.1f} s")
    print(f"load average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
