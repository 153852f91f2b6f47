"""Why does a naive merge beat rerotate on SmolLM2? The puzzle's experiments (a), (b) and (c).

At 2 x 512 tokens on SmolLM2 a naive merge (every fragment left at the phase of position 0)
scores a lower answer-span KL than rerotate (every fragment at its true position), and
rerotate answers questions about early passages with the same kind of fact from the last one.
Experiment (d) (``studies/attention_mass.py``) showed where the question looks: the later
fragments' first tokens draw attention under both merges alike, and rerotate's question looks
at the last fragment more than naive's. Two mechanisms are on the table:

* **sinks** (Xiao et al. 2024, attention sinks; APE, Yang et al. 2025): each fragment's first
  token was a sequence's first token when it was prefilled, and the fragments' first tokens at
  phase 0 (naive) or moved (rerotate) change what the question reads;
* **recency capture**: with every fragment at its true position the question favours the
  nearest passage, and a fact of the right kind there wins over the one asked about; a naive
  merge puts every fragment at the same positions, as Parallel Context Windows (Ratner et al.
  2023) does on purpose, so no passage is nearer than another.

Design, named before the run. ``sets`` generated sets of 8 passages (one person each, at most
``tokens`` tokens); the k-fragment merge (k in 2, 4, 8) is the first k passages, each prefilled
alone, with every one-passage question (town, year) about them. Arms, each read with the same
probes and scored against the joined prefill of the same passages in the same order:

* ``naive``, ``rerotate``, ``joined`` (the reference, scored as an arm too);
* (a) ``naive_nofirst``, ``rerotate_nofirst``: the same merges with fragments 1..k-1's first
  token taken out of the cache (the question still starts at the merged length, so every
  other token keeps its position);
* (b) ``reversed``: the passages in the opposite order (the chat template's opening stays
  first), read behind ``naive``, ``rerotate`` and their own ``joined``;
* (c) ``naive_pcw``: the naive cache with the question placed as PCW places the task, right
  after the longest fragment rather than after all of them.

Each row is one question behind one arm: answer-span KL (true answer teacher-forced, nats per
token), the truth's NLL, exact match of a 5-token greedy answer, and whether a wrong answer is
the same kind of fact about the person in the last fragment (``captured_last``) or in any
other fragment of the merge (``captured_other``).

Comparisons (``kvlab.findings.puzzle``), paired over the same questions, 95% cluster bootstrap over sets, Holm within the
family of all eighteen (six per count); "early" questions are those whose passage is not the
last fragment:

1. (a) span KL, early: ``(rerotate_nofirst - naive_nofirst) - (rerotate - naive)``. Sinks
   predict the gap changes when the first tokens go (< 0 if they carry naive's advantage);
   recency capture predicts no change.
2. (a) span KL, early: ``rerotate_nofirst - rerotate``.
3. (b) span KL, questions about passage 0: ``(rerotate - naive)`` in order minus reversed.
   Recency capture predicts > 0: passage 0 is first in order, last reversed.
4. (b) span KL, questions about passage k-1: the same difference. Recency predicts < 0.
5. (c) span KL, all: ``naive_pcw - naive``.
6. ``captured_last``, early: ``rerotate - naive``. Recency capture predicts > 0.

    .venv/bin/python studies/merge_puzzle.py --sets 20 [--first-set 0]   # writes results/merge_puzzle_<model>.csv/.json
    .venv/bin/python studies/merge_puzzle.py --markdown                   # the tables, from the committed rows
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import kvlab
from kvlab.cache.fragments import new_cache
from kvlab.findings import longctx
from kvlab.findings.evalset import EvalSet, answer_span, exact_match, normalize
from kvlab.findings.puzzle import COUNTS, table
from kvlab.findings.qa import passage_fragments
from kvlab.findings.rows import read_rows
from kvlab.lab.study import run_set_study, set_study_parser
from kvlab.measure.case import FidelityReference
from kvlab.measure.probes import read_probes
from kvlab.measure.references import context_reference
from kvlab.measure.span import span_scores

RESULTS = Path(__file__).resolve().parents[1] / "results"
ONE_PASSAGE = ("town", "year")
GREEDY = 5
FACT = {"town": "home", "year": "born"}


def asked(full: EvalSet, k: int, reverse: bool = False) -> EvalSet:
    """The first ``k`` passages of ``full`` (reversed: last first) and every one-passage question about them."""
    qs = [q for q in full.questions if q.kind in ONE_PASSAGE and q.passages[0] < k]
    if not reverse:
        return EvalSet(full.passages[:k], qs, full.seed, full.facts)
    flip = [dataclasses.replace(q, passages=tuple(k - 1 - p for p in q.passages)) for q in qs]
    return EvalSet(full.passages[:k][::-1], flip, full.seed, full.facts)


def without_firsts(cache, config, spans: list[tuple[int, int]]):
    """``cache`` without the first slot of fragments 1..k-1 (keys/values ``[1, kv_heads, T - k + 1, head_dim]``)."""
    keep = torch.ones(spans[-1][1], dtype=torch.bool)
    keep[[a for a, _ in spans[1:]]] = False
    out = new_cache(config)
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys[:, :, keep].clone(), layer.values[:, :, keep].clone(), i)
    return out


def score(model, cache, ref: FidelityReference, probes, answers, position=None) -> list[dict]:
    """Per probe: span KL, the truth's NLL, and the greedy answer behind ``cache`` read at ``position``."""
    want = ref.reads(probes, GREEDY)
    got = read_probes(model, cache, probes, greedy=GREEDY, draft=[w.greedy for w in want], position=position)
    spans = span_scores(model, cache, ref, probes, answers, position=position)
    return [
        {"answer": answer_span(model.tokenizer.decode(g.greedy))} | {k: s[k] for k in ("span_kl", "nll", "nll_ref")}
        for g, s in zip(got, spans, strict=True)
    ]


def _arms(model, s: EvalSet, order: str) -> dict[str, list[dict]]:
    """Every arm of one order: ``strategy -> one score per question of s``."""
    frags, probes = passage_fragments(model, s)
    answers = [q.answer for q in s.questions]
    ref = FidelityReference(model, context_reference(model, frags))
    lands = kvlab.landing_positions(frags)
    spans = [(a, a + f.length) for a, f in zip(lands, frags)]
    caches = {"naive": kvlab.merge(frags, "naive", model), "rerotate": kvlab.merge(frags, "rerotate", model)}
    out = {name: score(model, c, ref, probes, answers) for name, c in caches.items()}
    ref_answers = [answer_span(model.tokenizer.decode(w.greedy)) for w in ref.reads(probes, GREEDY)]
    out["joined"] = [
        {"answer": a, "span_kl": 0.0, "nll": s["nll_ref"], "nll_ref": s["nll_ref"]}
        for a, s in zip(ref_answers, out["naive"])
    ]
    if order == "forward":
        for name in ("naive", "rerotate"):
            cut = without_firsts(caches[name], model.config, spans)
            out[f"{name}_nofirst"] = score(model, cut, ref, probes, answers, position=spans[-1][1])
        out["naive_pcw"] = score(model, caches["naive"], ref, probes, answers, position=max(f.length for f in frags))
    for got in out.values():
        for r, ref_answer in zip(got, ref_answers):
            r["ref_answer"] = ref_answer
    return out


def set_rows(model, j: int, tokens: int, seed: int) -> list[dict]:
    """One row per (count, order, question, arm) of generated set ``j``."""
    full = longctx.make_set(model, max(COUNTS), tokens, seed=seed + 1000 * j, people_per_passage=1)
    person = {q.passages[0]: q.subject for q in full.questions if q.kind in ONE_PASSAGE}
    rows = []
    for k in COUNTS:
        for order in ("forward", "reversed"):
            s = asked(full, k, reverse=order == "reversed")
            for arm, got in _arms(model, s, order).items():
                for qi, (q, r) in enumerate(zip(s.questions, got, strict=True)):
                    p = q.passages[0] if order == "forward" else k - 1 - q.passages[0]  # the passage, in order
                    slot = q.passages[0]  # where it sits in this merge
                    last = (k - 1) if order == "forward" else 0
                    fact = full.facts[FACT[q.kind]]
                    wrong = not exact_match(r["answer"], q.answer)
                    others = {normalize(str(fact[person[i]])) for i in range(k) if i != p}
                    rows.append(
                        {"set": j, "n_fragments": k, "order": order, "question": qi, "kind": q.kind}
                        | {"answer_passage": p, "slot": slot, "arm": arm, "truth": q.answer}
                        | r
                        | {"em": not wrong, "ref_em": exact_match(r["ref_answer"], q.answer)}
                        | {
                            "captured_last": wrong
                            and p != last
                            and normalize(r["answer"]) == normalize(str(fact[person[last]]))
                        }
                        | {"captured_other": wrong and normalize(r["answer"]) in others}
                    )
    return rows


def main() -> None:
    args = set_study_parser(__doc__, RESULTS).parse_args()
    path = args.out / f"merge_puzzle_{args.model}.csv"
    if args.markdown:
        print(table(read_rows(path), args.seed))
        return
    rows, _ = run_set_study(
        "studies/merge_puzzle.py",
        path,
        args,
        lambda model, j: set_rows(model, j, args.tokens, args.seed),
        counts=list(COUNTS),
        greedy_tokens=GREEDY,
    )
    print(table(rows, args.seed))


if __name__ == "__main__":
    main()
