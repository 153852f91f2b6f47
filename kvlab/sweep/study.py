"""Study files: read a ``STUDY.toml``, check it against the notebook, expand it into points.

A study file::

    notebook = "01_phase_error"        # a suite name (notebooks/NAME.ipynb) or a path relative to this file
    output = "runs/phase_error"        # optional; relative to the working directory; default runs/<file stem>
    timeout = 900                      # optional; seconds per point (whole notebook), --timeout overrides
    seeds = [0, 1, 2]                  # optional; values of the notebook's `seed` parameter (a grid axis)
    repeats = 1                        # optional; runs of every point (repeat index 0..n-1, not a parameter)

    [parameters]                       # optional; fixed values for every point
    n_fragments = 3

    [grid]                             # optional; the product of these lists
    model_name = ["smollm2-135m", "gemma3-270m"]

    [zip]                              # optional; lists of one length that vary together
    texts = [[...], [...]]
    label = ["short", "long"]

Points are the product of every ``[grid]`` list, ``seeds`` and the ``[zip]`` group (one
axis), times ``repeats``. Every name must be a parameter of the notebook's ``parameters``
cell (``papermill.inspect_notebook``) and every value must have the type of that
parameter's default (an int where the default is an int, a float or int where it is a
float, a list where it is a list, ...; a ``None`` default or one that is not a literal
takes anything). Anything wrong raises :class:`StudyError` naming the key, before anything runs.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvlab.errors import StudyError

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
KEYS = {"notebook", "output", "timeout", "seeds", "repeats", "parameters", "grid", "zip"}


@dataclass(frozen=True)
class Point:
    """One grid point: the parameters handed to papermill, and where its outputs go."""

    index: int
    parameters: dict
    repeat: int
    varied: dict  # the parameters that differ between points (for labels)
    key: str  # short digest of (parameters, repeat): the point's identity across runs

    @property
    def folder_name(self) -> str:
        label = "_".join(_slug(v) for v in self.varied.values())
        if self.repeat or "repeat" in self.varied:
            label += f"_r{self.repeat}"
        label = label.strip("_")[:60]
        return f"{label}-{self.key}" if label else self.key


@dataclass
class Study:
    """A checked study: notebook, points and settings."""

    path: Path
    notebook: Path
    output: Path
    timeout: float | None
    points: list[Point]
    axes: list[str]  # swept parameter names, in file order
    declared: dict = field(default_factory=dict)


def _slug(v) -> str:
    s = v if isinstance(v, str) else json.dumps(v)
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", s).strip("-")[:24] or "x"


def resolve_notebook(name: str, base: Path) -> Path:
    """A suite name (``01_phase_error``) or a path (relative to ``base``) -> existing ``.ipynb``."""
    if not isinstance(name, str) or not name:
        raise StudyError(f"key 'notebook' must be a notebook name or path, got {name!r}")
    candidates = [base / name, base / f"{name}.ipynb"]
    if "/" not in name:
        candidates += [NOTEBOOK_DIR / name, NOTEBOOK_DIR / f"{name}.ipynb"]
    for c in candidates:
        if c.suffix == ".ipynb" and c.is_file():
            return c.resolve()
    suite = ", ".join(p.stem for p in sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb")))
    raise StudyError(
        f"key 'notebook': unknown notebook {name!r} (not a file next to {base}, "
        f"nor a suite notebook; the suite has: {suite})"
    )


def _default(spec: dict):
    """The literal default of a parameter, or ``...`` when it is an expression."""
    try:
        return ast.literal_eval(spec.get("default", "None"))
    except (ValueError, SyntaxError):
        return ...


_TYPE_NAMES = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict, "tuple": tuple}


def _expected(spec: dict):
    """The Python type a parameter takes, from its annotation or its default; None: anything."""
    hinted = _TYPE_NAMES.get(str(spec.get("inferred_type_name", "None")).strip())
    if hinted is not None:
        return hinted
    d = _default(spec)
    if d is ... or d is None:
        return None
    return type(d)


def _type_ok(value, want) -> bool:
    if want is None:
        return True
    if want is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):  # TOML booleans are never numbers
        return False
    if want is float:
        return isinstance(value, (int, float))
    if want in (list, tuple):
        return isinstance(value, (list, tuple))
    return isinstance(value, want)


def check_value(where: str, name: str, value, declared: dict, notebook: Path) -> None:
    if name not in declared:
        raise StudyError(
            f"{where}: unknown parameter {name!r}: notebook {notebook.name} declares "
            f"{', '.join(declared) or 'no parameters'}"
        )
    want = _expected(declared[name])
    if not _type_ok(value, want):
        raise StudyError(
            f"{where}: parameter {name!r} must be {want.__name__} (its default in {notebook.name} is "
            f"{declared[name].get('default')}), got {type(value).__name__} {value!r:.60}"
        )


def point_key(parameters: dict, repeat: int) -> str:
    blob = json.dumps({"parameters": parameters, "repeat": repeat}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def _list(where: str, value) -> list:
    if not isinstance(value, list):
        raise StudyError(f"{where} must be a list of values, got {type(value).__name__} {value!r:.60}")
    if not value:
        raise StudyError(f"{where} is empty: the grid would have no points")
    return value


def load_study(path, *, output=None, timeout=None) -> Study:
    """Read, check and expand a study file. Raises :class:`StudyError` naming the bad key."""
    import papermill as pm

    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise StudyError(f"no study file at {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise StudyError(f"{path} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise StudyError(
            f"unknown key(s) {', '.join(map(repr, unknown))} in {path.name}; a study takes {', '.join(sorted(KEYS))}"
        )
    if "notebook" not in data:
        raise StudyError(f"key 'notebook' is missing in {path.name}")
    notebook = resolve_notebook(data["notebook"], path.parent)
    try:
        declared = pm.inspect_notebook(str(notebook))
    except Exception as e:  # papermill raises its own types and nbformat's for unreadable files
        raise StudyError(f"key 'notebook': cannot read the parameters of {notebook}: {e}") from e
    if not declared:
        raise StudyError(f"key 'notebook': {notebook.name} has no cell tagged 'parameters', so nothing can be swept")

    for key in ("parameters", "grid", "zip"):
        if not isinstance(data.get(key, {}), dict):
            raise StudyError(f"key {key!r} must be a table ([{key}]), got {type(data[key]).__name__}")
    fixed = data.get("parameters", {})
    grid = dict(data.get("grid", {}))
    zipped = data.get("zip", {})
    if "seeds" in data:
        if "seed" in grid or "seed" in zipped:
            raise StudyError("key 'seeds' and a 'seed' list in [grid] or [zip] both set the seed; keep one")
        grid["seed"] = data["seeds"]
        seeds_where = "key 'seeds'"
    for name, value in fixed.items():
        check_value(f"[parameters] {name}", name, value, declared, notebook)
    axes: list[tuple[str, list]] = []
    for name, values in grid.items():
        where = seeds_where if name == "seed" and "seeds" in data else f"[grid] {name}"
        for v in _list(where, values):
            check_value(where, name, v, declared, notebook)
        axes.append((name, values))
    if zipped:
        lengths = {name: len(_list(f"[zip] {name}", values)) for name, values in zipped.items()}
        if len(set(lengths.values())) > 1:
            raise StudyError(
                f"[zip] lists must have one length, got {', '.join(f'{k}: {n}' for k, n in lengths.items())}"
            )
        for name, values in zipped.items():
            for v in values:
                check_value(f"[zip] {name}", name, v, declared, notebook)
    twice = (set(fixed) & (set(grid) | set(zipped))) | (set(grid) & set(zipped))
    if twice:
        raise StudyError(
            f"parameter(s) {', '.join(sorted(twice))} set in more than one of [parameters], [grid], [zip], seeds"
        )

    repeats = data.get("repeats", 1)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise StudyError(f"key 'repeats' must be a positive integer, got {repeats!r}")
    t = timeout if timeout is not None else data.get("timeout")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
        raise StudyError(f"key 'timeout' must be a positive number of seconds, got {t!r}")
    out = output if output is not None else data.get("output", f"runs/{path.stem}")
    if not isinstance(out, (str, Path)) or not str(out):
        raise StudyError(f"key 'output' must be a folder path, got {out!r}")

    zip_rows = [dict(zip(zipped, row)) for row in zip(*zipped.values())] if zipped else [{}]
    combos = []
    for values in itertools.product(*(v for _, v in axes)):
        for zrow in zip_rows:
            combos.append({**fixed, **dict(zip((n for n, _ in axes), values)), **zrow})
    swept = [n for n, v in axes if len(v) > 1] + ([n for n in zipped] if len(zip_rows) > 1 else [])
    points = []
    for params in combos:
        for r in range(repeats):
            varied = {n: params[n] for n in swept}
            if repeats > 1:
                varied["repeat"] = r
            points.append(Point(len(points), params, r, varied, point_key(params, r)))
    keys = [p.key for p in points]
    if len(set(keys)) != len(keys):
        raise StudyError("the grid repeats a point (the same parameters twice); list each value once")
    return Study(
        path=path.resolve(),
        notebook=notebook,
        output=Path(out),
        timeout=None if t is None else float(t),
        points=points,
        axes=swept + (["repeat"] if repeats > 1 else []),
        declared=declared,
    )
