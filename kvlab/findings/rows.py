"""A study's per-question rows as committed CSV: written whole or not at all, read back typed.

Every study commits one row per question and strategy (or reader), with the id of the cache it
was read behind, so anyone can recompute an interval from ``results/`` without running a model.
Floats are written as Python's ``repr``, which reads back to the same double, so an interval
recomputed from the file is the interval the study printed, digit for digit.
"""

from __future__ import annotations

import csv
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from kvlab.atomic import atomic_path


def typed(value: str):
    """A CSV cell back as the bool, int or float it was written from (else the string)."""
    if value in ("True", "False"):
        return value == "True"
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def write_rows(path: str | Path, rows: list[dict]) -> Path:
    """Write ``rows`` (dicts with the same keys, in order) to the CSV ``path``, atomically."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    with atomic_path(Path(path)) as tmp, open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return Path(path)


def point_rows_path(folder: str | Path, *key) -> Path:
    """Where a sweep point commits its rows: ``<folder>/rows_<key>_<key>...csv`` (model, then the grid's values)."""
    return Path(folder) / ("rows_" + "_".join(map(str, key)) + ".csv")


def write_point_rows(rows: list[dict], folder: str | Path, *key) -> Path:
    """A sweep point's per-question rows, at :func:`point_rows_path` (written whole, or not at all)."""
    path = point_rows_path(folder, *key)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_rows(path, rows)


def read_rows(path: str | Path, text: Iterable[str] = ()) -> list[dict]:
    """The rows of a study's per-question CSV, typed back; columns in ``text`` stay strings (an answer "1893")."""
    keep = set(text)
    with open(path, newline="") as fh:
        return [{k: v if k in keep else typed(v) for k, v in r.items()} for r in csv.DictReader(fh)]


def run_sets(
    path: str | Path, sets: Iterable[int], one_set: Callable[[int], list[dict]]
) -> tuple[list[dict], list[float]]:
    """A study's run over independent sets: ``(rows, wall seconds per set)``.

    ``one_set(j)`` returns set ``j``'s rows. ``path`` is rewritten whole after every set, so a run
    stopped midway keeps the sets it finished and none half-done; each set's wall time goes to
    stderr as it ends.
    """
    rows, walls = [], []
    for j in sets:
        t0 = time.perf_counter()
        rows += one_set(j)
        write_rows(path, rows)
        walls.append(round(time.perf_counter() - t0, 1))
        print(f"set {j}: {walls[-1]:.0f} s", file=sys.stderr, flush=True)
    return rows, walls
