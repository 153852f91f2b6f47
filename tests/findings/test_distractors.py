"""Needles with room to fail (kvlab.findings.distractors): paraphrase, distractors elsewhere, free depth."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvlab.errors import EvalSetError
from kvlab.findings import distractors, haystack
from kvlab.findings.evalset import Names


def words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("template", distractors.TEMPLATES, ids=lambda t: t.name)
def test_every_question_paraphrases_its_needle(template):
    assert distractors.shared_words(template) == set()


def test_the_paraphrase_check_catches_a_question_in_the_needles_words():
    # The first haystack design's question: it repeats "vault" and "code".
    echo = distractors.Template(
        "echo", haystack.needle("{s}", "{v}"), "What is the vault code for {s}?", "The vault code for {s} is"
    )
    assert distractors.shared_words(echo) == {"vault", "code"}


def test_placements_visit_every_fragment_once_with_depths_drawn_apart_and_distractors_elsewhere():
    fragments, within = [], []
    for h in range(60):
        got = distractors.placements(random.Random(h), 4)
        assert sorted(p.fragment for p in got) == [0, 1, 2, 3]
        for p in got:
            lo, hi = distractors.DISTRACTORS
            assert lo <= len(p.distractors) <= hi
            assert all(g != p.fragment for g, _ in p.distractors)
            fragments.append(p.fragment)
            within.append(p.within)
    # The depth within a fragment does not follow the fragment's index.
    assert abs(np.corrcoef(fragments, within)[0, 1]) < 0.15
    assert {t.name for t in (p.template for h in range(20) for p in distractors.placements(random.Random(h), 4))} == {
        t.name for t in distractors.TEMPLATES
    }
    with pytest.raises(EvalSetError, match="need >= 2 fragments"):
        distractors.placements(random.Random(0), 1)


def test_a_set_holds_its_needle_in_its_fragment_and_every_distractor_in_another():
    sents = haystack.corpus(0)
    rng = random.Random(3)
    for place in distractors.placements(random.Random(5), 4):
        s, end = distractors.distractor_set(sents, 200, 4, 150, place, words, rng, Names(random.Random(7)))
        assert len(s.passages) == 4 and all(words(p) <= 150 for p in s.passages)
        (q,) = s.questions
        t = place.template
        assert q.passages == (place.fragment,) and q.kind == t.name and q.answer == s.facts["truth"]
        assert t.sentence(q.subject, q.answer) in s.passages[place.fragment]
        assert q.text == t.question.format(s=q.subject) and q.lead == t.lead.format(s=q.subject)
        values = list(s.facts["distractors"].values())
        assert len(values) == len(place.distractors) and q.answer not in values and len(set(values)) == len(values)
        for (g, _), (town, v) in zip(place.distractors, s.facts["distractors"].items()):
            assert t.sentence(town, v) in s.passages[g] and g != place.fragment
        # Without what was put in, the passages are the essay's sentences in order.
        plain = " ".join(s.passages)
        for town, v in [(q.subject, q.answer), *s.facts["distractors"].items()]:
            sentence = t.sentence(town, v)
            plain = plain.replace(" " + sentence, "").replace(sentence + " ", "")
        assert plain == " ".join(sents[200:end])


def test_captured_is_a_distractors_value_only():
    assert distractors.captured("4411", "1234", ["4411", "9000"])
    assert not distractors.captured("1234", "1234", ["4411"])
    assert not distractors.captured("7777", "1234", ["4411"])


def test_side_placements_move_only_the_distractors_side():
    for seed in range(20):
        got = distractors.side_placements(random.Random(seed))
        before, after = (got[s] for s in distractors.SIDES)
        assert before.fragment == after.fragment == 1
        assert (before.within, before.template) == (after.within, after.template)
        assert {g for g, _ in before.distractors} == {0} and {g for g, _ in after.distractors} == {2}
        assert [w for _, w in before.distractors] == [w for _, w in after.distractors]
        assert distractors.DISTRACTORS[0] <= len(before.distractors) <= distractors.DISTRACTORS[1]
