"""The recompute curve's r90: where a policy's share of rerotate's answer-span KL removed reaches 90%, with its interval.

The curve runs through (0, 0), the measured ratios and (r*, 1), r* = (N - L0) / N the mean over the
sample's caches (each cache's from its rows); r90 is read on it by linear interpolation, and its 95%
interval resamples the caches (the whole curve and r* with them). ``studies/recompute_curve.py``
runs the study; ``kvlab.findings.summary`` words SUMMARY's line from these intervals.
"""

from __future__ import annotations

import numpy as np

from kvlab.errors import KvlabError
from kvlab.findings import longctx

TARGET = 0.9
N_BOOT = 2000


def label(policy: str, r: float) -> str:
    return f"{policy} r={r:g}"


def crossing(ratios, shares, target: float = TARGET, end: float = 1.0) -> float:
    """The first ratio where the piecewise-linear curve through (0, 0), the points and (end, 1) reaches ``target``.

    Measured ratios at or beyond ``end`` are left out: the curve is 1 from ``end`` on.
    """
    keep = [(x, y) for x, y in zip(ratios, shares) if x < end]
    xs, ys = [0.0, *(x for x, _ in keep), end], [0.0, *(y for _, y in keep), 1.0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y0 < target <= y1:
            return x0 + (target - y0) * (x1 - x0) / (y1 - y0)
    return 0.0 if ys[0] >= target else end


def bracket(ratios, shares, target: float = TARGET, end: float = 1.0) -> tuple[float, float | None]:
    """The segment of :func:`crossing`'s curve where it reaches ``target``: ``(lo, hi)`` measured ratios
    (``lo`` 0 for the origin), or ``(last measured ratio, None)`` when the crossing lies on the line to ``(end, 1)``
    (interpolated towards r*, not between two measurements)."""
    keep = [(x, y) for x, y in zip(ratios, shares) if x < end]
    xs, ys = [0.0, *(x for x, _ in keep)], [0.0, *(y for _, y in keep)]
    for i in range(1, len(xs)):
        if ys[i - 1] < target <= ys[i]:
            return xs[i - 1], xs[i]
    return xs[-1], None


def r_star(rows: list[dict]) -> dict:
    """Each cache's r* = (N - L0) / N from its rows: ``cache -> r*`` (caches as :func:`kvlab.findings.longctx.cache_of`)."""
    out = {}
    for r in rows:
        c = longctx.cache_of(r)
        v = (r["total_tokens"] - r["first_tokens"]) / r["total_tokens"]
        if out.setdefault(c, v) != v:
            raise KvlabError(f"cache {c}: rows disagree on its token counts")
    return out


def r90(rows: list[dict], policy: str, ratios, seed: int) -> dict:
    """``r90`` of one policy, its cluster-bootstrap interval (caches resampled, the curve and r* with them), and r*."""
    caches = sorted({longctx.cache_of(r) for r in rows})
    index = {c: i for i, c in enumerate(caches)}
    names = ["rerotate", *(label(policy, r) for r in ratios)]
    sums = np.zeros((len(caches), len(names)))
    for r in rows:
        if r["strategy"] in names:
            sums[index[longctx.cache_of(r)], names.index(r["strategy"])] += float(r["span_kl"])
    stars = r_star(rows)
    ends = np.array([stars[c] for c in caches])
    curve = 1 - sums[:, 1:].sum(0) / sums[:, 0].sum()
    point = crossing(ratios, curve, end=float(ends.mean()))
    between = bracket(ratios, curve, end=float(ends.mean()))
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(caches), size=(N_BOOT, len(caches)))
    boot = [crossing(ratios, 1 - s[1:] / s[0], end=float(e)) for s, e in zip(sums[draws].sum(1), ends[draws].mean(1))]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {
        "mean": point,
        "lo": float(lo),
        "hi": float(hi),
        "caches": len(caches),
        "r_star": float(ends.mean()),
        "r_star_min": float(ends.min()),
        "r_star_max": float(ends.max()),
        "between": list(between),
    }
