"""``kvlab report``: execute the notebooks with papermill into a folder of reports.

The index page records what produced the run (model and its weights digest, kvlab version
and commit, library versions, CPU, date, wall time) and, per notebook, its question, its
finding (the last output line starting ``Finding:``), its key figure (the first PNG it
drew) as a thumbnail, its run time and whether its assertions held. A notebook that fails
is shown with its error and the others still run; the caller gets the failures at the end.
Unknown notebooks and undeclared parameters are refused before anything runs.
"""

from __future__ import annotations

import base64
import datetime
import functools
import io
import json
import multiprocessing
import os
import platform
import re
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import mistune
from markupsafe import Markup

from kvlab.atomic import atomic_path, atomic_write_text
from kvlab.errors import ReportError
from kvlab.lab.kernel import kernel_name, quiet_kernel_manager
from kvlab.lab.pages import render
from kvlab.lab.provenance import cpu_name, model_digest, versions
from kvlab.models.sources import looks_like_path

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
#: Width in pixels of the figure thumbnails on the index page.
THUMB_WIDTH = 360


@dataclass
class NotebookRun:
    """One executed notebook of a report."""

    name: str
    seconds: float
    question: str
    finding: str
    error: str | None = None  # "ename: evalue" when the notebook failed
    thumbnail: str | None = None  # file name next to the index

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def question_html(self) -> Markup:
        """The question's markdown as inline HTML (code spans, emphasis, links); any raw HTML escaped."""
        return Markup(_inline_markdown()(self.question).strip().removeprefix("<p>").removesuffix("</p>"))


@functools.cache
def _inline_markdown():
    # nbconvert renders the notebooks' own markdown with mistune; the index uses the same parser.
    return mistune.create_markdown(escape=True)


@dataclass
class Report:
    """What ``run_report`` wrote: the index page, the run's metadata and each notebook's result."""

    index: Path
    meta: dict
    runs: list[NotebookRun] = field(default_factory=list)

    @property
    def failed(self) -> list[NotebookRun]:
        return [r for r in self.runs if not r.ok]


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
        # Notebooks run with notebooks/ as working directory: a relative path must not change meaning there.
        given["model_name"] = str(Path(model).expanduser().resolve()) if looks_like_path(model) else model
    out = []
    for name in names:
        declared = pm.inspect_notebook(str(available[name]))
        extra = sorted(set(given) - set(declared))
        if extra:
            raise ReportError(
                f"notebook {name} does not declare parameter(s) {', '.join(extra)}; it declares: {', '.join(declared)}"
            )
        out.append((name, available[name], dict(given)))
    return out


def cell_texts(cell) -> list[str]:
    """A cell's printed text: each run of stream outputs of one name joined, then every ``text/plain`` result.

    A kernel sends one ``print`` as several stream messages when its output is flushed between
    writes (a loaded machine does this), so a line can arrive split across outputs; joined, it
    reads as printed.
    """
    texts, stream, name = [], [], None
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream" and o.get("name") == name:
            stream.append(o.get("text", ""))
            continue
        if stream:
            texts.append("".join(stream))
        stream, name = [], None
        if o.get("output_type") == "stream":
            stream, name = [o.get("text", "")], o.get("name")
        elif o.get("data", {}).get("text/plain"):
            texts.append(o["data"]["text/plain"])
    if stream:
        texts.append("".join(stream))
    return texts


def finding(nb_path: Path) -> str:
    """The last ``Finding:`` line a run notebook printed."""
    import nbformat

    lines = []
    for cell in nbformat.read(nb_path, as_version=4).cells:
        for text in cell_texts(cell):
            lines += [l for l in text.splitlines() if l.startswith("Finding:")]
    return lines[-1][len("Finding:") :].strip() if lines else "(no finding printed)"


def question(nb_path: Path) -> str:
    """The notebook's question: the ``**Question.**`` paragraph of its first markdown cell, as markdown.

    The label is dropped and the lines joined; code spans, emphasis and links stay for
    :attr:`NotebookRun.question_html` to render.
    """
    import nbformat

    cells = [c for c in nbformat.read(nb_path, as_version=4).cells if c.cell_type == "markdown"]
    if not cells:
        return "(no question stated)"
    paragraphs = re.split(r"\n\s*\n", cells[0].source)
    text = next((p for p in paragraphs if "Question" in p), paragraphs[0])
    text = re.sub(r"\*\*Question\.?\*\*\s*", "", text)
    return " ".join(text.split())


def key_figure(nb_path: Path) -> bytes | None:
    """The first ``image/png`` output of a run notebook (its key figure), or None."""
    import nbformat

    for cell in nbformat.read(nb_path, as_version=4).cells:
        for o in cell.get("outputs", []):
            png = o.get("data", {}).get("image/png")
            if png:
                return base64.b64decode(png if isinstance(png, str) else "".join(png))
    return None


def thumbnail(png: bytes, path: Path, width: int = THUMB_WIDTH) -> None:
    """Write a ``width``-pixel-wide copy of a PNG to ``path`` (atomically)."""
    from PIL import Image

    img = Image.open(io.BytesIO(png))
    img.thumbnail((width, width * 4))
    with atomic_path(path) as tmp:
        img.save(tmp, format="PNG", optimize=True)


def _git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=10", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return head + (" (with uncommitted changes)" if dirty else "")


def run_metadata(models: list[str]) -> dict:
    """Who and what produced a report: models with their weights digests, versions, commit, CPU, date."""
    digests = {}
    for m in models:
        digest, error = model_digest(m)
        digests[m] = digest[:16] if digest else f"unavailable ({error})"
    v = versions()
    return {
        "models": digests,
        "kvlab": f"{v['kvlab']}, commit {_git_commit()}",
        "torch": v["torch"],
        "transformers": v["transformers"],
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _export_html(nb_path: Path, dst: Path, no_input: bool) -> None:
    from nbconvert import HTMLExporter

    # exclude_input drops code cells' source; markdown, outputs and figures stay.
    exporter = HTMLExporter(exclude_input=no_input, exclude_input_prompt=no_input, exclude_output_prompt=no_input)
    body, _ = exporter.from_filename(str(nb_path))
    atomic_write_text(dst, body, mode=0o644)


def default_jobs(n_notebooks: int) -> int:
    """Notebooks run at once by default: one per CPU core, at most one per notebook."""
    return max(1, min(n_notebooks, os.cpu_count() or 1))


def _expected_seconds(src: Path) -> float:
    """How long the committed run of a notebook took (papermill's record), for the run order."""
    import nbformat

    try:
        return float(nbformat.read(src, as_version=4).metadata.get("papermill", {}).get("duration") or 0.0)
    except (OSError, ValueError, TypeError):
        return 0.0


def _kernel_env(threads: int) -> None:
    """In a worker process: the environment its kernels inherit when notebooks share the cores."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    # Two kernels' spinning OpenMP threads would hold the cores each other needs (docs/testing.md).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _execute(src: Path, dst: Path, given: dict, kernel: str) -> tuple[str | None, float]:
    """Run one notebook with papermill; ``(error or None, seconds)``. Never raises."""
    import papermill as pm

    t0 = time.perf_counter()
    error = None
    try:
        # Run with the notebook folder as working directory, as JupyterLab does.
        pm.execute_notebook(
            str(src),
            str(dst),
            parameters=given,
            progress_bar=False,
            cwd=str(src.parent),
            kernel_name=kernel,
            kernel_manager_class=quiet_kernel_manager(),
        )
    except pm.PapermillExecutionError as e:
        error = f"{e.ename}: {e.evalue}"
    except Exception as e:  # noqa: BLE001  a dead kernel fails this notebook, not the report
        error = f"{type(e).__name__}: {e}"
    return error, time.perf_counter() - t0


def _finish(name: str, src: Path, out: Path, error: str | None, seconds: float, no_input: bool) -> NotebookRun:
    """A run's record, its thumbnail and its HTML page, from what the run left in ``out``."""
    dst = out / f"{name}.ipynb"
    run = NotebookRun(name, seconds, question(src), "(not run)", error)
    if dst.exists():
        run.finding = finding(dst)
        if error and run.finding == "(no finding printed)":
            run.finding = "(none: the notebook stopped before printing it)"
        png = key_figure(dst)
        if png is not None:
            run.thumbnail = f"{name}.thumb.png"
            thumbnail(png, out / run.thumbnail)
        _export_html(dst, out / f"{name}.html", no_input)
    return run


def _run_one(name: str, src: Path, given: dict, out: Path, kernel: str, no_input: bool) -> NotebookRun:
    """Execute one notebook into ``out`` and write its page: in a worker, so pages overlap other runs."""
    error, seconds = _execute(src, out / f"{name}.ipynb", given, kernel)
    return _finish(name, src, out, error, seconds, no_input)


def _run_all(
    jobs: list[tuple[str, Path, dict]], out: Path, kernel: str, n_jobs: int, bar, no_input: bool
) -> dict[str, NotebookRun]:
    """Execute every notebook and write its page, ``n_jobs`` at a time: name -> its run."""
    done: dict[str, NotebookRun] = {}
    if n_jobs == 1:
        for name, src, given in jobs:
            bar.set_postfix_str(name)
            done[name] = _run_one(name, src, given, out, kernel, no_input)
            bar.update()
        return done
    # The longest first (by their committed runs), so that no long notebook starts last.
    order = sorted(jobs, key=lambda j: -_expected_seconds(j[1]))
    threads = max(1, (os.cpu_count() or 1) // n_jobs)
    # Each kernel gets its share of the cores; a worker process keeps that setting out of the caller's environment.
    with ProcessPoolExecutor(
        n_jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_kernel_env, initargs=(threads,)
    ) as pool:
        futures = {
            pool.submit(_run_one, name, src, given, out, kernel, no_input): (name, src) for name, src, given in order
        }
        for f in as_completed(futures):
            name, src = futures[f]
            try:
                done[name] = f.result()
            except BrokenProcessPool as e:  # the worker died: record what its notebook left behind
                done[name] = _finish(name, src, out, f"BrokenProcessPool: {e}", 0.0, no_input)
            bar.set_postfix_str(name)
            bar.update()
    return done


def run_report(
    out: Path,
    only: list[str] | None = None,
    params: dict[str, str] | None = None,
    model: str | None = None,
    progress: bool = True,
    no_input: bool = False,
    jobs: int | None = None,
) -> Report:
    """Execute the chosen notebooks into ``out`` (ipynb + HTML + thumbnails) and write ``out/index.html``.

    A notebook that raises is recorded as failed (its error on the index) and the rest
    still run; ``Report.failed`` lists them. ``no_input`` writes the HTML without code.
    ``progress`` shows a bar over the notebooks, on a terminal only. ``jobs`` notebooks run
    at once (default :func:`default_jobs`: one per core), each kernel on
    ``cpu_count // jobs`` torch threads; ``jobs=1`` runs them one after another in the
    caller's environment.
    """
    import papermill as pm
    from tqdm.auto import tqdm

    plan_ = plan(only, params or {}, model)
    if jobs is not None and jobs < 1:
        raise ReportError(f"jobs must be at least 1, got {jobs}")
    kernel = kernel_name()  # refuse before writing anything when the kernel is missing
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    models = sorted(
        {
            str(g.get("model_name", pm.inspect_notebook(str(src))["model_name"]["default"]).strip("\"'"))
            for _, src, g in plan_
        }
    )
    n_jobs = min(jobs or default_jobs(len(plan_)), len(plan_))
    bar = tqdm(total=len(plan_), desc="kvlab report", unit="notebook", disable=not (progress and sys.stderr.isatty()))
    with bar:
        done = _run_all(plan_, out, kernel, n_jobs, bar, no_input)
    runs = [done[name] for name, _, _ in plan_]
    meta = run_metadata(models)
    meta["wall time"] = f"{time.perf_counter() - t_start:.0f} s"
    meta["notebooks at once"] = str(n_jobs)
    index = out / "index.html"
    atomic_write_text(index, index_page(meta, runs, no_input), mode=0o644)
    for r in runs:
        print(f"{'PASS' if r.ok else 'FAIL'} {r.name} ({r.seconds:.0f} s): {r.finding if r.ok else r.error}")
    return Report(index, meta, runs)


_CSS = """
body{font:15px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{margin-bottom:.2em} .sub{color:#555;margin-top:0}
table.meta{border-collapse:collapse;margin:1em 0 2em} table.meta td{padding:.15em 1em .15em 0;vertical-align:top}
table.meta td:first-child{color:#555}
.nb{display:grid;grid-template-columns:1fr 380px;gap:1em;border:1px solid #ddd;border-left:6px solid;
    border-radius:6px;padding:1em;margin:1em 0}
.nb.pass{border-left-color:#2a7d2e} .nb.fail{border-left-color:#c62828;background:#fff6f6}
.mark{font-weight:700;padding:.1em .5em;border-radius:4px;color:#fff;margin-right:.5em}
.pass .mark{background:#2a7d2e} .fail .mark{background:#c62828}
.nb h2{margin:0 0 .4em;font-size:1.15em} .nb p{margin:.3em 0} .label{color:#555;font-weight:600}
.nb img{width:100%;border:1px solid #eee} pre.err{white-space:pre-wrap;background:#fdecea;padding:.5em;margin:.3em 0}
.time{color:#555;font-size:.9em}
"""


def index_page(meta: dict, runs: list[NotebookRun], no_input: bool = False) -> str:
    """The report's index page (HTML) from its metadata and notebook runs."""
    n_fail = sum(not r.ok for r in runs)
    summary = (
        f"{len(runs) - n_fail} of {len(runs)} notebooks passed"
        + (f", {n_fail} failed" if n_fail else "")
        + (" · code hidden (--no-input)" if no_input else "")
    )
    rest = {k: str(v) for k, v in meta.items() if k != "models"}
    return render("report_index.html", css=_CSS, summary=summary, models=meta["models"], meta=rest, runs=runs)
