"""What a statistic's input holds: finite numbers, and whether paired values are rates.

Every interval and p in :mod:`kvlab.measure.stats` and :mod:`kvlab.measure.scores` reads its
values through :func:`finite_values`, and the paired ones decide through :func:`are_rates`
whether a difference is one of rates (whose interval is widened to a score interval, so it
never collapses). Both sit below the two modules that use them.
"""

from __future__ import annotations

import numpy as np

from kvlab.errors import StatsError


def finite_values(x, name: str) -> np.ndarray:
    """``x`` as a flat float64 array; :class:`~kvlab.errors.StatsError` naming ``name`` when empty or not finite."""
    a = np.asarray(x, dtype=np.float64).ravel()
    if a.size == 0:
        raise StatsError(f"{name} is empty: a mean needs at least one value")
    if not np.all(np.isfinite(a)):
        raise StatsError(f"{name} holds {int((~np.isfinite(a)).sum())} non-finite value(s); drop or explain them first")
    return a


def are_rates(rates: bool | None, arrays) -> bool:
    """Whether paired values are 0/1 outcomes: as ``rates`` says, else when every array arrives boolean.

    0/1 values of another dtype must be named: a float copy of exact match read as measurements
    would get a bootstrap interval that collapses to ``[0, 0]`` when no pair disagrees.

    Raises
    ------
    StatsError
        ``rates`` is None and every array holds only 0 and 1 without being boolean.
    """
    if rates is not None:
        return bool(rates)
    values = [np.asarray(v) for v in arrays]
    if all(v.dtype == bool for v in values):
        return True
    if all(v.size and np.isin(v, (0, 1)).all() for v in values):
        raise StatsError(
            "a and b hold only 0 and 1 but are not boolean: say rates=True for outcomes (exact match) "
            "or rates=False for measurements"
        )
    return False
