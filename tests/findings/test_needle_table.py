"""The needle study's family pairs per question and resamples by haystack (kvlab.findings.needle_table)."""

from __future__ import annotations

import random

import pytest

from kvlab.findings import needle_table

DESIGN = {
    "primary": "exact match",
    "arms": ["naive", "rerotate", "reprefill"],
    "family": ["rerotate - naive", "rerotate - naive: truth NLL", "naive - reprefill: distractor captured"],
}


def rows(n_sets: int = 12, seed: int = 0) -> list[dict]:
    """Synthetic rows: rerotate right where naive is wrong on a third of the questions; naive captures more."""
    rng = random.Random(seed)
    out = []
    for s in range(n_sets):
        for c in range(2):
            base = {"n_fragments": 2, "fragment_tokens": 256, "set": s, "cache": c, "question": f"q{s}{c}"}
            ref = rng.random() < 0.8
            hard = rng.random() < 0.35
            for arm, em, nll in [("reprefill", ref, 1.0), ("rerotate", ref, 1.2), ("naive", ref and not hard, 2.0)]:
                out.append(
                    base | {"strategy": arm, "em": em, "ref_em": ref, "nll": nll + rng.random() / 10,
                            "captured": not em and arm == "naive", "needle_fragment": c}
                )  # fmt: skip
    return out


def test_the_family_is_paired_per_question_and_resampled_by_haystack():
    got = needle_table.family(rows(), DESIGN)
    assert [r["label"] for r in got] == DESIGN["family"]
    em, nll, cap = got
    assert em["outcome"] == "exact match" and em["ci"].n == 24 and em["ci"].n_clusters == 12
    assert em["ci"].mean > 0 and nll["ci"].mean < -0.5 and cap["ci"].mean > 0
    assert all(r["p_holm"] >= r["p"] for r in got)


def test_swapping_the_arms_flips_the_sign_and_an_unknown_outcome_is_refused():
    flipped = needle_table.family(rows(), DESIGN | {"family": ["naive - rerotate"]})[0]
    assert flipped["ci"].mean == pytest.approx(-needle_table.family(rows(), DESIGN)[0]["ci"].mean)
    with pytest.raises(KeyError, match="no outcome"):
        needle_table.family(rows(), DESIGN | {"family": ["naive - rerotate: agreement"]})


def test_pairing_is_by_cache_and_question_not_by_position():
    rs = rows()
    # the same rows in another order give the same family: pairs are found by key, not by place
    shuffled = rs[:]
    random.Random(1).shuffle(shuffled)
    a, b = needle_table.family(rs, DESIGN), needle_table.family(shuffled, DESIGN)
    assert [r["ci"].mean for r in a] == pytest.approx([r["ci"].mean for r in b])
    # a question missing from one arm drops out of that comparison only
    fewer = [r for r in rs if not (r["strategy"] == "naive" and r["set"] == 0 and r["cache"] == 0)]
    assert needle_table.family(fewer, DESIGN)[0]["ci"].n == 23


def test_arms_report_the_reference_right_stratum():
    a = {r["arm"]: r for r in needle_table.arms(rows(), DESIGN)}
    ref = a["reprefill"]
    assert ref["n_right"] == sum(r["ref_em"] for r in rows() if r["strategy"] == "reprefill")
    assert ref["em_right"].mean == 1.0 and ref["em_right"].lo < 1.0  # a rate's interval never collapses at 1
    assert a["naive"]["em_right"].mean < 1.0
