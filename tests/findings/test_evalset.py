"""The generated evaluation set, its chat-template split and answer scoring, and the bootstrap CIs."""

from __future__ import annotations

import numpy as np
import pytest

import kvlab
from conftest import tiny
from kvlab.errors import StatsError
from kvlab.findings import evalset as E
from kvlab.findings.qa import ask, passage_fragments
from kvlab.measure.stats import CI, mean_ci, paired_diff_ci


def test_same_seed_same_set_other_seed_other_set():
    a, b, c = E.generate_evalset(3, 4, 120), E.generate_evalset(3, 4, 120), E.generate_evalset(4, 4, 120)
    assert a.passages == b.passages and a.questions == b.questions
    assert a.passages != c.passages
    assert {q.answer for q in a.questions} != {q.answer for q in c.questions}


def test_every_answer_is_stated_in_the_passages_the_question_names():
    s = E.generate_evalset(7, 5, 200, people_per_passage=3)
    assert len(s.questions) == 3 * 5 * 3
    for q in s.questions:
        assert q.answer in s.passages[q.passages[-1]], q
        # The question's subject is introduced in its first passage, and named in the question.
        assert q.subject in s.passages[q.passages[0]] and q.subject in q.text


def test_two_hop_questions_need_two_different_passages():
    s = E.generate_evalset(1, 4, 150)
    two = [q for q in s.questions if q.hops == 2]
    assert len(two) == len(s.questions) // 3
    for q in two:
        first, second = q.passages
        assert first != second
        person = q.subject
        ship = s.facts["ship"][person]
        # Passage 1 links the person to the ship but not to the yard; passage 2 links the
        # ship to the yard but never names the person.
        assert f"{person} owned a ship called the {ship}" in s.passages[first]
        assert f"The {ship} was built in the town of {q.answer}" in s.passages[second]
        assert person not in s.passages[second]
        assert f"The {ship} was built" not in s.passages[first]


def test_passages_are_padded_to_the_target_length_without_passing_it():
    for target in (100, 300, 600):
        s = E.generate_evalset(0, 3, target)
        for p in s.passages:
            n = E._word_count(p)
            assert target - 25 <= n <= target, (target, n)
    # Filler carries no fact: no invented name appears in it.
    names = {n for d in ("home", "builder") for n in E.generate_evalset(0, 3, 100).facts[d].values()}
    assert not any(n in f for n in names for f in E.FILLER)


def test_bad_sizes_are_refused():
    with pytest.raises(E.EvalSetError, match="n_passages must be >= 2"):
        E.generate_evalset(0, 1, 100)
    with pytest.raises(E.EvalSetError, match="people_per_passage"):
        E.generate_evalset(0, 3, 100, people_per_passage=0)
    with pytest.raises(kvlab.KvlabError):
        E.prompt_parts(tiny("tiny-llama").tokenizer, [], "Why?")


def test_shipped_passages_stay_usable():
    ps = E.shipped_passages()
    assert len(ps) == 3 and "Vestervik" in ps[0]


@pytest.mark.real
def test_chat_prompt_splits_into_fragments_that_rebuild_the_joined_prompt(smollm2):
    s = E.generate_evalset(2, 3, 128)
    q = s.questions[0]
    p = E.prompt_parts(smollm2.tokenizer, s.passages, q.text, q.lead)
    assert p.template == "tokenizer" and p.probe.endswith("<|im_start|>assistant\n" + q.lead)
    whole = smollm2.tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": "\n\n".join(x.strip() for x in s.passages) + f"\n\nQuestion: {q.text} {E.INSTRUCTION}",
            }
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "".join(p.fragments) + p.probe == whole + q.lead
    assert p.fragments[0].startswith("<|im_start|>system")
    assert all(f.startswith("\n\n") for f in p.fragments[1:])
    # The same passages give the same fragments whatever the question: cacheable once.
    assert E.prompt_parts(smollm2.tokenizer, s.passages, s.questions[1].text).fragments == p.fragments


def test_without_a_chat_template_the_prompt_is_plain_question_answer():
    tok = tiny("tiny-llama").tokenizer
    p = E.prompt_parts(tok, ["One passage.", "Two passage."], "Who?")
    assert p.template == "plain" and p.fragments == ["One passage.", "\n\nTwo passage."]
    assert p.probe.startswith("\n\nQuestion: Who?") and p.probe.endswith("Answer: ")


def test_gemma_turns_are_used_when_the_tokenizer_knows_them_but_carries_no_template():
    class Tok:
        chat_template = None
        bos_token = "<bos>"

        def get_vocab(self):
            return {"<start_of_turn>": 1, "<end_of_turn>": 2}

        def apply_chat_template(self, messages, chat_template, **kw):
            from jinja2 import Template

            return Template(chat_template).render(messages=messages, bos_token=self.bos_token, **kw)

    p = E.prompt_parts(Tok(), ["A b.", "C d."], "Q?")
    assert p.template == "gemma-turns"
    assert p.fragments[0] == "<bos><start_of_turn>user\nA b." and p.probe.endswith(
        "<end_of_turn>\n<start_of_turn>model\n"
    )


@pytest.mark.parametrize(
    "said, truth, em, has",
    [
        ("Thusford<|im_end|>", "Thusford", True, True),
        ("  the Thusford.\n\nMore text", "Thusford", True, True),
        (" Thusford, and later Gukstad", "Thusford", True, True),
        ("1959<end_of_turn>", "1959", True, True),
        ("He lived in Thusford.<|im_end|>", "Thusford", False, True),
        ("Thumby", "Thusford", False, False),
        ("", "Thusford", False, False),
    ],
)
def test_scoring_reads_the_answer_span_not_the_format(said, truth, em, has):
    assert E.exact_match(said, truth) is em
    assert E.contains(said, truth) is has


def test_ci_is_seeded_covers_the_mean_and_shrinks_with_n():
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 1.0, 400)
    a, b = mean_ci(x, seed=1), mean_ci(x, seed=1)
    assert a == b and a.n == 400
    assert a.lo < a.mean < a.hi and a.mean == pytest.approx(x.mean())
    assert mean_ci(x, seed=2) != a
    small = mean_ci(x[:25])
    assert small.half_width > 2 * a.half_width  # ~ 1/sqrt(n): 4x the items, about half the width
    # A true mean of 1 is covered by most 95% intervals over fresh samples.
    intervals = [mean_ci(rng.normal(1.0, 1.0, 50), n_boot=500, seed=s) for s in range(40)]
    assert sum(c.lo < 1.0 < c.hi for c in intervals) >= 33
    assert mean_ci([1, 1, 1]) == CI(1.0, 1.0, 1.0, 3)


def test_paired_difference_ci_resolves_a_shift_that_unpaired_noise_would_hide():
    rng = np.random.default_rng(0)
    base = rng.normal(0, 5, 60)  # large spread shared by both strategies
    a, b = base + 0.5 + rng.normal(0, 0.1, 60), base
    d = paired_diff_ci(a, b)
    assert d.excludes(0) and d.lo > 0.4 and d.hi < 0.6
    # The unpaired intervals overlap widely: pairing is what resolves it.
    assert mean_ci(a).lo < mean_ci(b).hi
    with pytest.raises(StatsError, match="equal lengths"):
        paired_diff_ci([1, 2], [1])


def test_stats_refuse_empty_and_non_finite_input():
    with pytest.raises(StatsError, match="empty"):
        mean_ci([])
    with pytest.raises(StatsError, match="non-finite"):
        mean_ci([1.0, float("nan")])
    with pytest.raises(StatsError, match="n_boot"):
        mean_ci([1.0], n_boot=0)


def test_ask_scores_every_question_behind_every_strategy_and_reprefill_is_the_reference():
    from kvlab.findings import longctx

    model = tiny("tiny-llama")
    s = E.generate_evalset(0, 2, 30, people_per_passage=1)
    s = E.EvalSet(s.passages, s.questions[:3], s.seed, s.facts)
    rows = ask(model, s, longctx.default_strategies(0.15), greedy_tokens=2)
    assert len(rows) == 3 * 4
    assert {r["strategy"] for r in rows} == {"naive", "rerotate", "recompute r=0.15", "reprefill"}
    frags, _ = passage_fragments(model, s)
    for r in rows:
        assert r["answer_offset"] == (0, frags[0].length)[r["answer_passage"]]
        if r["strategy"] == "reprefill":
            assert r["kl"] == 0.0 and r["agree"] and r["answer"] == r["ref_answer"]
    naive = [r for r in rows if r["strategy"] == "naive"]
    assert all(r["kl"] > 0 for r in naive)  # wrong phase: the distribution moves
    table = longctx.summarize([dict(r, n_fragments=2) for r in rows])
    assert {(t["n_fragments"], t["strategy"]) for t in table} == {(2, s) for s in longctx.default_strategies(0.15)}
    assert all(t["n"] == 3 and t["agree"].n == 3 for t in table)
    d = longctx.paired([dict(r, n_fragments=2) for r in rows], "naive", "reprefill", "kl")
    assert d.n == 3 and d.mean > 0
