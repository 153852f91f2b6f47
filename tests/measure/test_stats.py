"""Intervals over the unit that varies: cluster bootstrap, proportions that never collapse, Holm."""

from __future__ import annotations

import numpy as np
import pytest

from kvlab.errors import StatsError
from kvlab.measure import stats
from kvlab.measure.scores import paired_rate_interval
from kvlab.measure.stats import (
    fmt_ci,
    gap_closed_ci,
    holm,
    mean_ci,
    paired_did,
    paired_diff_ci,
    paired_family,
    paired_p,
    proportion_ci,
)


def clustered(rng, caches: int, per: int, between: float = 1.0, within: float = 0.3):
    """Values that share a cache effect: ``caches`` caches of ``per`` items each, true mean 0."""
    effect = rng.normal(0, between, caches)
    values = np.concatenate([effect[c] + rng.normal(0, within, per) for c in range(caches)])
    return values, np.repeat(np.arange(caches), per)


def test_proportions_never_collapse_at_0_or_1():
    none, every = proportion_ci([0] * 48), proportion_ci([1] * 6)
    assert none.lo == 0 and none.hi == pytest.approx(0.0741, abs=1e-4)  # exact bounds of the issue
    assert every.hi == 1 and every.lo == pytest.approx(0.610, abs=1e-3)  # Wilson; Clopper-Pearson: 0.54
    assert proportion_ci([1, 0] * 10).lo < 0.5 < proportion_ci([1, 0] * 10).hi
    # Clustered 0/1 data: the interval is at least as wide as the items-alone Wilson one.
    answers = [1] * 10 + [0] * 10 + [1] * 3 + [0] * 17
    by_cache = proportion_ci(answers, clusters=[0] * 20 + [1] * 20)
    alone = proportion_ci(answers)
    assert by_cache.n_clusters == 2 and by_cache.hi - by_cache.lo > alone.hi - alone.lo
    with pytest.raises(StatsError, match="0/1"):
        proportion_ci([0.5, 1])


def test_cluster_bootstrap_widens_for_shared_caches_and_states_them():
    rng = np.random.default_rng(0)
    x, caches = clustered(rng, caches=4, per=12)
    alone, by_cache = mean_ci(x), mean_ci(x, clusters=caches)
    assert alone.n_clusters is None and by_cache.n_clusters == 4 and by_cache.n == 48
    assert by_cache.hi - by_cache.lo > 2 * (alone.hi - alone.lo)
    assert "caches=4" in format(by_cache) and by_cache.mean == alone.mean
    # One item per cache is the items-alone bootstrap again (same spread, up to resampling noise).
    singles = mean_ci(x, clusters=range(48), n_boot=4000)
    assert singles.hi - singles.lo == pytest.approx(mean_ci(x, n_boot=4000).hi - mean_ci(x, n_boot=4000).lo, rel=0.15)


def test_cluster_intervals_cover_and_item_intervals_do_not():
    # 120 simulated studies of 6 caches x 8 questions with a shared cache effect, true mean 0.
    rng = np.random.default_rng(1)
    covered = {"caches": 0, "items": 0}
    for _ in range(120):
        x, caches = clustered(rng, caches=6, per=8)
        covered["caches"] += (
            mean_ci(x, clusters=caches, n_boot=400).lo <= 0 <= mean_ci(x, clusters=caches, n_boot=400).hi
        )
        covered["items"] += mean_ci(x, n_boot=400).lo <= 0 <= mean_ci(x, n_boot=400).hi
    # Measured 0.89 and 0.43 (two-stage: 0.92): the percentile bootstrap over 6 caches undercovers a little; resampling
    # questions as if independent misses the truth most of the time.
    assert covered["caches"] / 120 > 0.8 and covered["items"] / 120 < 0.6


def test_paired_differences_stay_within_their_cache():
    rng = np.random.default_rng(2)
    a, caches = clustered(rng, caches=5, per=10)
    b = a - 0.2 + rng.normal(0, 0.05, a.size)  # the cache effect is shared, so it cancels in a - b
    d = paired_diff_ci(a, b, clusters=caches)
    assert d.n_clusters == 5 and d.lo > 0.15 and d.hi < 0.25
    assert paired_p(a, b, clusters=caches, n_boot=1000) == pytest.approx(1 / 1000)
    assert paired_p(a, a) == 1.0
    with pytest.raises(StatsError, match="labels for"):
        mean_ci(a, clusters=caches[:-1])


def test_holm_adjusts_a_family():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5]) == [0.5] and holm([0.2, 0.9]) == pytest.approx([0.4, 0.9])
    with pytest.raises(StatsError):
        holm([1.5])


def test_gap_closed_is_one_minus_the_ratio_of_means_resampled_in_pairs():
    rng = np.random.default_rng(0)
    caches = np.repeat(np.arange(20), 6)
    baseline = rng.gamma(2.0, 1.0, caches.size)
    half = gap_closed_ci(baseline / 2, baseline, clusters=caches)
    # Treated is exactly half the baseline, pair by pair: every resample's ratio is 0.5.
    assert half.mean == pytest.approx(0.5) and half.lo == pytest.approx(0.5) and half.hi == pytest.approx(0.5)
    assert half.n == 120 and half.n_clusters == 20
    noisy = gap_closed_ci(baseline * rng.uniform(0.2, 0.8, caches.size), baseline, clusters=caches)
    assert noisy.lo < noisy.mean < noisy.hi and 0.2 < noisy.lo and noisy.hi < 0.8
    worse = gap_closed_ci(baseline * 1.5, baseline)
    assert worse.mean == pytest.approx(-0.5)
    with pytest.raises(StatsError, match="positive mean"):
        gap_closed_ci([0.0, 0.0], [0.0, 0.0])
    with pytest.raises(StatsError, match="equal lengths"):
        gap_closed_ci([1.0], [1.0, 2.0])


def test_the_cluster_bootstrap_keeps_every_question_of_a_drawn_cache():
    # Two caches: every resample is cache 0 twice, cache 1 twice or one of each, so its mean is
    # 1.0, 2.0 or 1.5, and the 2.5% / 97.5% percentiles are exactly the two cache means (each of
    # "both draws the same cache" has probability 1/4). Resampling questions within caches would
    # put means between and beyond them.
    x = [0.0, 2.0, 1.0, 1.0, 3.0, 2.0]  # cache 0 mean 1.0 (spread), cache 1 mean 2.0 (spread)
    caches = [0, 0, 0, 1, 1, 1]
    ci = mean_ci(x, clusters=caches, n_boot=4000)
    assert (ci.lo, ci.hi) == (1.0, 2.0) and ci.mean == 1.5 and ci.n_clusters == 2
    from kvlab.measure.stats import _groups, _resample_means

    means = _resample_means(np.asarray(x), _groups(caches, 6), 4000, 0)
    assert set(np.round(means, 12)) == {1.0, 1.5, 2.0}
    two = mean_ci(x, clusters=caches, n_boot=4000, two_stage=True)
    assert two.lo < 1.0 and two.hi > 2.0  # the sensitivity scheme, wider


def test_unequal_caches_weigh_by_their_questions():
    # Cache 0 holds one question (0.0), cache 1 three (each 4.0): a resample of one of each is the
    # pooled mean of its 4 questions, 3.0, not the mean of the two cache means, 2.0.
    from kvlab.measure.stats import _groups, _resample_means

    means = _resample_means(np.array([0.0, 4.0, 4.0, 4.0]), _groups([0, 1, 1, 1], 4), 1000, 0)
    assert set(np.round(means, 12)) == {0.0, 3.0, 4.0}


def test_equal_caches_give_the_bootstrap_of_the_per_cache_means():
    rng = np.random.default_rng(3)
    x, caches = clustered(rng, caches=7, per=6)
    per_cache = x.reshape(7, 6).mean(axis=1)
    by_cache = mean_ci(x, clusters=caches, seed=5)
    of_means = mean_ci(per_cache, seed=5)  # the same draws of 7 out of 7
    assert by_cache.lo == pytest.approx(of_means.lo, abs=1e-12) and by_cache.hi == pytest.approx(of_means.hi, abs=1e-12)
    # Paired: differences per question, then averaged by cache, is the bootstrap of per-cache mean differences.
    b = x - rng.normal(0.3, 0.5, x.size)
    d = paired_diff_ci(x, b, clusters=caches, seed=5)
    dm = mean_ci((x - b).reshape(7, 6).mean(axis=1), seed=5)
    assert (d.lo, d.hi) == pytest.approx((dm.lo, dm.hi), abs=1e-12) and d.n == 42 and d.n_clusters == 7


def test_a_rate_by_cache_never_collapses_even_when_every_cache_agrees():
    # 0 of 40 over 4 caches: the cluster bootstrap is [0, 0]; the Wilson floor keeps an interval.
    c = proportion_ci([0] * 40, clusters=np.repeat(np.arange(4), 10))
    assert c.lo == 0 and c.hi > 0.05 and c.n_clusters == 4
    c = proportion_ci([1] * 40, clusters=np.repeat(np.arange(4), 10))
    assert c.hi == 1 and c.lo < 0.95


def test_one_formatter_for_intervals_and_their_file_form():
    c = mean_ci([1.0, 2.0, 3.0], clusters=[0, 0, 1])
    assert fmt_ci(c, ".2f") == fmt_ci(c.as_dict(), ".2f") == f"{c.mean:.2f} [{c.lo:.2f}, {c.hi:.2f}]"
    assert fmt_ci(None) == "-" and fmt_ci({"mean": 0.5, "lo": 0.25, "hi": 1}, "+.0%") == "+50% [+25%, +100%]"
    assert format(c, ".2f") == fmt_ci(c, ".2f") + " (n=3, caches=2)"


def test_a_paired_family_is_each_comparison_with_holm_over_all():
    rng = np.random.default_rng(3)
    clusters = np.repeat(np.arange(6), 4)
    base = rng.normal(size=24)
    shifts = (0.0, 0.05, 0.8)  # one null, one small, one large effect
    named = [({"name": f"shift {d}"}, base + d + rng.normal(0, 0.3, 24), base, clusters) for d in shifts]
    got = paired_family(named, seed=1)
    raw = [paired_p(a, b, clusters=c, seed=1) for _, a, b, c in named]
    assert [g["name"] for g in got] == [f"shift {d}" for d in shifts]
    assert [g["p"] for g in got] == raw
    assert [g["p_holm"] for g in got] == holm(raw)
    for g, (_, a, b, c) in zip(got, named):
        assert g["ci"] == paired_diff_ci(a, b, clusters=c, seed=1)
    # The adjustment is over the family: the smallest p is multiplied by the family's size.
    assert min(g["p_holm"] for g in got) == pytest.approx(min(1.0, 3 * min(raw)))


def test_one_cache_gives_no_interval_and_resolves_nothing():
    # Six questions of one cache differ by a large, steady amount: the bootstrap over one cache
    # would give a zero-width interval and the smallest p; nothing is known of how caches vary.
    a, b, one = [1.0, 1.2, 0.9, 1.1, 1.0, 1.3], [0.0] * 6, [7] * 6
    for c in (
        mean_ci(a, clusters=one),
        paired_diff_ci(a, b, clusters=one),
        proportion_ci([1, 0, 1, 1, 0, 1], clusters=one),
        gap_closed_ci(b, a, clusters=one),
    ):
        assert c.lo != c.lo and c.hi != c.hi and c.n_clusters == 1 and c.n == 6 and not c.excludes(0.0)
        assert fmt_ci(c, ".2f") == f"{c.mean:.2f} [one cache: no interval]" == fmt_ci(c.as_dict(), ".2f")
    assert paired_p(a, b, clusters=one) == 1.0
    assert paired_family([({}, a, b, one), ({}, a, b, one)])[0]["p_holm"] == 1.0
    # Two caches already give an interval; items without caches are resampled alone.
    two = [7, 7, 7, 8, 8, 8]
    assert paired_diff_ci(a, b, clusters=two).excludes(0.0) and paired_p(a, b, clusters=two) < 0.05
    assert paired_diff_ci(a, b).excludes(0.0)


def test_a_paired_difference_of_rates_is_newcombes_interval_and_never_collapses():
    # Fagerland, Lydersen and Laake (2017), chapter 8: 59 pairs both right, 6 and 16 discordant, 80 neither.
    a = np.array([1] * 59 + [1] * 6 + [0] * 16 + [0] * 80, dtype=bool)
    b = np.array([1] * 59 + [0] * 6 + [1] * 16 + [0] * 80, dtype=bool)
    lo, hi = paired_rate_interval(a, b)
    assert (lo, hi) == pytest.approx((-0.1186, -0.0046), abs=5e-5)
    # The pairing (phi) narrows it: the two rates' Wilson intervals combined as if independent span about 0.21.
    assert paired_rate_interval(a, b, n_eff=161) == (lo, hi) and hi - lo < 0.12
    c = paired_diff_ci(a, b)
    assert c.lo <= lo and c.hi >= hi and c.mean == pytest.approx(-10 / 161)
    # No pair disagrees in 72 questions over 12 caches: the bootstrap alone says [0, 0].
    same = np.array([True] * 7 + [False] * 65)
    caches = np.repeat(np.arange(12), 6)
    alone = paired_diff_ci(same, same, clusters=caches, rates=False)
    assert (alone.lo, alone.hi) == (0.0, 0.0)
    d = paired_diff_ci(same, same, clusters=caches)
    assert d.lo < -0.03 and d.hi > 0.03 and not d.excludes(0.0) and d.n_clusters == 12
    # Booleans are rates by default; 0/1 of another dtype must be named (read as measurements they
    # collapsed to [0, 0] silently); other values are refused as rates.
    assert paired_diff_ci(same * 1.0, same * 1.0, clusters=caches, rates=True) == d
    for call in (paired_diff_ci, paired_p):
        with pytest.raises(StatsError, match="rates=True"):
            call(same * 1.0, same * 1, clusters=caches)
    with pytest.raises(StatsError, match="rates=True"):
        paired_did(same * 1, same * 1, same * 1, same * 1, clusters=caches)
    assert paired_diff_ci(same * 1.0, same * 1.0, clusters=caches, rates=False) == alone
    assert paired_diff_ci(same * 1.0 + 0.5, same * 1.0, clusters=caches).mean == 0.5  # measurements pass
    with pytest.raises(StatsError, match="0/1"):
        paired_diff_ci([0.5, 1.0], [0.0, 1.0], rates=True)
    # Clustered rates count for fewer pairs: wider than the items-alone score interval.
    rng = np.random.default_rng(4)
    skill = np.repeat(rng.random(8) < 0.5, 9)
    x, y = skill ^ (rng.random(72) < 0.1), skill ^ (rng.random(72) < 0.1)
    by_cache = paired_diff_ci(x, y, clusters=np.repeat(np.arange(8), 9))
    assert by_cache.hi - by_cache.lo >= np.subtract(*paired_rate_interval(x, y)[::-1]) - 1e-12


def test_a_rate_difference_is_resolved_by_its_p_only_where_its_interval_excludes_0():
    # Few caches: the bootstrap p alone called differences resolved whose widened interval held 0.
    rng = np.random.default_rng(5)
    for _ in range(200):
        k, per = rng.integers(3, 10), rng.integers(2, 9)
        skill = np.repeat(rng.random(k) < rng.random(), per)
        x, y = (skill ^ (rng.random(k * per) < rng.random() * 0.5) for _ in range(2))
        caches = np.repeat(np.arange(k), per)
        p = paired_p(x, y, clusters=caches)
        assert (p < 0.05) == paired_diff_ci(x, y, clusters=caches).excludes(0.0)
        assert p >= paired_p(x, y, clusters=caches, rates=False)
    same = np.array([True, False] * 12)
    assert paired_p(same, same, clusters=np.repeat(np.arange(4), 6)) == 1.0


def test_a_difference_of_rate_differences_is_movers_combination_and_never_collapses():
    rng = np.random.default_rng(6)
    caches = np.repeat(np.arange(4), 6)
    # No question changes its answer between the strategies in either cell: the bootstrap says [0, 0].
    right = rng.random(24) < 0.5
    ci, p = paired_did(right, right, ~right, ~right, clusters=caches)
    assert ci.lo < -0.05 and ci.hi > 0.05 and p == 1.0 and ci.n_clusters == 4
    # The widened interval is the MOVER combination of the two cells' Newcombe intervals.
    a1, b1, a2, b2 = (rng.random(24) < q for q in (0.2, 0.7, 0.5, 0.5))
    ci, p = paired_did(a1, b1, a2, b2, clusters=caches)
    n_eff = 24 / stats._design_effect((a1 * 1.0 - b1) - (a2 * 1.0 - b2), stats._groups(caches, 24), 2000, 0)
    (l1, u1), (l2, u2) = paired_rate_interval(a1, b1, n_eff=n_eff), paired_rate_interval(a2, b2, n_eff=n_eff)
    t1, t2 = a1.mean() - b1.mean(), a2.mean() - b2.mean()
    assert ci.lo <= (t1 - t2) - np.hypot(t1 - l1, u2 - t2) + 1e-12
    assert ci.hi >= (t1 - t2) + np.hypot(u1 - t1, t2 - l2) - 1e-12
    assert (p < 0.05) == ci.excludes(0.0)
    # Numbers that are not rates: the bootstrap of the differences of differences, as paired_diff_ci gives it.
    x = [rng.normal(size=24) for _ in range(4)]
    got, q = paired_did(*x, clusters=caches)
    assert got == paired_diff_ci(x[0] - x[1], x[2] - x[3], clusters=caches)
    assert q == paired_p(x[0] - x[1], x[2] - x[3], clusters=caches)
