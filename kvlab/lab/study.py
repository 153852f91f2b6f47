"""A study script over independent sets: its command line, its run, and the run's record beside its rows.

The scripts in ``studies/`` that read one model over seeded sets (``haystack.py``,
``merge_puzzle.py``, ``attention_mass.py``) share one shape: a command line naming the model,
how many sets and how long a fragment; a run that writes the rows after every set
(:func:`kvlab.findings.rows.run_sets`); and a JSON record of the run beside the rows. Each
script keeps only what is its own: the rows of one set and the tables printed from them.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

from kvlab.atomic import atomic_write_text
from kvlab.findings.design import load_design, register
from kvlab.findings.rows import run_sets
from kvlab.lab import setup
from kvlab.lab.provenance import study_run
from kvlab.models.loaded import LoadedModel
from kvlab.models.sources import load_model


def set_study_parser(
    doc: str, results: Path, *, sets: str = "sets", tokens: int = 512, split: bool = True
) -> argparse.ArgumentParser:
    """The command line of a set study: ``--model``, ``--<sets>``, ``--tokens``, ``--seed``, ``--out``, ``--markdown``.

    Parameters
    ----------
    doc : str
        The script's docstring; its first paragraph is the help's description.
    results : Path
        The default ``--out`` folder.
    sets : str
        What one set is called on the command line (``"haystacks"``); the run reads that many.
    tokens : int
        The default ``--tokens`` (a fragment's budget).
    split : bool
        Offer ``--first-set`` to split a run across processes (each part writes ``<stem>.part<N>.csv``).
    """
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(f"--{sets}", type=int, default=20, dest="sets")
    if split:
        ap.add_argument(
            "--first-set", type=int, default=0, help=f"run {sets} first-set .. first-set + {sets} - 1 (to split a run)"
        )
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=results)
    ap.add_argument("--markdown", action="store_true", help="print the tables from the committed rows; no model")
    return ap


def run_set_study(
    script: str,
    path: Path,
    args: argparse.Namespace,
    one_set: Callable[[LoadedModel, int], list[dict]],
    *,
    sets: str = "sets",
    **meta,
) -> tuple[list[dict], LoadedModel]:
    """Run ``one_set(model, j)`` for each set ``args`` names, writing rows to ``path`` and the run's record beside it.

    Seeds every generator (:func:`kvlab.lab.setup`), loads ``args.model``, and runs the sets
    through :func:`kvlab.findings.rows.run_sets`. With ``args.first_set`` the rows go to
    ``<stem>.part<first_set>.csv``. The record (``path`` with ``.json``) holds the model, the
    set count under ``sets``, ``first_set`` where the parser offers it, ``tokens``, ``meta``,
    each set's wall seconds and :func:`kvlab.lab.provenance.study_run`.

    Returns
    -------
    rows : list of dict
        Every set's rows, in order.
    model : LoadedModel
        The model read.
    """
    first = getattr(args, "first_set", None)
    if first:
        path = path.with_name(f"{path.stem}.part{first}.csv")
    setup(args.seed)
    model = load_model(args.model)
    started = time.perf_counter()
    rows, walls = run_sets(path, range(first or 0, (first or 0) + args.sets), lambda j: one_set(model, j))
    record = {"model": model.name, sets: args.sets}
    if first is not None:
        record["first_set"] = first
    record |= {"tokens": args.tokens, **meta, "set_wall_s": walls, **study_run(script, started)}
    atomic_write_text(path.with_suffix(".json"), json.dumps(record, indent=1) + "\n")
    return rows, model


def run_design_study(
    script: str,
    design: Path,
    root: Path,
    out: Path,
    model_name: str,
    one_set: Callable[[LoadedModel, dict, int], list[dict]],
    **meta,
) -> list[dict]:
    """Run a pre-registered study: sets ``0 .. n_sets - 1`` of the committed design ``design``.

    ``n_sets`` defaults to the design's ``n_caches`` (one cache per set); a design whose sets each
    hold several caches (a haystack, one cache per fragment index) names its ``n_sets``.

    :func:`kvlab.findings.design.register` refuses a design git does not hold as committed before
    anything loads. Rows go to ``out/rows_<model>.csv``; the record beside them holds the design's
    commit, the model, ``sets``, ``meta``, each set's wall seconds and
    :func:`kvlab.lab.provenance.study_run`. ``one_set(model, design, j)`` returns set ``j``'s rows.
    """
    record = register(design, root)
    d = load_design(design)
    setup(d.get("seed", 0))
    model = load_model(model_name)
    started = time.perf_counter()
    path = Path(out) / f"rows_{model.name}.csv"
    n_sets = d.get("n_sets", d["n_caches"])
    rows, walls = run_sets(path, range(n_sets), lambda j: one_set(model, d, j))
    doc = {"design": record, "model": model.name, "sets": n_sets, **meta, "set_wall_s": walls}
    atomic_write_text(path.with_suffix(".json"), json.dumps(doc | study_run(script, started), indent=1) + "\n")
    return rows
