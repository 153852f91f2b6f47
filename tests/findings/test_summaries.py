"""longctx.summarize: intervals over caches, and agreement counted only where the reference is right."""

from __future__ import annotations

from kvlab.findings import longctx


def row(cache, q, strategy, *, kl, em, agree, ref_answer, ref_em):
    return {"n_fragments": 2, "set": cache, "question": q, "strategy": strategy, "kl": kl, "em": em,
            "agree": agree, "ref_answer": ref_answer, "ref_em": ref_em}  # fmt: skip


def test_summaries_are_over_caches_and_ignore_a_wrong_reference():
    rows = []
    for cache in range(3):
        for q in range(4):
            right = q < 2  # the reference answers half the questions right ...
            ref = f"town{q}" if right else "Didun"  # ... and the rest with one repeated wrong string
            rows.append(row(cache, q, "rerotate", kl=0.1 * (cache + 1), em=right, agree=True, ref_answer=ref,
                            ref_em=right))  # fmt: skip
    (s,) = longctx.summarize(rows)
    assert (s["n"], s["n_caches"], s["n_ref_right"]) == (12, 3, 6)
    assert s["agree"].mean == 1.0 and s["agree"].lo < 1.0  # a rate of 12/12 keeps an interval
    assert s["agree_right"].n == 6 and s["agree_right"].n_clusters == 3
    assert s["ref_top_share"] == 0.5  # "Didun" is half the reference's answers
    assert s["kl"].n_clusters == 3 and s["kl"].lo <= 0.2 <= s["kl"].hi
    never = [dict(r, ref_em=False) for r in rows]
    assert longctx.summarize(never)[0]["agree_right"] is None


def test_paired_differences_resample_caches():
    rows = [row(c, q, s, kl=kl + 0.01 * c, em=False, agree=False, ref_answer="x", ref_em=False)
            for c in range(4) for q in range(3) for s, kl in (("naive", 0.5), ("rerotate", 0.2))]  # fmt: skip
    d = longctx.paired(rows, "naive", "rerotate", "kl")
    assert d.n == 12 and d.n_clusters == 4 and abs(d.mean - 0.3) < 1e-12


def test_gap_closed_pairs_questions_and_states_caches():
    rows = [row(c, q, s, kl=kl * (1 + 0.1 * c), em=False, agree=False, ref_answer="x", ref_em=False)
            for c in range(5) for q in range(4) for s, kl in (("recompute", 0.3), ("rerotate", 0.4))]  # fmt: skip
    g = longctx.gap_closed(rows, "recompute", "rerotate", "kl")
    assert g.n == 20 and g.n_clusters == 5 and abs(g.mean - 0.25) < 1e-12
    assert abs(g.lo - 0.25) < 1e-9 and abs(g.hi - 0.25) < 1e-9  # the same ratio in every cache


def test_at_scale_states_n_caches_intervals_and_the_ceiling():
    ci = {"mean": 0.5, "lo": 0.25, "hi": 0.75, "n": 24, "caches": 20}
    doc = {
        "model": "m",
        "args": {"tokens": 512},
        "summary": [
            {"n_fragments": 2, "strategy": s, "n": 24, "n_caches": 20, "span_kl": ci, "em": ci}
            for s in ("naive", "rerotate", "reprefill")
        ],
        "paired_differences": {
            "2 fragments: naive - rerotate span_kl": dict(ci, lo=0.1),
            "2 fragments: naive - rerotate em": dict(ci, lo=-0.1),
        },
        "gap_closed": {"2 fragments: recompute r=0.15 closes of rerotate's span KL": ci},
    }
    (line,) = longctx.at_scale(doc, "results/x.json")
    assert "24 questions over 20 caches (results/x.json)" in line
    assert "(paired difference +0.5000 [+0.1000, +0.7500], resolved)" in line
    assert "ceiling 0.50 [0.25, 0.75]" in line and "closes 50% [25%, 75%]" in line
