"""Run a checked study on Dask: plan (resume), submit, collect, summarise.

By default the points run on a ``dask.distributed.LocalCluster`` started in this process:
worker processes with one thread each (a notebook kernel is single-process work; threads
would only contend for the GIL and the model cache), ``n_workers`` = min(cores, memory /
``WORKER_MEMORY``, points). ``scheduler=ADDRESS`` (or a scheduler JSON file) runs the same
points on an existing cluster; its workers must see the output folder and the notebook
at the same paths (one machine, or a shared filesystem) and have kvlab installed.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.metadata as md
import logging
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from kvlab.sweep.point import RECORD_FORMAT, point_record, read_json, run_point, write_json
from kvlab.sweep.study import Study, load_study
from kvlab.sweep.summary import write_summary

#: Memory limit per local worker. The worker itself stays small (it loads each model once
#: for its digest, 0.6 GB for SmolLM2 in fp32); the notebook kernel it starts is a child
#: process whose memory this limit does not cover, so the worker count leaves room for it.
WORKER_MEMORY = 2 * 2**30
KERNEL_MEMORY = 2 * 2**30
REPO = Path(__file__).resolve().parents[2]


@dataclass
class SweepResult:
    study: Study
    out: Path
    records: list[dict] = field(default_factory=list)
    ran: int = 0
    skipped: int = 0

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.records if r["status"] != "ok"]


def _notebook_digest(path: Path) -> str:
    # The code of a notebook is its cells' sources; its stored outputs change on every run.
    import nbformat

    nb = nbformat.read(path, as_version=4)
    h = hashlib.sha256(b"kvlab-notebook-code-v1\n")
    for c in nb.cells:
        h.update(f"{c.cell_type}\n{len(c.source)}\n{c.source}\n".encode())
    return h.hexdigest()


def _kvlab_digest() -> str:
    # Uncommitted edits to kvlab change results without changing the commit.
    h = hashlib.sha256(b"kvlab-source-v1\n")
    pkg = REPO / "kvlab"
    for p in sorted(pkg.rglob("*.py")):
        h.update(f"{p.relative_to(pkg)}\n".encode() + p.read_bytes())
    return h.hexdigest()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def code_identity(notebook: Path) -> dict:
    """What a point's results depend on besides its parameters (resume compares all of it)."""
    try:
        version = md.version("kvlab")
    except md.PackageNotFoundError:
        version = None
    return {
        "kvlab_version": version,
        "git_commit": _git_commit(),
        "kvlab_sha256": _kvlab_digest(),
        "notebook_sha256": _notebook_digest(notebook),
    }


def point_folder(out: Path, point) -> Path:
    return out / "points" / point.folder_name


def plan(study: Study, out: Path, force: bool = False) -> tuple[list[dict], list[dict]]:
    """(tasks to run, records to keep): a point whose ok record has the same parameters and code is kept."""
    code = code_identity(study.notebook)
    default_model = study.declared.get("model_name", {}).get("default")
    if isinstance(default_model, str):
        try:
            default_model = ast.literal_eval(default_model)
        except (ValueError, SyntaxError):
            default_model = None
    todo, done = [], []
    run_id = uuid.uuid4().hex
    for p in study.points:
        folder = point_folder(out, p)
        old = read_json(folder / "record.json")
        if (
            not force
            and old is not None
            and old.get("format") == RECORD_FORMAT
            and old.get("status") == "ok"
            and old.get("parameters") == p.parameters
            and old.get("repeat") == p.repeat
            and old.get("code") == code
        ):
            done.append(old)
            continue
        todo.append(
            {
                "point": p.folder_name,
                "run_id": run_id,
                "index": p.index,
                "folder": str(folder.resolve()),
                "notebook": str(study.notebook),
                "parameters": p.parameters,
                "repeat": p.repeat,
                "timeout": study.timeout,
                "code": code,
                "default_model": default_model,
            }
        )
    return todo, done


def local_workers(requested: int | None, n_points: int) -> int:
    """Workers for a LocalCluster: as asked, else as many as cores and memory allow."""
    if requested is not None:
        return max(1, requested)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    by_memory = int(psutil.virtual_memory().available // (WORKER_MEMORY + KERNEL_MEMORY))
    return max(1, min(cores, by_memory, n_points))


@contextlib.contextmanager
def _client(scheduler: str | None, workers: int | None, n_points: int):
    import dask
    from distributed import Client, LocalCluster

    if scheduler:
        kw = (
            {"scheduler_file": scheduler}
            if scheduler.endswith(".json") and Path(scheduler).is_file()
            else {"address": scheduler}
        )
        with Client(timeout=30, **kw) as client:
            yield client
        return
    # A point that kills its worker is failed once, not retried on three more workers.
    with dask.config.set({"distributed.scheduler.allowed-failures": 0, "distributed.admin.tick.limit": "60s"}):
        with (
            LocalCluster(
                n_workers=local_workers(workers, n_points),
                threads_per_worker=1,
                processes=True,
                memory_limit=WORKER_MEMORY,
                dashboard_address=None,
                silence_logs=logging.ERROR,
            ) as cluster,
            Client(cluster) as client,
        ):
            yield client


def _quiet_dask_logs() -> None:
    for name in (
        "distributed",
        "distributed.worker",
        "distributed.scheduler",
        "distributed.nanny",
        "distributed.core",
        "distributed.comm",
        "distributed.client",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_study(
    study: Study,
    *,
    scheduler: str | None = None,
    workers: int | None = None,
    force: bool = False,
    progress: bool | None = None,
) -> SweepResult:
    """Run every point of ``study`` that has no current record; write results.csv and index.html."""
    from tqdm.auto import tqdm

    out = study.output
    out.mkdir(parents=True, exist_ok=True)
    todo, done = plan(study, out, force)
    result = SweepResult(study=study, out=out, records=list(done), skipped=len(done))
    write_json(
        out / "study.json",
        {
            "study": str(study.path),
            "notebook": str(study.notebook),
            "axes": study.axes,
            "points": [{"point": p.folder_name, "parameters": p.parameters, "repeat": p.repeat} for p in study.points],
        },
    )
    if todo:
        _quiet_dask_logs()
        from distributed import as_completed
        from distributed.comm import CommClosedError
        from distributed.scheduler import KilledWorker

        show = sys.stderr.isatty() if progress is None else progress
        bar = tqdm(total=len(study.points), initial=len(done), desc="points", unit="pt", disable=not show)
        with _client(scheduler, workers, len(todo)) as client:
            futures = {
                client.submit(run_point, t, key=f"kvlab-point-{t['point']}-{t['run_id'][:8]}", pure=False): t
                for t in todo
            }
            try:
                for fut in as_completed(futures):
                    task = futures[fut]
                    try:
                        rec = fut.result()
                    except Exception as e:  # noqa: BLE001  the point is failed, the others go on
                        lost = isinstance(e, (KilledWorker, CommClosedError, OSError))
                        why = "worker lost" if lost else "the point's runner raised"
                        rec = point_record(task, "failed", f"{why}: {type(e).__name__}: {e}")
                        write_json(Path(task["folder"]) / "record.json", rec)
                    # Let the scheduler forget the result: a worker that dies later must not
                    # make Dask recompute a point that is already on disk.
                    fut.release()
                    result.records.append(rec)
                    result.ran += 1
                    bar.update(1)
                    if rec["status"] != "ok" and show:
                        bar.write(f"failed: {rec['point']}: {rec['error']}", file=sys.stderr)
            except KeyboardInterrupt:
                client.cancel(list(futures))
                raise
            finally:
                bar.close()
    order = {p.folder_name: p.index for p in study.points}
    result.records.sort(key=lambda r: order.get(r["point"], 1 << 30))
    write_summary(study, out, result.records)
    return result


def sweep(path, *, output=None, timeout=None, scheduler=None, workers=None, force=False, progress=None) -> SweepResult:
    """Check and run the study file at ``path``: :func:`kvlab.sweep.study.load_study`, then :func:`run_study`."""
    return run_study(
        load_study(path, output=output, timeout=timeout),
        scheduler=scheduler,
        workers=workers,
        force=force,
        progress=progress,
    )
