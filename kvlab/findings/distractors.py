"""Needles with room to fail: paraphrased questions, distractors of the needle's own form, free depth.

The first haystack design (:mod:`kvlab.findings.haystack`) asks ``"What is the vault code for
<town>?"`` about ``"The vault code for <town> is <code>."``, with no other sentence of that form in
the haystack and the needle's fragment fixed by its depth: the joined prefill finds 0.99 of them,
so a merge has no room to show harm. A haystack here differs in three ways:

* **Paraphrase.** Each :class:`Template` asks its needle in other words: no content word of the
  needle but its subject is in the question or the answer's lead (:func:`shared_words` is empty,
  which ``tests/findings/test_distractors.py`` checks for every template).
* **Distractors.** 2 to 4 sentences of the needle's own template, each about another invented
  town with another value, sit in fragments other than the needle's; an answer that gives a
  distractor's value is a capture (:func:`captured`).
* **Depth.** The needle's fragment and its place within that fragment are drawn independently:
  each haystack asks one cache per fragment index, each with its own within-fragment depth.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvlab.errors import EvalSetError
from kvlab.findings.evalset import EvalSet, Names, Question, normalize
from kvlab.findings.haystack import cut

#: Words a paraphrase may share with its needle: they carry no content.
STOPWORDS = frozenset(
    "a an the of for to in on at by from with is are was were be its it which what where who how do does "
    "one their there this that and or".split()
)


@dataclass(frozen=True)
class Template:
    """One needle form and its paraphrased question; ``{s}`` is the subject (a town), ``{v}`` the value.

    Attributes
    ----------
    name : str
    needle : str
        The sentence put in the haystack.
    question : str
        Asked about it, in other words.
    lead : str
        The start of the answer, put at the head of the assistant's turn (in the question's words).
    """

    name: str
    needle: str
    question: str
    lead: str

    def sentence(self, subject: str, value: str) -> str:
        return self.needle.format(s=subject, v=value)


TEMPLATES = (
    Template(
        "vault",
        "The vault code for {s} is {v}.",
        "Which combination unlocks the safe in {s}?",
        "The combination that unlocks the safe in {s} is",
    ),
    Template(
        "ferry",
        "The ferry to {s} leaves from pier {v}.",
        "At which dock do boats bound for {s} depart?",
        "Boats bound for {s} depart from dock",
    ),
    Template(
        "archive",
        "The archive of {s} stores its ledgers in room {v}.",
        "In which chamber are the records of {s} kept?",
        "The records of {s} are kept in chamber",
    ),
)
#: Distractors per cache: drawn uniformly from this range.
DISTRACTORS = (2, 4)


def _content(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if w not in STOPWORDS}


def shared_words(template: Template, subject: str = "Varnholt") -> set[str]:
    """Content words of the needle (its subject aside) that its question or lead repeats: empty for a paraphrase."""
    needle = _content(template.sentence(subject, "0000")) - _content(subject)
    asked = _content(template.question.format(s=subject)) | _content(template.lead.format(s=subject))
    return needle & asked


@dataclass(frozen=True)
class Placement:
    """Where one cache's needle and distractors go.

    Attributes
    ----------
    fragment : int
        The needle's fragment.
    within : float
        In ``[0, 1]``: its place among that fragment's sentences.
    template : Template
    distractors : tuple of (int, float)
        ``(fragment, within)`` per distractor, none in the needle's fragment.
    """

    fragment: int
    within: float
    template: Template
    distractors: tuple[tuple[int, float], ...]


def placements(rng: random.Random, n_fragments: int) -> list[Placement]:
    """One placement per fragment index, in a seeded order: fragment and depth within it drawn apart.

    Raises
    ------
    EvalSetError
        Fewer than 2 fragments (a distractor needs a fragment other than the needle's).
    """
    if n_fragments < 2:
        raise EvalSetError(
            f"distractors sit in other fragments than the needle's: need >= 2 fragments, got {n_fragments}"
        )
    order = list(range(n_fragments))
    rng.shuffle(order)
    out = []
    for f in order:
        n = rng.randint(*DISTRACTORS)
        others = [g for g in range(n_fragments) if g != f]
        where = rng.sample(others, n) if n <= len(others) else [rng.choice(others) for _ in range(n)]
        out.append(Placement(f, rng.random(), rng.choice(TEMPLATES), tuple((g, rng.random()) for g in sorted(where))))
    return out


#: Where :func:`side_placements` puts the distractors: all before the needle's fragment, or all after it.
SIDES = ("before", "after")


def side_placements(rng: random.Random) -> dict[str, Placement]:
    """Three fragments, the needle in the middle one; its distractors all in fragment 0 or all in fragment 2.

    Everything else (the needle's depth, its template, how many distractors and their depths) is
    drawn once and held, so the two placements differ only in the distractors' side.

    Returns
    -------
    dict
        ``{"before": Placement, "after": Placement}`` (:data:`SIDES`).
    """
    within, template = rng.random(), rng.choice(TEMPLATES)
    depths = sorted(rng.random() for _ in range(rng.randint(*DISTRACTORS)))
    return {side: Placement(1, within, template, tuple((g, w) for w in depths)) for side, g in zip(SIDES, (0, 2))}


def distractor_set(
    sents: Sequence[str],
    start: int,
    n_fragments: int,
    fragment_tokens: int,
    placement: Placement,
    count_tokens: Callable[[str], int],
    rng: random.Random,
    names: Names,
    seed: int = 0,
) -> tuple[EvalSet, int]:
    """Passages cut from ``sents[start:]`` holding one needle and its distractors, and its one question.

    Parameters
    ----------
    sents : sequence of str
        Sentences (:func:`kvlab.findings.haystack.corpus`).
    start : int
        Index of the haystack's first sentence.
    n_fragments : int
        Passages to cut (each one cached fragment).
    fragment_tokens : int
        Budget of each passage, inserted sentences included, counted by ``count_tokens``.
    placement : Placement
        Where the needle and each distractor go (:func:`placements`).
    count_tokens : callable
        ``str -> int``, the model's token count.
    rng : random.Random
        Draws the values.
    names : Names
        Draws the towns (unique within one ``names``).

    Returns
    -------
    evalset : EvalSet
        ``n_fragments`` passages, one question (``kind`` the template's name), ``facts``
        ``{"truth", "distractors": {town: value}, "fragment", "within", "template"}``.
    end : int
        Index after the last sentence used.
    """
    if fragment_tokens < 32:
        raise EvalSetError(f"a haystack's fragments need >= 32 tokens, got {fragment_tokens}")
    t = placement.template
    values: list[str] = []
    while len(values) < 1 + len(placement.distractors):
        v = str(rng.randint(1000, 9999))
        if v not in values:
            values.append(v)
    subject = names.town()
    towns = [names.town() for _ in placement.distractors]
    inserts: dict[int, list[tuple[float, str]]] = {
        placement.fragment: [(placement.within, t.sentence(subject, values[0]))]
    }
    for (g, w), town, v in zip(placement.distractors, towns, values[1:]):
        inserts.setdefault(g, []).append((w, t.sentence(town, v)))
    passages, at = cut(sents, start, n_fragments, fragment_tokens, inserts, count_tokens)
    q = Question(
        t.question.format(s=subject), values[0], (placement.fragment,), t.name, subject, t.lead.format(s=subject)
    )
    facts = {
        "truth": values[0],
        "distractors": dict(zip(towns, values[1:])),
        "fragment": placement.fragment,
        "within": placement.within,
        "template": t.name,
    }
    return EvalSet(passages, [q], seed, facts), at


def captured(answer: str, truth: str, distractors: Sequence[str]) -> bool:
    """Whether a wrong answer is a distractor's value."""
    a = normalize(answer)
    return a != normalize(truth) and a in {normalize(v) for v in distractors}
