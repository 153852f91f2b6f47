"""The recompute-window study: its section is printed from its rows, on the haystack study's own caches.

No model is run: the committed rows (``results/recompute_window_<model>.csv``) are read back, the
README section is compared with what ``studies/recompute_window.py --markdown`` prints from them,
and the caches are checked to be the haystack study's at 2 fragments (same questions, truths,
needle positions and merge lengths), so the two studies' numbers can be read side by side.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import study_module

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("smollm2-135m", "gemma3-270m")


@pytest.fixture(scope="module")
def study():
    return study_module("recompute_window")


def rows(name: str, model: str) -> list[dict]:
    from kvlab.findings.haystack_table import TEXT
    from kvlab.findings.rows import read_rows

    return read_rows(ROOT / "results" / f"{name}_{model}.csv", text=TEXT)


@pytest.mark.parametrize("model", MODELS)
def test_the_section_is_printed_from_the_committed_rows(study, model):
    page = (ROOT / "results" / "README.md").read_text()
    printed = study.markdown(rows("recompute_window", model), model)
    assert printed.strip() in page, (
        f"regenerate: .venv/bin/python studies/recompute_window.py --model {model} --markdown"
    )


@pytest.mark.parametrize("model", MODELS)
def test_the_caches_are_the_haystack_studys_at_two_fragments(study, model):
    window = rows("recompute_window", model)
    hay = [r for r in rows("haystack", model) if r["n_fragments"] == 2 and r["layout"] == "single"]
    key = ("set", "question", "truth", "depth", "needle_at", "total_tokens", "first_tokens")

    def cache(r):
        return tuple(r[k] for k in key)

    assert {cache(r) for r in window} == {cache(r) for r in hay}
    assert len({r["set"] for r in window}) == 20 and {r["n_fragments"] for r in window} == {2}
    arms = {r["strategy"] for r in window}
    assert arms == {"rerotate", "reprefill"} | {study.label(p, r) for p in study.POLICIES for r in study.RATIOS}
    # The arms both studies read agree question by question: the same merges of the same caches.
    for arm in ("rerotate", "recompute r=0.15", "reprefill"):
        a = {(r["set"], r["question"]): r for r in window if r["strategy"] == arm}
        b = {(r["set"], r["question"]): r for r in hay if r["strategy"] == arm}
        assert a.keys() == b.keys()
        for q in a:
            assert a[q]["span_kl"] == pytest.approx(b[q]["span_kl"], rel=1e-3, abs=1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_the_selection_table_is_printed_from_its_rows_and_a_random_draw_spreads_evenly(study, model):
    from kvlab.findings.rows import read_rows

    sel = read_rows(ROOT / "results" / f"recompute_window_selection_{model}.csv")
    page = (ROOT / "results" / "README.md").read_text()
    printed = study.selection_markdown(sel, model)
    assert printed.strip() in page, (
        f"regenerate: .venv/bin/python studies/recompute_window.py --model {model} --selection --markdown"
    )
    assert {(r["policy"], r["ratio"]) for r in sel} == {(p, r) for p in study.SELECTIONS for r in study.RATIOS}
    # The places are measured right: a seeded random draw of later tokens puts about a tenth in each tenth.
    for r in study.RATIOS:
        draws = [x for x in sel if x["policy"] == "random_later" and x["ratio"] == r]
        assert abs(sum(x["first_tenth"] for x in draws) / len(draws) - 0.1) < 0.03
        assert abs(sum(x["mean_place"] for x in draws) / len(draws) - 0.5) < 0.05


@pytest.mark.parametrize("model", MODELS)
def test_the_fragment_start_follow_up_reads_the_same_caches_and_is_printed_from_its_rows(study, model):
    follow = rows("recompute_window_fragment_start", model)
    page = (ROOT / "results" / "README.md").read_text()
    printed = study.markdown(follow, model, policies=("fragment_start",))
    assert printed.strip() in page, (
        f"regenerate: .venv/bin/python studies/recompute_window.py --model {model} --policy fragment_start --markdown"
    )
    first = rows("recompute_window", model)
    rerotate = {(r["set"], r["question"]): r["span_kl"] for r in first if r["strategy"] == "rerotate"}
    again = {(r["set"], r["question"]): r["span_kl"] for r in follow if r["strategy"] == "rerotate"}
    assert again.keys() == rerotate.keys()
    assert all(again[q] == pytest.approx(rerotate[q], rel=1e-6, abs=1e-9) for q in again)
    # What the README concludes from it: the later fragment's start, recomputed alone, costs at no ratio.
    fam = study.family(follow, policies=("fragment_start",))
    assert len(fam) == len(study.RATIOS)
    assert not [f for f in fam if f["p_holm"] <= 0.05 and f["ci"].mean > 0]


@pytest.mark.parametrize("model", MODELS)
def test_deviation_spends_much_of_a_small_budget_where_fragment_start_spends_nearly_all(study, model):
    from kvlab.findings.rows import read_rows

    sel = read_rows(ROOT / "results" / f"recompute_window_selection_{model}.csv")

    def first_tenth(policy):
        xs = [x["first_tenth"] for x in sel if x["policy"] == policy and x["ratio"] == min(study.RATIOS)]
        return sum(xs) / len(xs)

    # The README's reason for the second follow-up: at the smallest ratio both sit largely at the start.
    assert first_tenth("deviation") > 0.4 and first_tenth("fragment_start") > 0.9


def test_the_sections_prose_quotes_only_its_tables(study):
    from conftest import intervals, intervals_not_in, results_section
    from kvlab.findings.rows import read_rows

    section = results_section("## Recompute inside Gemma 3's window")
    tables = []
    for model in MODELS:
        tables.append(study.markdown(rows("recompute_window", model), model))
        tables.append(
            study.selection_markdown(read_rows(ROOT / "results" / f"recompute_window_selection_{model}.csv"), model)
        )
        for name, arms in study.FOLLOW_UPS.items():
            tables.append(study.markdown(rows(f"recompute_window_{name}", model), model, policies=arms))
    assert len(intervals(section)) > len(MODELS) * 10, "the section prints its tables"
    assert intervals_not_in(section, "\n".join(tables)) == [], "the prose quotes only intervals its tables print"


@pytest.mark.parametrize("base", ["deviation", "random_later"])
def test_past_start_spends_its_budget_only_past_each_later_fragments_first_tenth(study, base):
    import kvlab
    from conftest import tiny
    from kvlab.cache.recompute.decoder import Decoder
    from kvlab.cache.recompute.select import key_deviation

    m = tiny("tiny-llama")
    words = "keys carry the phase of the place where they were computed".split()
    fs = [kvlab.prefill(m, " ".join(words[i % len(words)] for i in range(n))) for n in (25, 35, 18)]
    lands = kvlab.landing_positions(fs)
    total = lands[-1] + fs[-1].length
    start = {p for f, land in zip(fs[1:], lands[1:]) for p in range(land, land + -(-f.length // 10))}
    allowed = [p for p in range(lands[1], total) if p not in start]
    for r in (0.1, 0.3, 0.9):
        chosen = study.PastStart(ratio=r, policy=base, seed=0).select(fs, lands, m).tolist()
        assert chosen == sorted(set(chosen)) and len(chosen) == min(round(r * total), len(allowed))
        assert set(chosen) <= set(allowed)  # none in fragment 0, none in a later fragment's start
    # The deviation arm keeps deviation's own order among the allowed tokens.
    if base == "deviation":
        dev = key_deviation(Decoder.of(m, fs, lands), kvlab.merge(fs, "rerotate", m), 1)
        top = sorted(allowed, key=lambda p: -float(dev[p]))[: round(0.1 * total)]
        assert study.PastStart(ratio=0.1, policy=base).select(fs, lands, m).tolist() == sorted(top)
        # Teeth: plain deviation spends part of the same budget in a start or fragment 0.
        plain = kvlab.Recompute(ratio=0.3).select(fs, lands, m).tolist()
        assert set(plain) - set(allowed)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("follow_up", ["past_start", "place_matched"])
def test_a_later_follow_up_reads_the_same_caches_and_is_printed_from_its_rows(study, model, follow_up):
    follow = rows(f"recompute_window_{follow_up}", model)
    page = (ROOT / "results" / "README.md").read_text()
    arms = study.FOLLOW_UPS[follow_up]
    assert study.markdown(follow, model, policies=arms).strip() in page, (
        f"regenerate: .venv/bin/python studies/recompute_window.py --model {model} --policy {follow_up} --markdown"
    )
    assert {r["strategy"] for r in follow} == {"rerotate", "reprefill"} | {
        study.label(p, r) for p in arms for r in study.RATIOS
    }
    first = {
        (r["set"], r["question"]): r["span_kl"] for r in rows("recompute_window", model) if r["strategy"] == "rerotate"
    }
    again = {(r["set"], r["question"]): r["span_kl"] for r in follow if r["strategy"] == "rerotate"}
    assert again.keys() == first.keys()
    assert all(again[q] == pytest.approx(first[q], rel=1e-6, abs=1e-9) for q in again)


def test_the_place_matched_draw_has_deviations_count_in_every_tenth_but_its_own_tokens(study):
    import kvlab
    from conftest import tiny

    m = tiny("tiny-llama")
    words = "keys carry the phase of the place where they were computed".split()
    fs = [kvlab.prefill(m, " ".join(words[i % len(words)] for i in range(n))) for n in (25, 60)]
    lands = kvlab.landing_positions(fs)

    def tenths(chosen):
        return sorted((p - lands[1]) * 10 // fs[1].length for p in chosen)

    for r in (0.1, 0.3):
        dev = study.PastStart(ratio=r, policy="deviation").select(fs, lands, m).tolist()
        drawn = study.recompute("random_at_deviation_places", r, 0).select(fs, lands, m).tolist()
        assert tenths(drawn) == tenths(dev) and drawn == sorted(set(drawn))
        assert min(drawn) >= lands[1] + -(-fs[1].length // 10)  # none in fragment 0 or the later start
    # It is a draw at deviation's places, not deviation's own picks, and another seed draws others.
    other = study.recompute("random_at_deviation_places", 0.3, 1).select(fs, lands, m).tolist()
    assert drawn != dev and other != drawn and tenths(other) == tenths(dev)
