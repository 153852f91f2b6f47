"""Score intervals for differences of rates, in closed form, and the p-values that agree with them.

A bootstrap interval of a difference of two rates over the same questions collapses to a point
when no pair disagrees. :func:`kvlab.measure.stats.paired_diff_ci` (and ``paired_did``) widen it
to cover Newcombe's score interval for paired proportions at the effective number of pairs,
computed here (:func:`paired_rate_interval`), and ``paired_p`` is at least the level at which
that interval first excludes 0 (:func:`rate_p`, through :func:`score_p`). Nothing here
resamples. Rationale: docs/statistics.md.
"""

from __future__ import annotations

import numpy as np

from kvlab.errors import StatsError
from kvlab.measure.values import finite_values


def paired_rate_interval(a, b, *, n_eff: float | None = None, level: float = 0.95) -> tuple[float, float]:
    """Newcombe's hybrid score interval for ``mean(a) - mean(b)``, two rates over the same items.

    Newcombe (1998, Statistics in Medicine 17:2635, method 10): Wilson score intervals of the
    two rates, combined with the correlation of the paired 2x2 table (phi, continuity-corrected
    as Newcombe does). It never collapses, not even when no pair disagrees. Checked against the
    worked example in Fagerland, Lydersen and Laake (2017), *Statistical Analysis of Contingency
    Tables*, chapter 8 (pairs 59, 6, 16, 80: -0.0621 [-0.1186, -0.0046]).

    Parameters
    ----------
    a, b : array-like
        ``[n]`` 0/1 outcomes, paired item by item.
    n_eff : float, optional
        Effective number of pairs (clustered items count for fewer): the table is scaled to it.
    level : float

    Returns
    -------
    (float, float)
        Lower and upper bound, within [-1, 1].
    """
    from scipy.stats import norm

    x, y = finite_values(a, "a"), finite_values(b, "b")
    if x.shape != y.shape:
        raise StatsError(f"paired values need equal lengths, got {x.size} and {y.size}")
    scale = 1.0 if n_eff is None else float(n_eff) / x.size
    both, only_a = scale * float(np.sum(x * y)), scale * float(np.sum(x * (1 - y)))
    only_b, neither = scale * float(np.sum((1 - x) * y)), scale * float(np.sum((1 - x) * (1 - y)))
    n = both + only_a + only_b + neither
    z = float(norm.ppf(1 - (1 - level) / 2))

    def wilson(k: float) -> tuple[float, float, float]:
        p = k / n
        centre, half = p + z * z / (2 * n), z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        return p, (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)

    (p1, l1, u1), (p2, l2, u2) = wilson(both + only_a), wilson(both + only_b)
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    cross = both * neither - only_a * only_b
    # Newcombe's correction: a positive association is shrunk by n/2 (none when it is smaller).
    cross = cross - n / 2 if cross > n / 2 else min(cross, 0.0)
    phi = cross / np.sqrt(margins) if margins > 0 else 0.0
    lo = (p1 - p2) - np.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    hi = (p1 - p2) + np.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    return max(-1.0, float(lo)), min(1.0, float(hi))


def score_p(bounds, estimate: float) -> float:
    """The smallest ``alpha`` at which ``bounds(1 - alpha)`` excludes 0 (1 when the estimate is 0).

    ``bounds(level)`` is a score interval (Newcombe's, or its MOVER combination), nested in its level.
    """
    if estimate == 0:
        return 1.0
    lo, hi = 1e-12, 1.0 - 1e-12  # at level 1 - lo the interval holds 0; at level ~0 it is the point estimate
    for _ in range(60):
        mid = (lo + hi) / 2
        a, b = bounds(1 - mid)
        lo, hi = (lo, mid) if (a > 0 or b < 0) else (mid, hi)
    return hi


def rate_p(x: np.ndarray, y: np.ndarray, n_eff: float) -> float:
    """:func:`score_p` of Newcombe's interval for ``mean(x) - mean(y)``."""
    return score_p(lambda level: paired_rate_interval(x, y, n_eff=n_eff, level=level), x.mean() - y.mean())
