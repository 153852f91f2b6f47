"""The foreign-reader study of notebook 03: producer files, forced reads, intervals over caches, conclusions."""

from __future__ import annotations

import math

import pytest

import kvlab
from conftest import tiny
from kvlab.findings import readers as study


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    m = tiny("tiny-llama")
    caches, exact = study.producer_caches(
        m, tmp_path_factory.mktemp("producer"), 3, n_passages=2, passage_tokens=24, people_per_passage=1, seed=5
    )
    return m, caches, exact


def test_one_file_per_seed_each_reloaded_bit_exact(made):
    m, caches, exact = made
    assert exact and len(caches) == 3 and len({c.text for c in caches}) == 3
    for c in caches:
        assert c.path.exists() and len(c.probes) == len(c.questions) > 0
        assert kvlab.read_header(c.path)["length"] == c.tokens


def test_the_producer_as_its_own_reader_moves_nothing(made):
    m, caches, _ = made
    rows = study.forced_reads({"self": m, "finetune": kvlab.variants(m, "finetune", steps=2)}, caches)
    assert len(rows) == 2 * sum(len(c.questions) for c in caches)
    own = [r for r in rows if r["reader"] == "self"]
    assert all(r["kl"] == 0.0 and r["span_kl"] == 0.0 and r["dnll"] == 0.0 and not r["flip"] for r in own)
    other = [r for r in rows if r["reader"] == "finetune"]
    assert all(r["span_kl"] > 0 and math.isfinite(r["dnll"]) for r in other)
    assert {r["cache"] for r in other} == {0, 1, 2}
    ci = study.summarize(rows, seed=0)
    assert ci["self", "span_kl"].mean == 0.0 and ci["finetune", "span_kl"].n_clusters == 3
    # No flip in n reads is a rate with an upper bound above 0, never [0, 0].
    assert ci["self", "flip"].mean == 0.0 and ci["self", "flip"].hi > 0
    d = study.paired(rows, "finetune", "self", seed=0)
    assert d.n == len(other) and d.mean == pytest.approx(ci["finetune", "span_kl"].mean)
    assert study.unreadable({"self": m}, rows, caches[0]) == {}
    assert study.unreadable({"self": m}, [dict(own[0], kl=float("nan"))], caches[0]) == {"self": True}


def synthetic(first_kl: float, span_kl: float) -> list[dict]:
    rows = []
    for reader, scale in (("a", 1.0), ("b", 0.01)):
        for cache in range(6):
            for j in range(4):
                wiggle = 1 + 0.1 * ((cache + j) % 3)
                rows.append(
                    {
                        "reader": reader,
                        "cache": cache,
                        "kind": "year",
                        "kl": first_kl * scale * wiggle,
                        "span_kl": span_kl * scale * wiggle,
                        "dnll": 0.1 * scale * wiggle,
                        "flip": j == 0 and reader == "a",
                    }
                )
    return rows


@pytest.mark.parametrize(("first_kl", "claimed"), [(1e-4, True), (1e-2, False)])
def test_conclusions_say_what_the_numbers_show(first_kl, claimed):
    rows = synthetic(first_kl, 1e-2)
    ci = study.summarize(rows, seed=0)
    lines = study.conclusions(
        rows,
        ci,
        model_name="m",
        refused=True,
        cross_named="architecture",
        primary=("a", "b"),
        diff=study.paired(rows, "a", "b", seed=0),
        first={"year": [" "]},
        unreadable_={},
    )
    assert lines[0].startswith("On m, forced through, the a reader") and "(resolved)" in lines[0]
    assert "over 24 questions from 6 independent caches" in lines[1]
    assert "intervals do not overlap" in lines[2] and "a - b" in lines[2]
    assert "a reader's top-1 first-token flip rate is 0.250 [" in lines[3]
    # The first token is said to miss the answer only where its interval lies below the span's.
    assert any("misses" in line for line in lines) == claimed
    table = study.table(rows, ci, ["a", "b"], {}, "m")
    assert "24 questions over 6 caches" in table and "6/24 [" in table
