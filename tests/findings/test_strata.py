"""strata: count 1 left out, strata that split a pooled difference, Holm within the family."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlab.findings import strata

ROOT = Path(__file__).resolve().parents[2]


def rows():
    """3 counts (1, 2, 2-with-two-passages) x 4 caches x 4 questions; naive better on passage 0, worse on 1."""
    out = []
    for k in (1, 2):
        for cache in range(4):
            for q in range(4):
                p = q % 2
                for s in ("naive", "rerotate"):
                    kl = 0.5 if k == 1 else (0.2 if (s == "naive") == (p == 0) else 0.6) + 0.01 * cache
                    out.append(
                        {
                            "n_fragments": k,
                            "set": cache,
                            "question": f"q{q}",
                            "strategy": s,
                            "answer_passage": p,
                            "span_kl": kl,
                            "nll": kl,
                            "em": False,
                            "ref_em": q < 2,
                        }  # fmt: skip
                    )
    return out


def test_count_one_is_left_out_and_passages_split_the_pooled_difference():
    res = strata.compare(rows())
    assert {r["n_fragments"] for r in res} == {2}
    by = {(r["stratum"], r["metric"]): r for r in res}
    assert by["pooled", "span_kl"]["ci"].mean == pytest.approx(0.0)
    assert by["passage 0", "span_kl"]["ci"].mean == pytest.approx(-0.4) and by["passage 0", "span_kl"]["ci"].hi < 0
    assert by["passage 1", "span_kl"]["ci"].mean == pytest.approx(0.4) and by["passage 1", "span_kl"]["ci"].n == 8
    assert by["reference right", "span_kl"]["ci"].n == 8 and by["reference right", "span_kl"]["ci"].n_clusters == 4
    # Holm within the metric's family: each adjusted p at least its raw p, the family named.
    fam = [r for r in res if r["metric"] == "span_kl"]
    assert all(r["p_holm"] >= r["p"] for r in fam) and len({r["family"] for r in fam}) == 1
    assert min(r["p_holm"] for r in fam) == pytest.approx(len(fam) * min(r["p"] for r in fam))


def test_the_results_page_shows_the_strata_the_committed_rows_give():
    page = (ROOT / "results" / "README.md").read_text()
    for model in ("smollm2-135m", "gemma3-270m"):
        table = strata.markdown(model, strata.read_rows(ROOT / "results" / f"long_context_{model}.csv"))
        assert table in page, f"results/README.md's {model} strata table is not what the rows give"
