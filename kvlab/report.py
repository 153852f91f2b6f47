"""``kvlab report``: execute the notebooks with papermill into a folder of reports.

Each notebook's last output line that starts with ``Finding:`` becomes its line on the
index page. Unknown notebooks and undeclared parameters are refused before anything runs.
"""
from __future__ import annotations

import html
import json
import time
from pathlib import Path

from .errors import KvlabError

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"


class ReportError(KvlabError):
    """A report was asked for something that does not exist."""


def notebooks(folder: Path = NOTEBOOK_DIR) -> dict[str, Path]:
    """Short name (``01_phase_error``) -> path, in order."""
    return {p.stem: p for p in sorted(folder.glob("[0-9][0-9]_*.ipynb"))}


def _coerce(value: str):
    # Parameters come from the command line as text; read numbers, lists and booleans as
    # JSON so `-p n_fragments 4` is an int, and keep anything else as a string.
    try:
        return json.loads(value)
    except ValueError:
        return value


def plan(only: list[str] | None, params: dict[str, str], model: str | None) -> list[tuple[str, Path, dict]]:
    """Check names and parameters against the notebooks; return what would run."""
    import papermill as pm

    available = notebooks()
    names = only or list(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ReportError(f"unknown notebook(s) {', '.join(unknown)}; available: {', '.join(available)}")
    given = {k: _coerce(v) for k, v in params.items()}
    if model is not None:
        from .sources import looks_like_path

        # Notebooks run with notebooks/ as working directory: a relative path must not change meaning there.
        given["model_name"] = str(Path(model).expanduser().resolve()) if looks_like_path(model) else model
    out = []
    for name in names:
        declared = pm.inspect_notebook(str(available[name]))
        extra = sorted(set(given) - set(declared))
        if extra:
            raise ReportError(f"notebook {name} does not declare parameter(s) {', '.join(extra)}; it declares: {', '.join(declared)}")
        out.append((name, available[name], dict(given)))
    return out


def finding(nb_path: Path) -> str:
    """The last ``Finding:`` line a run notebook printed."""
    import nbformat

    lines = []
    for cell in nbformat.read(nb_path, as_version=4).cells:
        for o in cell.get("outputs", []):
            text = o.get("text") or o.get("data", {}).get("text/plain", "")
            lines += [l for l in text.splitlines() if l.startswith("Finding:")]
    return lines[-1][len("Finding:"):].strip() if lines else "(no finding printed)"


def run_report(out: Path, only: list[str] | None = None, params: dict[str, str] | None = None, model: str | None = None,
               progress: bool = True) -> Path:
    """Execute the chosen notebooks into ``out`` (ipynb + HTML) and write ``out/index.html``."""
    import papermill as pm
    from nbconvert import HTMLExporter

    jobs = plan(only, params or {}, model)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, src, given in jobs:
        dst = out / f"{name}.ipynb"
        t0 = time.perf_counter()
        # Run with the notebook folder as working directory, as JupyterLab does.
        pm.execute_notebook(str(src), str(dst), parameters=given, progress_bar=progress, cwd=str(src.parent),
                            kernel_name="python3")
        seconds = time.perf_counter() - t0
        body, _ = HTMLExporter().from_filename(str(dst))
        (out / f"{name}.html").write_text(body)
        rows.append((name, finding(dst), seconds))
    items = "\n".join(
        f"<li><a href='{n}.html'>{n}</a> (<a href='{n}.ipynb'>ipynb</a>, {s:.0f} s): {html.escape(f)}</li>" for n, f, s in rows
    )
    (out / "index.html").write_text(f"<!doctype html><meta charset='utf-8'><title>kvlab report</title>"
                                    f"<h1>kvlab report</h1><ul>\n{items}\n</ul>\n")
    for n, f, s in rows:
        print(f"{n} ({s:.0f} s): {f}")
    return out / "index.html"
