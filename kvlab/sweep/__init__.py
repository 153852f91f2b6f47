"""``kvlab sweep``: run a notebook over a parameter grid on Dask, with findings recorded as data.

Modules: :mod:`.study` (read and check a study file, expand the grid), :mod:`.point`
(one point on a worker: papermill, HTML, record),
:mod:`.run` (plan, resume, submit, collect), :mod:`.summary` (results.csv, index.html),
:mod:`.files` (temp + rename writes).
"""

from kvlab.errors import StudyError
from kvlab.sweep.run import SweepResult, run_study
from kvlab.sweep.study import Point, Study, load_study


def sweep(path, *, output=None, timeout=None, scheduler=None, workers=None, force=False, progress=None) -> SweepResult:
    """Check and run the study file at ``path``; see :func:`kvlab.sweep.run.run_study`."""
    return run_study(
        load_study(path, output=output, timeout=timeout),
        scheduler=scheduler,
        workers=workers,
        force=force,
        progress=progress,
    )


__all__ = ["Point", "Study", "StudyError", "SweepResult", "load_study", "run_study", "sweep"]
