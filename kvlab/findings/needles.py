"""Haystacks read behind merges: one row per question and strategy, with where its needle landed.

A haystack is a stretch of essay sentences (:mod:`kvlab.findings.haystack`) cut into k fragments
with invented needles in it. :func:`haystack_rows` builds haystack ``h``'s caches at each count
and layout, reads every needle's question behind each merge strategy
(:func:`kvlab.findings.qa.ask`) and adds the joined prefill's own reads as ``reprefill``.
``studies/haystack.py`` and ``studies/recompute_window.py`` both read haystacks this way, so a
haystack with the same index, seed and budget is the same text, needles and codes in both.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence

from kvlab.cache.merge import landing_positions
from kvlab.cache.strategies import Strategy
from kvlab.findings import haystack, longctx
from kvlab.findings.evalset import EvalSet, Names, contains
from kvlab.findings.qa import ask, passage_fragments
from kvlab.models.loaded import LoadedModel

#: Sentences per haystack at budgets up to 192 tokens: haystack h starts at sentence h * STRIDE
#: (the largest, 8 x 192 tokens, uses about 70).
STRIDE = 200
#: Sentences per haystack at longer budgets: 8 x 512 tokens uses at most 226 of them (haystacks
#: 0-19, both models' tokenizers); 20 such stretches take 6400 of the essays' 6664 sentences.
LONG_STRIDE = 320
#: Tokens of the greedy answer scored by exact match.
GREEDY = 5


def joined(row: dict) -> dict:
    """The ``reprefill`` row of a question, from the joined prefill's reads that every row carries.

    reprefill builds exactly the joined prefill's cache (``tests/cache`` checks the two are equal),
    so its answer and scores are the reference's: running it again would cost a prefill per
    cache and change nothing.
    """
    return row | {
        "strategy": "reprefill",
        "answer": row["ref_answer"],
        "em": row["ref_em"],
        "contains": contains(row["ref_answer"], row["truth"]),
        "agree": True,
        "kl": 0.0,
        "top1": True,
        "span_kl": 0.0,
        "nll": row["nll_ref"],
        "merge_s": None,
    }


def stride(tokens: int) -> int:
    """Sentences between one haystack's first sentence and the next's, for a fragment budget of ``tokens``."""
    return STRIDE if tokens <= 192 else LONG_STRIDE


def haystack_caches(
    model: LoadedModel,
    h: int,
    tokens: int,
    seed: int,
    *,
    counts: Sequence[int],
    depths: Sequence[float],
    multi_depths: Sequence[float] | None = None,
) -> Iterator[tuple[int, str, EvalSet, list]]:
    """Haystack ``h``'s caches, in the order of their draws: ``(count, layout, evalset, (fragments, probes))``.

    ``fragments`` are :func:`kvlab.findings.qa.passage_fragments`'s, one per passage, each
    prefilled alone (keys ``[1, kv_heads, L_i, head_dim]``); ``probes`` one per question.

    The draws run over counts, then single depths, then the multi cache, so a call with a prefix
    of another's counts and layouts yields the same caches. Parameters as :func:`haystack_rows`.
    """
    sents = haystack.corpus(seed)
    count = longctx.token_counter(model)
    rng = random.Random(f"haystack {seed} {h}")
    names = Names(rng)  # one per haystack: every needle of it has its own town
    span = stride(tokens)
    start = h * span
    for k in counts:
        layouts = [("single", (d,)) for d in depths] + ([("multi", tuple(multi_depths))] if multi_depths else [])
        for layout, at in layouts:
            s, end = haystack.haystack_set(sents, start, k, tokens, at, count, rng, names, seed)
            if end > start + span:
                raise RuntimeError(f"haystack {h} runs past its stretch ({end - start} > {span} sentences)")
            yield k, layout, s, passage_fragments(model, s)


def needle_span(model: LoadedModel, s: EvalSet, frags: list, question) -> tuple[int, int]:
    """``(first, end)``: merged positions of the needle a question asks about (within a token or two at the joins)."""
    count = longctx.token_counter(model)
    p = question.passages[0]
    text = haystack.needle(question.subject, question.answer)
    before = s.passages[p][: s.passages[p].index(text)]
    first = landing_positions(frags)[p] + (frags[p].length - count(s.passages[p])) + count(before)
    return first, first + count(text)


def haystack_rows(
    model: LoadedModel,
    h: int,
    tokens: int,
    seed: int,
    merges: Mapping[str, Strategy],
    *,
    counts: Sequence[int],
    depths: Sequence[float],
    multi_depths: Sequence[float] | None = None,
) -> list[dict]:
    """One row per (count, layout, question, strategy) of haystack ``h``.

    Parameters
    ----------
    model : LoadedModel
    h : int
        The haystack: its own stretch of the seeded essay order, its own needles and codes.
    tokens : int
        Budget of each fragment, in the model's tokens.
    seed : int
        Seed of the essay order and of every haystack's draws.
    merges : mapping of str to Strategy
        The strategies read, by label (``reprefill`` is added from the joined prefill's reads).
    counts : sequence of int
        Fragment counts, in order.
    depths : sequence of float
        One single-needle cache per depth (share of the haystack), in order.
    multi_depths : sequence of float, optional
        Depths of the three needles of the one multi-needle cache per count (none when omitted).

    Returns
    -------
    list of dict
        :func:`kvlab.findings.qa.ask`'s columns plus ``set`` (``h``), ``n_fragments``, ``layout``,
        ``depth``, ``needle_at``, ``total_tokens``, ``first_tokens``, ``captured`` and
        ``ref_captured``. The draws run in this order (counts, then single depths, then the multi
        cache), so a call with a prefix of another's counts and layouts builds the same caches.
    """
    rows = []
    caches = haystack_caches(model, h, tokens, seed, counts=counts, depths=depths, multi_depths=multi_depths)
    for k, layout, s, (frags, probes) in caches:
        lands = landing_positions(frags)
        codes = list(s.facts["codes"].values())
        # Per question once, not per strategy's row: the needle's place in the merge.
        asked = {q.text: (q, needle_span(model, s, frags, q)[0]) for q in s.questions}
        got = ask(model, s, dict(merges), greedy_tokens=GREEDY, fragments=frags, probes=probes)
        got += [joined(r) for r in got if r["strategy"] == next(iter(merges))]
        for r in got:
            q, needle_at = asked[r["question"]]
            rows.append(
                {"set": h, "n_fragments": k, "layout": layout, "depth": s.facts["depths"][q.subject]}
                | r
                | {
                    "needle_at": needle_at,
                    "total_tokens": lands[-1] + frags[-1].length,
                    "first_tokens": frags[0].length,
                    "captured": haystack.captured(r["answer"], q.answer, codes),
                    "ref_captured": haystack.captured(r["ref_answer"], q.answer, codes),
                }
            )
    return rows
