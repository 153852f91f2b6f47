"""Uncertainty of kvlab's findings: seeded bootstrap intervals over the unit that varies.

The questions of one generated set share one merged cache, so they are not independent: the
cache is the unit that varies. :func:`mean_ci` and :func:`paired_diff_ci` take ``clusters``
(the cache each value was measured behind) and then resample caches with replacement, keeping
all of each drawn cache's questions (the standard cluster bootstrap); without it, items are
resampled. ``two_stage=True`` also resamples questions within each drawn cache: a sensitivity
column only (it double-counts the within-cache spread and widens the interval). :func:`proportion_ci`
gives rates (exact match, agreement) an interval that never collapses at 0 or 1: the cluster
bootstrap's, widened to cover the Wilson interval at the effective sample size; a paired
difference of rates (:func:`paired_diff_ci` on booleans) is likewise widened to cover Newcombe's
score interval for paired proportions (:func:`kvlab.measure.scores.paired_rate_interval`). :func:`holm`
corrects a family of named comparisons. Resampling is vectorised and seeded: a re-run prints
the same interval. Values from a single cache say nothing of how caches vary: their interval
has NaN bounds and their p-value is 1, never a zero-width interval called resolved.
Rationale and the checks of coverage: docs/statistics.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlab.errors import StatsError
from kvlab.measure.scores import paired_rate_interval, rate_p, score_p
from kvlab.measure.values import are_rates, finite_values

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
    n_clusters : int or None
        Number of independent caches the items came from (``None``: items resampled alone).
    """

    mean: float
    lo: float
    hi: float
    n: int
    level: float = 0.95
    n_clusters: int | None = None  # caches the items came from, when resampled by cache

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def excludes(self, value: float = 0.0) -> bool:
        """Whether ``value`` lies outside the interval (for a difference: a resolved one)."""
        return value < self.lo or value > self.hi

    def as_dict(self) -> dict:
        """The form kvlab's result files keep: ``mean``, ``lo``, ``hi``, ``n`` and ``caches``."""
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi, "n": self.n, "caches": self.n_clusters}

    def __format__(self, spec: str) -> str:
        spec = spec or ".3f"
        caches = "" if self.n_clusters is None else f", caches={self.n_clusters}"
        return f"{fmt_ci(self, spec)} (n={self.n}{caches})"

    def __str__(self) -> str:
        return format(self)


def fmt_ci(c, spec: str = ".4f") -> str:
    """``mean [lo, hi]``: kvlab's one way of writing an interval, for tables and conclusions.

    Parameters
    ----------
    c : CI, dict or None
        A :class:`CI` or its result-file form (:meth:`CI.as_dict`: ``mean``, ``lo``, ``hi``); None
        writes ``-``.
    spec : str
        Format spec of the three numbers (``".3f"``, ``"+.3f"``, ``".0%"``).
    """
    if c is None:
        return "-"
    mean, lo, hi = (c.mean, c.lo, c.hi) if isinstance(c, CI) else (c["mean"], c["lo"], c["hi"])
    caches = c.n_clusters if isinstance(c, CI) else c.get("caches")
    if caches == 1 and lo != lo and hi != hi:
        return f"{mean:{spec}} [one cache: no interval]"
    return f"{mean:{spec}} [{lo:{spec}}, {hi:{spec}}]"


def _check(n_boot: int, level: float) -> None:
    if int(n_boot) < 1:
        raise StatsError(f"n_boot must be >= 1, got {n_boot}")
    if not 0 < level < 1:
        raise StatsError(f"level must lie in (0, 1), got {level}")


def _groups(clusters, n: int) -> list[np.ndarray] | None:
    """Item indices per cluster, in first-seen order; None when ``clusters`` is None."""
    if clusters is None:
        return None
    labels = list(clusters)
    if len(labels) != n:
        raise StatsError(f"clusters has {len(labels)} labels for {n} values")
    order = list(dict.fromkeys(labels))
    where = {c: i for i, c in enumerate(order)}
    members: list[list[int]] = [[] for _ in order]
    for k, c in enumerate(labels):
        members[where[c]].append(k)
    return [np.asarray(m) for m in members]


def _resample_means(a: np.ndarray, groups, n_boot: int, seed: int, two_stage: bool = False) -> np.ndarray:
    """``[n_boot]`` bootstrap means of ``a``: items alone, or caches with all their items.

    With ``groups``, each resample draws ``len(groups)`` caches with replacement and its mean is
    the sum of the drawn caches' items over their count (the standard cluster bootstrap; for
    equal cache sizes, the bootstrap of the per-cache means). ``two_stage`` also redraws the
    items within every drawn cache (the sensitivity scheme). The caches drawn depend only on
    ``seed`` and the cache count, not on the values: two arrays resampled with one seed are
    resampled together.
    """
    rng = np.random.default_rng(seed)
    if groups is None:
        return a[rng.integers(0, a.size, size=(int(n_boot), a.size))].mean(axis=1)
    sizes = np.array([g.size for g in groups])
    picks = rng.integers(0, len(groups), size=(int(n_boot), len(groups)))
    counts = sizes[picks].sum(axis=1)
    if not two_stage:
        totals = np.array([a[g].sum() for g in groups])
        return totals[picks].sum(axis=1) / counts
    sums = np.zeros(int(n_boot))
    # Stage two, per cache: its items resampled with replacement, once for every time it was drawn.
    for ci, g in enumerate(groups):
        times = (picks == ci).sum(axis=1)
        total = int(times.sum())
        if total == 0:
            continue
        draws = a[g][rng.integers(0, g.size, size=(total, g.size))].sum(axis=1)
        owner = np.repeat(np.arange(int(n_boot)), times)
        np.add.at(sums, owner, draws)
    return sums / counts


def _one_cache(groups) -> bool:
    """Whether values resampled by cache came from one cache only: no variation between caches to resample."""
    return groups is not None and len(groups) < 2


def _interval(a: np.ndarray, groups, n_boot: int, seed: int, level: float, two_stage: bool = False) -> CI:
    if _one_cache(groups):
        return CI(float(a.mean()), float("nan"), float("nan"), int(a.size), level, len(groups))
    means = _resample_means(a, groups, n_boot, seed, two_stage)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return CI(float(a.mean()), float(lo), float(hi), int(a.size), level, None if groups is None else len(groups))


def mean_ci(
    values, *, clusters=None, n_boot: int = N_BOOT, seed: int = 0, level: float = 0.95, two_stage: bool = False
) -> CI:
    """Mean of ``values`` with a percentile-bootstrap interval.

    Parameters
    ----------
    values : array-like
        ``[n]`` finite numbers (for a rate such as exact match use :func:`proportion_ci`).
    clusters : sequence, optional
        ``[n]`` labels: the cache (generated set) each value was measured behind. Given, caches
        are resampled with all their values, and the interval states ``n_clusters``; one cache
        alone gives NaN bounds.
    n_boot : int
        Resamples of the ``n`` items, with replacement.
    seed : int
        Seed of the resampling (same seed, same interval).
    level : float
        Coverage, 0.95 for a 95% interval.
    two_stage : bool
        Also resample values within each drawn cache (a sensitivity column, not kvlab's interval).

    Returns
    -------
    CI
    """
    _check(n_boot, level)
    a = finite_values(values, "values")
    return _interval(a, _groups(clusters, a.size), n_boot, seed, level, two_stage)


def paired_diff_ci(
    a,
    b,
    *,
    clusters=None,
    n_boot: int = N_BOOT,
    seed: int = 0,
    level: float = 0.95,
    two_stage: bool = False,
    rates: bool | None = None,
) -> CI:
    """Mean of ``a - b`` over paired items, with a percentile-bootstrap interval.

    ``a[i]`` and ``b[i]`` must be measured on the same item (question, probe); the items
    are resampled jointly: each pair's difference is taken first, and the differences are
    averaged as :func:`mean_ci` averages values (by cache, when ``clusters`` is given). The
    difference is resolved at ``level`` when the interval excludes 0 (:meth:`CI.excludes`).

    A difference of two rates (exact match of two strategies) never collapses either: when no
    pair disagrees the bootstrap gives ``[0, 0]``, so the interval is widened to cover
    Newcombe's score interval (:func:`paired_rate_interval`) at the effective number of pairs
    ``n / deff``, ``deff`` as in :func:`proportion_ci` (of the differences). Widening only ever
    withdraws a resolved call, never makes one.

    Parameters
    ----------
    a, b : array-like
        ``[n]`` each.
    clusters : sequence, optional
        ``[n]`` cache labels, as for :func:`mean_ci`; pairs stay together within their cache.
    two_stage : bool
        As for :func:`mean_ci` (sensitivity only).
    rates : bool, optional
        Whether ``a`` and ``b`` are 0/1 outcomes. Default: when both arrive as booleans (rows
        read back by :func:`kvlab.findings.rows.read_rows` keep exact match boolean); 0/1 values of
        another dtype raise :class:`StatsError` unless ``rates`` names them.
    """
    _check(n_boot, level)
    rates = are_rates(rates, (a, b))
    x, y = finite_values(a, "a"), finite_values(b, "b")
    if x.shape != y.shape:
        raise StatsError(f"paired values need equal lengths, got {x.size} and {y.size}")
    groups = _groups(clusters, x.size)
    ci = _interval(x - y, groups, n_boot, seed, level, two_stage)
    if not rates or _one_cache(groups):
        return ci
    if not np.all(((x == 0) | (x == 1)) & ((y == 0) | (y == 1))):
        raise StatsError("a difference of rates needs 0/1 (or boolean) values in a and b")
    lo, hi = paired_rate_interval(x, y, n_eff=x.size / _design_effect(x - y, groups, n_boot, seed), level=level)
    return CI(ci.mean, min(ci.lo, lo), max(ci.hi, hi), ci.n, level, ci.n_clusters)


def _design_effect(a: np.ndarray, groups, n_boot: int, seed: int) -> float:
    """The cluster bootstrap's variance of the mean over the items-alone one, at least 1 (1 without caches)."""
    if groups is None:
        return 1.0
    iid = _resample_means(a, None, n_boot, seed).var()
    return max(1.0, float(_resample_means(a, groups, n_boot, seed).var() / iid)) if iid > 0 else 1.0


def proportion_ci(successes, *, clusters=None, n_boot: int = N_BOOT, seed: int = 0, level: float = 0.95) -> CI:
    """A rate with an interval that never collapses at 0 or 1.

    The (cluster) bootstrap interval of the mean, widened to cover the Wilson score interval
    (:func:`scipy.stats.binomtest`) at the effective sample size ``n / deff``, where the design
    effect ``deff >= 1`` is the ratio of the cluster bootstrap's variance to the items-alone one.
    So 0 of 48 reads ``[0, 0.074]`` with independent items, and wider when the 48 share few caches.

    Parameters
    ----------
    successes : array-like
        ``[n]`` booleans or 0/1.
    clusters : sequence, optional
        ``[n]`` cache labels, as for :func:`mean_ci`.

    Returns
    -------
    CI
    """
    from scipy.stats import binomtest

    _check(n_boot, level)
    a = finite_values(successes, "successes")
    if not np.all((a == 0) | (a == 1)):
        raise StatsError("a proportion needs 0/1 (or boolean) values; use mean_ci for other numbers")
    groups = _groups(clusters, a.size)
    ci = _interval(a, groups, n_boot, seed, level)
    if _one_cache(groups):
        return ci
    deff = _design_effect(a, groups, n_boot, seed) if 0 < a.mean() < 1 else 1.0
    n_eff = max(1, int(round(a.size / deff)))
    wilson = binomtest(int(round(a.mean() * n_eff)), n_eff).proportion_ci(confidence_level=level, method="wilson")
    return CI(ci.mean, min(ci.lo, float(wilson.low)), max(ci.hi, float(wilson.high)), ci.n, level, ci.n_clusters)


def gap_closed_ci(treated, baseline, *, clusters=None, n_boot: int = N_BOOT, seed: int = 0, level: float = 0.95) -> CI:
    """The share of ``baseline``'s error that ``treated`` removes: ``1 - mean(treated) / mean(baseline)``.

    For errors measured against an exact reference (0 is no error), e.g. recompute's
    answer-span KL against rerotate's over the same questions: 1 closes the whole gap, 0
    none, a negative value widens it. Pairs are resampled together (by cache when
    ``clusters`` is given); the interval is the percentile interval of the resampled ratio.

    Parameters
    ----------
    treated, baseline : array-like
        ``[n]`` each (errors, 0 at the reference), paired item by item; ``baseline``'s mean must be positive.
    clusters : sequence, optional
        ``[n]`` cache labels, as for :func:`mean_ci`.
    """
    _check(n_boot, level)
    x, y = finite_values(treated, "treated"), finite_values(baseline, "baseline")
    if x.shape != y.shape:
        raise StatsError(f"paired values need equal lengths, got {x.size} and {y.size}")
    if y.mean() <= 0:
        raise StatsError(f"a gap closed needs a baseline error with a positive mean, got {y.mean():g}")
    groups = _groups(clusters, x.size)
    if _one_cache(groups):
        return CI(float(1 - x.mean() / y.mean()), float("nan"), float("nan"), int(x.size), level, 1)
    # The same seed draws the same items for both arrays (the draws do not depend on the values),
    # so each resample's two means are over one resample of the pairs.
    mx, my = _resample_means(x, groups, n_boot, seed), _resample_means(y, groups, n_boot, seed)
    ratios = 1 - mx / np.where(my > 0, my, np.nan)
    tail = (1 - level) / 2 * 100
    lo, hi = np.nanpercentile(ratios, [tail, 100 - tail])
    return CI(
        float(1 - x.mean() / y.mean()),
        float(lo),
        float(hi),
        int(x.size),
        level,
        None if groups is None else len(groups),
    )


def paired_p(a, b, *, clusters=None, n_boot: int = N_BOOT, seed: int = 0, rates: bool | None = None) -> float:
    """Two-sided bootstrap p-value of ``mean(a - b) = 0`` (paired, by cache when ``clusters`` is given).

    Twice the smaller share of resampled mean differences on either side of 0, floored at
    ``1 / n_boot`` (a p-value below the resolution of the resampling is not claimed); 1 when
    ``clusters`` holds one cache (nothing is known of how caches vary). For rates (``rates``
    as in :func:`paired_diff_ci`) it is at least the ``alpha`` at which Newcombe's ``1 - alpha``
    interval first excludes 0, so a difference of rates whose :func:`paired_diff_ci` interval
    holds 0 is not called resolved by its p either.
    """
    rates = are_rates(rates, (a, b))
    x, y = finite_values(a, "a"), finite_values(b, "b")
    if x.shape != y.shape:
        raise StatsError(f"paired values need equal lengths, got {x.size} and {y.size}")
    d = x - y
    groups = _groups(clusters, d.size)
    if _one_cache(groups):
        return 1.0
    means = _resample_means(d, groups, n_boot, seed)
    p = 2 * min(float((means <= 0).mean()), float((means >= 0).mean()))
    p = float(min(1.0, max(p, 1.0 / int(n_boot))))
    if rates:
        p = max(p, rate_p(x, y, x.size / _design_effect(d, groups, n_boot, seed)))
    return p


def paired_did(
    a1,
    b1,
    a2,
    b2,
    *,
    clusters=None,
    n_boot: int = N_BOOT,
    seed: int = 0,
    level: float = 0.95,
    rates: bool | None = None,
) -> tuple[CI, float]:
    """A difference of two paired differences, ``mean(a1 - b1) - mean(a2 - b2)``, over matched items.

    Item ``i`` is one unit (a question of one kind in one set) measured four times: ``a1[i]`` and
    ``b1[i]`` in one cell, ``a2[i]`` and ``b2[i]`` in another. The interval is the bootstrap of
    ``(a1 - b1) - (a2 - b2)``, resampled by cache, and its p :func:`paired_p`'s. For rates (0/1;
    by default when all four arrive boolean) the interval is widened to cover the MOVER combination
    (Newcombe 2001) of the two differences' score intervals (:func:`kvlab.measure.scores.paired_rate_interval`) at the
    effective number of items, and p is at least the level at which that combination excludes 0.
    MOVER here treats the two differences as independent, which widens the interval when they
    are positively correlated (matched questions): conservative, never collapsed.

    Parameters
    ----------
    a1, b1, a2, b2 : array-like
        ``[n]`` each, matched item by item.
    clusters : sequence, optional
        ``[n]`` cache labels, as for :func:`mean_ci`.

    Returns
    -------
    (CI, float)
        The interval and its two-sided p.
    """
    _check(n_boot, level)
    arrays = [a1, b1, a2, b2]
    rates = are_rates(rates, arrays)
    v1, w1, v2, w2 = (finite_values(v, name) for v, name in zip(arrays, ("a1", "b1", "a2", "b2"), strict=True))
    if not v1.shape == w1.shape == v2.shape == w2.shape:
        raise StatsError(f"matched values need equal lengths, got {[v.size for v in (v1, w1, v2, w2)]}")
    d1, d2 = v1 - w1, v2 - w2
    ci = paired_diff_ci(d1, d2, clusters=clusters, n_boot=n_boot, seed=seed, level=level, rates=False)
    p = paired_p(d1, d2, clusters=clusters, n_boot=n_boot, seed=seed, rates=False)
    groups = _groups(clusters, d1.size)
    if not rates or _one_cache(groups):
        return ci, p
    if not all(np.all((v == 0) | (v == 1)) for v in (v1, w1, v2, w2)):
        raise StatsError("a difference of rate differences needs 0/1 (or boolean) values")
    n_eff = d1.size / _design_effect(d1 - d2, groups, n_boot, seed)

    def bounds(at: float) -> tuple[float, float]:
        (l1, u1), (l2, u2) = (paired_rate_interval(x, y, n_eff=n_eff, level=at) for x, y in ((v1, w1), (v2, w2)))
        t1, t2 = d1.mean(), d2.mean()
        return (
            max(-2.0, (t1 - t2) - float(np.sqrt((t1 - l1) ** 2 + (u2 - t2) ** 2))),
            min(2.0, (t1 - t2) + float(np.sqrt((u1 - t1) ** 2 + (t2 - l2) ** 2))),
        )

    lo, hi = bounds(level)
    widened = CI(ci.mean, min(ci.lo, lo), max(ci.hi, hi), ci.n, level, ci.n_clusters)
    return widened, max(p, score_p(bounds, float(d1.mean() - d2.mean())))


def holm(pvalues) -> list[float]:
    """Holm's step-down adjusted p-values for a family of comparisons named before the run.

    Parameters
    ----------
    pvalues : sequence of float
        ``[m]`` raw p-values in the family's order.

    Returns
    -------
    list of float
        ``[m]`` adjusted p-values, same order: reject comparison ``i`` at level alpha when
        ``adjusted[i] <= alpha``; the family-wise error rate stays below alpha.
    """
    p = finite_values(pvalues, "pvalues")
    if np.any((p < 0) | (p > 1)):
        raise StatsError("p-values must lie in [0, 1]")
    m = p.size
    order = np.argsort(p, kind="stable")
    adjusted = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return [float(v) for v in adjusted]


def paired_family(comparisons, *, n_boot: int = N_BOOT, seed: int = 0) -> list[dict]:
    """A family of paired comparisons named before the run: each one's interval, raw p and Holm p.

    Parameters
    ----------
    comparisons : iterable of (dict, array-like, array-like, sequence)
        ``(what, a, b, clusters)`` per comparison, in the family's order: ``what`` names it
        (any keys), ``a`` and ``b`` are ``[n]`` paired values and ``clusters`` their ``[n]``
        cache labels, as for :func:`paired_diff_ci`.

    Returns
    -------
    list of dict
        ``what`` with ``ci`` (:func:`paired_diff_ci`), ``p`` (:func:`paired_p`) and ``p_holm``
        (:func:`holm` over the whole family) added, same order.
    """
    out = [
        what
        | {
            "ci": paired_diff_ci(a, b, clusters=clusters, n_boot=n_boot, seed=seed),
            "p": paired_p(a, b, clusters=clusters, n_boot=n_boot, seed=seed),
        }
        for what, a, b, clusters in comparisons
    ]
    for r, adj in zip(out, holm([r["p"] for r in out]), strict=True):
        r["p_holm"] = adj
    return out
