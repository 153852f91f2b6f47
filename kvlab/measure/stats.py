"""Uncertainty of kvlab's findings: seeded percentile-bootstrap confidence intervals.

Every number a study reports is a mean over questions or probes; :func:`mean_ci` gives it
with a 95% interval, :func:`paired_diff_ci` the interval of the difference of two
strategies measured on the *same* items (resampling items jointly, so the spread shared by
both strategies cancels). Resampling is vectorised in NumPy and seeded, so a notebook
re-run prints the same interval.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlab.errors import StatsError

#: Bootstrap resamples unless told otherwise.
N_BOOT = 2000


@dataclass(frozen=True)
class CI:
    """A mean and its percentile-bootstrap interval.

    Attributes
    ----------
    mean : float
        The sample mean (of the values, or of the paired differences).
    lo, hi : float
        Interval bounds at ``level``.
    n : int
        Number of items the mean is over.
    level : float
    """

    mean: float
    lo: float
    hi: float
    n: int
    level: float = 0.95

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def excludes(self, value: float = 0.0) -> bool:
        """Whether ``value`` lies outside the interval (for a difference: a resolved one)."""
        return value < self.lo or value > self.hi

    def __format__(self, spec: str) -> str:
        spec = spec or ".3f"
        return f"{self.mean:{spec}} [{self.lo:{spec}}, {self.hi:{spec}}] (n={self.n})"

    def __str__(self) -> str:
        return format(self)


def _values(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64).ravel()
    if a.size == 0:
        raise StatsError(f"{name} is empty: a mean needs at least one value")
    if not np.all(np.isfinite(a)):
        raise StatsError(f"{name} holds {int((~np.isfinite(a)).sum())} non-finite value(s); drop or explain them first")
    return a


def _check(n_boot: int, level: float) -> None:
    if int(n_boot) < 1:
        raise StatsError(f"n_boot must be >= 1, got {n_boot}")
    if not 0 < level < 1:
        raise StatsError(f"level must lie in (0, 1), got {level}")


def _percentile(a: np.ndarray, n_boot: int, seed: int, level: float) -> CI:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(int(n_boot), a.size))
    means = a[idx].mean(axis=1)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return CI(float(a.mean()), float(lo), float(hi), int(a.size), level)


def mean_ci(values, *, n_boot: int = N_BOOT, seed: int = 0, level: float = 0.95) -> CI:
    """Mean of ``values`` with a percentile-bootstrap interval.

    Parameters
    ----------
    values : array-like
        ``[n]`` finite numbers (0/1 for a rate such as exact match).
    n_boot : int
        Resamples of the ``n`` items, with replacement.
    seed : int
        Seed of the resampling (same seed, same interval).
    level : float
        Coverage, 0.95 for a 95% interval.

    Returns
    -------
    CI
    """
    _check(n_boot, level)
    return _percentile(_values(values, "values"), n_boot, seed, level)


def paired_diff_ci(a, b, *, n_boot: int = N_BOOT, seed: int = 0, level: float = 0.95) -> CI:
    """Mean of ``a - b`` over paired items, with a percentile-bootstrap interval.

    ``a[i]`` and ``b[i]`` must be measured on the same item (question, probe); the items
    are resampled jointly. The difference is resolved at ``level`` when the interval
    excludes 0 (:meth:`CI.excludes`).

    Parameters
    ----------
    a, b : array-like
        ``[n]`` each.
    """
    _check(n_boot, level)
    x, y = _values(a, "a"), _values(b, "b")
    if x.shape != y.shape:
        raise StatsError(f"paired values need equal lengths, got {x.size} and {y.size}")
    return _percentile(x - y, n_boot, seed, level)
