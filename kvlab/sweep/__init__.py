"""``kvlab sweep``: run a notebook over a parameter grid on Dask, with findings recorded as data.

Modules: :mod:`kvlab.sweep.study` (read and check a study file, expand the grid),
:mod:`kvlab.sweep.point` (one point on a worker: papermill, HTML, record),
:mod:`kvlab.sweep.run` (plan, resume, submit, collect; :func:`kvlab.sweep.run.sweep` does it
all for a study file), :mod:`kvlab.sweep.summary` (results.csv, index.html). Every file is
written through :mod:`kvlab.atomic` (temporary + rename). Each name has one home, its module;
this package exports nothing.
"""
