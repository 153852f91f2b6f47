"""One grid point on a Dask worker: run the notebook with papermill, then write its record.

The record (``record.json`` in the point's folder) holds the point's parameters, the
notebook's ``kvlab.findings.records.record`` findings, the code identity (kvlab version, git commit,
notebook digest), the model's weights digest, torch and transformers versions, wall
time, status and error. It is written last, by the worker, so a point with a record is
a finished point; the sweep's client writes one only for a point whose worker died.

Model digest: after the notebook, the worker loads the point's ``model_name`` itself and
takes ``kvlab.fingerprint(model, weights=True)['weights_sha256']``, once per worker
process and model (the digest is memoised, the model dropped). That is the same loader
and model cache the notebook's kernel used, costs one model load per worker (about 7 s
for SmolLM2, milliseconds for tiny models; the weights hash itself is cached next to the
converted model), and needs nothing from the notebook.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import warnings
from pathlib import Path

import psutil

from kvlab.atomic import atomic_path, atomic_write_text
from kvlab.findings.records import read_records, rounded
from kvlab.lab.kernel import kernel_name, quiet_kernel_manager
from kvlab.lab.provenance import model_digest, versions

RECORD_FORMAT = "kvlab-sweep-point-v1"


def write_json(path, obj) -> Path:
    """Write ``obj`` as JSON atomically (a rerun after a killed worker sees the old file or the new one)."""
    return atomic_write_text(Path(path), json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n")


def read_json(path) -> dict | None:
    """A JSON file's object, or None when it is missing or unreadable (then the point is redone)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_points(out) -> list[dict]:
    """Every point record (``points/*/record.json``) of a sweep output folder ``out``, in folder-name order.

    What a study's own table script reads after ``kvlab sweep``; an unreadable record is left out.
    """
    recs = (read_json(p) for p in sorted(Path(out).glob("points/*/record.json")))
    return [r for r in recs if r is not None]


def _error_text(e: BaseException) -> str:
    # papermill's PapermillExecutionError carries the notebook's own exception; show that.
    ename, evalue = getattr(e, "ename", None), getattr(e, "evalue", None)
    return f"{ename}: {evalue}" if ename else f"{type(e).__name__}: {e}"


def _kill_kernel(km) -> None:
    """SIGKILL a kernel and its children; nbclient then raises DeadKernelError in the executing thread."""
    pid = getattr(getattr(km, "provisioner", None), "pid", None)
    if pid is None:
        return
    try:
        proc = psutil.Process(pid)
        procs = proc.children(recursive=True) + [proc]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


class _NoNotebook(Exception):
    """The kernel never started, so papermill wrote nothing: the point keeps no notebook."""


def execute(task: dict, folder: Path) -> tuple[str, str | None]:
    """Run the notebook with papermill into ``folder/notebook.ipynb`` (+ ``.html``); return (status, error).

    The kernel is a child of this process, started in a session of its own; it exits by
    itself when this process dies (jupyter_client's parent poller). ``task['timeout']``
    bounds the whole notebook: when it passes, the kernel is killed and the point fails.
    """
    import papermill as pm

    started: list = []

    class TrackedKernelManager(quiet_kernel_manager()):
        # The one way to reach the kernel papermill starts: nbclient builds it from this class.
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            started.append(self)

        async def start_kernel(self, **kw):
            # The kernel's own stderr (start-up warnings, a crash's last words) goes to a file
            # of the point, not into the worker's log.
            kw.setdefault("stderr", stderr)
            return await super().start_kernel(**kw)

    timed_out = threading.Event()

    def on_timeout():
        timed_out.set()
        for km in started:
            _kill_kernel(km)

    timer = threading.Timer(task["timeout"], on_timeout) if task.get("timeout") else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    status, error = "ok", None
    kept = False
    # papermill writes the notebook as far as it ran, failures included; keep it either way.
    with contextlib.suppress(_NoNotebook), atomic_path(folder / "notebook.ipynb") as tmp:
        with open(folder / "kernel-stderr.txt", "w") as stderr:
            try:
                # papermill warns of an output name without ".ipynb": the notebook is written under kvlab's
                # temporary name (".notebook.ipynb.<pid>.<hex>.tmp") and renamed once complete. Filtered here,
                # around the call, since a filter set at import is lost to any caller that resets the filters
                # (pytest does, per test).
                with warnings.catch_warnings():
                    warnings.filterwarnings(
                        "ignore", r"The specified file \(.*\.tmp\) does not end in one of", UserWarning
                    )
                    pm.execute_notebook(
                        task["notebook"],
                        str(tmp),
                        parameters=task["parameters"],
                        kernel_name=kernel_name(),
                        cwd=str(Path(task["notebook"]).parent),
                        progress_bar=False,
                        log_output=False,
                        kernel_manager_class=TrackedKernelManager,
                    )
            except Exception as e:  # noqa: BLE001  every failure of the notebook is the point's result
                status, error = "failed", _error_text(e)
            finally:
                if timer is not None:
                    timer.cancel()
        if not tmp.stat().st_size:
            raise _NoNotebook  # the kernel never started: nothing to keep
        kept = True
    if timed_out.is_set():
        status, error = "failed", f"timed out after {task['timeout']:g} s (kernel killed)"
    if kept:
        try:
            from nbconvert import HTMLExporter

            body, _ = HTMLExporter().from_filename(str(folder / "notebook.ipynb"))
            atomic_write_text(folder / "notebook.html", body)
        except Exception as e:  # noqa: BLE001  a report that cannot render still has its notebook
            error = (error + "; " if error else "") + f"HTML export failed: {_error_text(e)}"
    return status, error


def _json_ready(records: list[dict]) -> list[dict]:
    return [
        dict(r, **{k: rounded(r[k]) if isinstance(r[k], float) else r[k] for k in ("value", "ci_low", "ci_high")})
        for r in records
    ]


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):  # called outside a Dask worker
        return f"{os.uname().nodename} pid {os.getpid()}"


def point_record(
    task: dict,
    status: str,
    error: str | None,
    *,
    records: list[dict] | None = None,
    model_weights_sha256: str | None = None,
    model_digest_error: str | None = "not computed: the point did not finish",
    started: str | None = None,
    wall_s: float | None = None,
    worker: str | None = None,
) -> dict:
    """A point's record: what ``task`` (as built by the sweep) asked for, and how it went.

    The worker fills in everything after its run; the sweep's client, for a point whose worker
    died, gives only the status and error (no records, digest, start, wall time or worker).
    """
    return {
        "format": RECORD_FORMAT,
        "point": task["point"],
        "run_id": task["run_id"],
        "parameters": task["parameters"],
        "repeat": task["repeat"],
        "code": task["code"],
        "notebook": task["notebook"],
        "records": [] if records is None else records,
        "model_name": task["parameters"].get("model_name", task.get("default_model")),
        "model_weights_sha256": model_weights_sha256,
        "model_digest_error": model_digest_error,
        "versions": versions(),
        "started": started,
        "wall_s": wall_s,
        "status": status,
        "error": error,
        "worker": worker,
    }


def run_point(task: dict) -> dict:
    """Execute one point (``task`` as built by the sweep) and return the record it wrote."""
    # papermill logs a killed kernel as an error; the point's record carries it instead.
    logging.getLogger("papermill").setLevel(logging.CRITICAL)
    folder = Path(task["folder"])
    folder.mkdir(parents=True, exist_ok=True)
    old = read_json(folder / "record.json")
    if old is not None and old.get("run_id") == task["run_id"] and old.get("parameters") == task["parameters"]:
        # Dask recomputes a finished task whose result was lost with its worker; this sweep
        # already has the point, so hand back its record instead of running it again.
        return old
    # A rerun replaces the outputs; until its record is written, the point counts as not done.
    (folder / "record.json").unlink(missing_ok=True)
    t0 = time.perf_counter()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status, error = execute(task, folder)
    wall = time.perf_counter() - t0
    records, nb = [], folder / "notebook.ipynb"
    if nb.exists():
        try:
            records = _json_ready(read_records(nb))
        except Exception as e:  # noqa: BLE001
            status, error = "failed", f"cannot read the records: {e}"
    if status == "ok" and not records:
        status, error = "failed", "the notebook ran but recorded nothing (no kvlab.findings.records.record output)"
    digest, digest_error = model_digest(task["parameters"].get("model_name", task.get("default_model")))
    rec = point_record(
        task,
        status,
        error,
        records=records,
        model_weights_sha256=digest,
        model_digest_error=digest_error,
        started=started,
        wall_s=round(wall, 3),
        worker=_worker_address(),
    )
    write_json(folder / "record.json", rec)
    return rec
