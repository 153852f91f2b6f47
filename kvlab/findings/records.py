"""Findings as data: a notebook records each key number, a sweep reads it back.

``record(name, value, unit=..., ci=..., n=...)`` (or ``record(name, ci, unit=...)`` with a
:class:`kvlab.CI`, which carries its mean, interval, n and caches) displays one output carrying the finding twice:
JSON under ``application/vnd.kvlab.record+v1+json`` (sorted keys, floats at 6 significant
digits, NaN and infinities as strings) and one ``text/plain`` line for people and nbval.
``read_records(path)`` returns the JSON payloads of an executed notebook in display order.
Why a MIME type of kvlab's own rather than scrapbook's ``glue``: docs/records.md.
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path

from kvlab.errors import RecordError
from kvlab.measure.stats import CI

MIME_TYPE = "application/vnd.kvlab.record+v1+json"
SIGNIFICANT_DIGITS = 6

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _number(x, what: str, name: str):
    """``x`` as a plain Python int or float; numpy/torch scalars and 1-element tensors are converted."""
    if isinstance(x, bool):
        raise RecordError(f"record {name!r}: {what} must be a number, got a bool ({x!r})")
    if hasattr(x, "item") and callable(x.item) and not isinstance(x, numbers.Number):
        # numpy scalars / 0-d arrays / one-element torch tensors; anything bigger fails here.
        try:
            x = x.item()
        except (ValueError, RuntimeError, TypeError) as e:
            raise RecordError(
                f"record {name!r}: {what} must be a single number, got {type(x).__name__} "
                f"of shape {tuple(getattr(x, 'shape', ()))}"
            ) from e
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise RecordError(f"record {name!r}: {what} must be a number, got {type(x).__name__} ({x!r:.60})")
    return int(x) if isinstance(x, numbers.Integral) else float(x)


def rounded(x):
    """JSON-ready ``x``: ints stay, floats keep SIGNIFICANT_DIGITS digits, non-finite become strings."""
    if isinstance(x, int) or x is None:
        return x
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return float(f"{x:.{SIGNIFICANT_DIGITS}g}")


def _plain(x, name: str, key: str):
    """``extra`` values: JSON scalars (numbers rounded), lists of them; anything else is refused."""
    if x is None or isinstance(x, (str, bool)):
        return x
    if isinstance(x, (list, tuple)):
        return [_plain(v, name, key) for v in x]
    try:
        return rounded(_number(x, f"extra {key!r}", name))
    except RecordError:
        raise RecordError(
            f"record {name!r}: extra {key!r} must be a string, bool, number or list of them, got {type(x).__name__}"
        ) from None


def make_record(name: str, value, *, unit: str = "", ci=None, n=None, **extra) -> dict:
    """The JSON payload ``record`` displays (validated, rounded, sorted keys when dumped).

    ``value`` may be a :class:`kvlab.CI`: its mean is the value, its bounds the interval, its
    ``n`` the count and its ``n_clusters`` the extra ``caches``; ``ci`` and ``n`` are then refused.

    Returns
    -------
    dict with keys ``name``, ``value``, ``unit``, ``ci_low``, ``ci_high``, ``n``, ``extra``.
    """
    if not isinstance(name, str) or not name:
        raise RecordError(f"a record needs a non-empty string name, got {name!r}")
    if not isinstance(unit, str):
        raise RecordError(f"record {name!r}: unit must be a string, got {type(unit).__name__}")
    if isinstance(value, CI):
        if ci is not None or n is not None:
            raise RecordError(
                f"record {name!r}: a CI carries its own interval and n; give ci= and n= only with a number"
            )
        ci, n = (value.lo, value.hi), value.n
        if value.n_clusters is not None:
            extra.setdefault("caches", value.n_clusters)
        value = value.mean
    v = _number(value, "value", name)
    lo = hi = None
    if ci is not None:
        try:
            lo, hi = ci
        except (TypeError, ValueError):
            raise RecordError(f"record {name!r}: ci must be a (low, high) pair, got {ci!r:.60}") from None
        lo, hi = _number(lo, "ci low", name), _number(hi, "ci high", name)
        if lo > hi:
            raise RecordError(f"record {name!r}: ci low {lo} is above ci high {hi}")
    if n is not None:
        n = _number(n, "n", name)
        if not isinstance(n, int) or n < 0:
            raise RecordError(f"record {name!r}: n must be a non-negative integer, got {n!r}")
    return {
        "name": name,
        "value": rounded(v),
        "unit": unit,
        "ci_low": rounded(lo),
        "ci_high": rounded(hi),
        "n": n,
        "extra": {k: _plain(x, name, k) for k, x in sorted(extra.items())},
    }


def _fmt(x) -> str:
    return x if isinstance(x, str) else f"{x:.4g}"


def record_text(rec: dict) -> str:
    """The one-line ``text/plain`` rendering, e.g. ``record: phase_error = 0.1234 rad [0.1, 0.2] (n=30)``."""
    s = f"record: {rec['name']} = {_fmt(rec['value'])}"
    if rec["unit"]:
        s += f" {rec['unit']}"
    if rec["ci_low"] is not None:
        s += f" [{_fmt(rec['ci_low'])}, {_fmt(rec['ci_high'])}]"
    if rec["n"] is not None:
        s += f" (n={rec['n']})"
    return s


def record(
    name: str, value: float, *, unit: str = "", ci: tuple[float, float] | None = None, n: int | None = None, **extra
) -> None:
    """Record one finding of a notebook as data, and show it as one line.

    Parameters
    ----------
    name : metric name, e.g. ``"phase_error_low"``; one notebook should use each name once.
    value : a number (Python, numpy or one-element torch scalar; NaN allowed), or a
        :class:`kvlab.CI`, which brings its interval, n and caches (then no ``ci`` or ``n``).
    unit : unit of ``value`` (``"rad"``, ``"nats"``, ``""`` when dimensionless).
    ci : optional (low, high) 95% interval or range over seeds.
    n : optional sample count behind ``value`` and ``ci``.
    **extra : further JSON scalars (strings, bools, numbers, lists of them) kept with the record.

    Returns None, so a record on a cell's last line adds no second output (the stored payload
    is ``make_record(...)``). Outside IPython nothing is displayed, but the input is still checked.
    """
    rec = make_record(name, value, unit=unit, ci=ci, n=n, **extra)
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # plain Python: nothing to display into
        return None
    if get_ipython() is not None:
        # raw=True: the bundle is displayed as given, one output with both MIME types.
        display({MIME_TYPE: rec, "text/plain": record_text(rec)}, raw=True)
    return None


def _revive(x):
    return _NONFINITE.get(x, x) if isinstance(x, str) else x


def read_records(notebook_path) -> list[dict]:
    """The records of an executed notebook, in display order.

    Parameters
    ----------
    notebook_path : path of an ``.ipynb`` file (as written by papermill / nbconvert).

    Returns
    -------
    list of dicts with keys ``name``, ``value``, ``unit``, ``ci_low``, ``ci_high``, ``n``,
    ``extra``; ``"NaN"``/``"Infinity"`` strings come back as floats.
    """
    import nbformat

    path = Path(notebook_path)
    try:
        nb = nbformat.read(path, as_version=4)
    except FileNotFoundError:
        raise RecordError(f"no notebook at {path}") from None
    except Exception as e:  # nbformat raises several unrelated types for unreadable files
        raise RecordError(f"{path} is not a readable notebook: {e}") from e
    out = []
    for cell in nb.cells:
        if cell.get("cell_type") != "code":
            continue
        for o in cell.get("outputs", []):
            data = o.get("data") or {}
            if MIME_TYPE not in data:
                continue
            rec = data[MIME_TYPE]
            if isinstance(rec, str):  # some writers store JSON MIME bundles as text
                rec = json.loads(rec)
            rec = dict(rec)
            for k in ("value", "ci_low", "ci_high"):
                rec[k] = _revive(rec.get(k))
            out.append(rec)
    return out
