"""Order told apart from nearness to the question: the same passage first or last, with or without a filler after.

In the naive-dose design a passage's place in the merge is also its distance to the question, so
"order sets the sign" and "the passage next to the question sets the sign" predict the same rows.
This arm separates them. From a generated set (:func:`kvlab.findings.longctx.make_set`) it takes
passage P (asked about) and passage A (another person's facts), and two filler fragments F0 and
F1 cut to A's exact length in tokens. Every layout puts P second, at the same absolute offset:

============== ===================== ====================== ===============================
layout         fragments             P's rank among P, A    between P and the question
============== ===================== ====================== ===============================
first          F0, P, A              first                  A
first+filler   F0, P, A, F1          first                  A, F1
last           A, P                  last                   nothing
last+filler    A, P, F1              last                   F1
============== ===================== ====================== ===============================

``first`` and ``last+filler`` hold P at the same offset and the same distance from the question
and differ only in whether the fragment after P is a passage or filler (order); ``last`` against
``last+filler`` and ``first`` against ``first+filler`` move only the distance (nearness).
"""

from __future__ import annotations

import random

from kvlab.cache.fragments import tokenize
from kvlab.cache.merge import landing_positions
from kvlab.cache.strategies import Naive, Rerotate
from kvlab.errors import MergeError
from kvlab.findings import longctx
from kvlab.findings.evalset import FILLER, EvalSet
from kvlab.findings.needles import joined
from kvlab.findings.qa import ask, passage_fragments, passage_texts
from kvlab.models.loaded import LoadedModel

LAYOUTS = ("first", "first+filler", "last", "last+filler")
#: The generated set's one-passage questions (asked about P).
ONE_PASSAGE = ("town", "year")
GREEDY = 5


def _lengths(model: LoadedModel, s: EvalSet) -> list[int]:
    texts, _, bos = passage_texts(model, s)
    return [len(tokenize(model, t, bos=bos and i == 0)) for i, t in enumerate(texts)]


def _filler(rng: random.Random, n_words: int) -> str:
    words: list[str] = []
    while len(words) < n_words:
        sents = list(FILLER)
        rng.shuffle(sents)
        words += " ".join(sents).split()
    return " ".join(words[:n_words])


def _matched(model: LoadedModel, make, target: int, at: int, rng: random.Random, tries: int = 40) -> str:
    """Filler whose fragment at index ``at`` of ``make(filler)`` is exactly ``target`` tokens long."""
    for _ in range(tries):
        seed = rng.random()
        lo, hi = 1, 4 * target
        while lo < hi:  # the fewest words reaching the target (token count grows with words)
            mid = (lo + hi) // 2
            if _lengths(model, make(_filler(random.Random(seed), mid)))[at] < target:
                lo = mid + 1
            else:
                hi = mid
        text = _filler(random.Random(seed), lo)
        if _lengths(model, make(text))[at] == target:
            return text
    raise MergeError(f"no filler of exactly {target} tokens at fragment {at} in {tries} draws")


def layouts(model: LoadedModel, s: EvalSet, rng: random.Random) -> dict[str, EvalSet]:
    """The four layouts of passage 0 (P) and passage 1 (A) of ``s``, asking the one-passage questions about P.

    Raises
    ------
    MergeError
        P does not sit at the same offset in every layout, or A and the fillers differ in length.
    """
    p, a = s.passages[0], s.passages[1]
    qs = [q for q in s.questions if q.kind in ONE_PASSAGE and q.passages == (0,)]
    if not qs:
        raise MergeError("the set asks nothing about its first passage alone")

    def make(frags: list[str], at: int = 1) -> EvalSet:
        return EvalSet(
            frags, [type(q)(q.text, q.answer, (at,), q.kind, q.subject, q.lead) for q in qs], s.seed, s.facts
        )

    first_len = _lengths(model, make([a, p]))[0]
    later_len = _lengths(model, make([a, p, a]))[2]
    f0 = _matched(model, lambda f: make([f, p, a]), first_len, 0, rng)
    f1 = _matched(model, lambda f: make([a, p, f]), later_len, 2, rng)
    out = {
        "first": make([f0, p, a]),
        "first+filler": make([f0, p, a, f1]),
        "last": make([a, p]),
        "last+filler": make([a, p, f1]),
    }
    offsets = {name: landing_positions_of(model, e)[1] for name, e in out.items()}
    if len(set(offsets.values())) != 1:
        raise MergeError(f"P lands at different offsets across layouts: {offsets}")
    return out


def landing_positions_of(model: LoadedModel, s: EvalSet) -> list[int]:
    """Where each passage of ``s`` lands in the joined prompt, in tokens."""
    lengths = _lengths(model, s)
    return [sum(lengths[:i]) for i in range(len(lengths))]


def set_rows(model: LoadedModel, j: int, tokens: int, seed: int) -> list[dict]:
    """Generated set ``j``'s questions about P in every layout, behind naive and rerotate (and the joined prefill).

    The set is naive-dose's set ``j`` (``make_set(..., seed=seed + 1000 * j)``), two passages of
    ``tokens`` tokens. Rows carry ``set``, ``layout``, ``p_offset`` (P's first slot),
    ``p_distance`` (tokens between P's end and the question) and :func:`kvlab.findings.qa.ask`'s columns.
    """
    s = longctx.make_set(model, 2, tokens, seed=seed + 1000 * j, people_per_passage=2)
    rng = random.Random(f"order arm {seed} {j}")
    rows = []
    for name, e in layouts(model, s, rng).items():
        frags, probes = passage_fragments(model, e)
        lands = landing_positions(frags)
        got = ask(
            model, e, {"naive": Naive(), "rerotate": Rerotate()}, greedy_tokens=GREEDY, fragments=frags, probes=probes
        )
        got += [joined(r) for r in got if r["strategy"] == "naive"]
        end = lands[-1] + frags[-1].length
        for r in got:
            rows.append(
                {"set": j, "layout": name, "n_fragments": len(frags), "p_offset": lands[1],
                 "p_distance": end - lands[1] - frags[1].length, "total_tokens": end} | r
            )  # fmt: skip
    return rows
