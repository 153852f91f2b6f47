"""Where does the question look behind each merge? The SmolLM2 puzzle, experiment (d).

On SmolLM2 a naive merge (fragments left at the phase of position 0) scores a lower answer-span
KL than rerotate at 2 x 512 tokens, and rerotate answers many first-passage questions with the
same kind of fact from a later passage. Two mechanisms are on the table:

* **sinks** (the attention-sink literature; APE, 2025): each fragment's first token, cached at
  position 0, looks to the model like the sequence's first token and draws attention; a naive
  merge keeps every fragment's first token at that phase, rerotate moves it;
* **recency capture**: with every fragment at its true position, the question attends to the
  nearest passage, and a fact of the right kind there wins over the one asked about; a naive
  merge puts every fragment at the same positions (as Parallel Context Windows, Ratner et al.
  2023, does on purpose), so no passage is nearer than another.

Design, named before the run. ``sets`` generated sets of 8 passages (one person each, at most
``tokens`` tokens), each passage prefilled alone once; the k-fragment merge is the first k
passages (k in 2, 4, 8). Every one-passage question (town, year) about every passage is read
behind naive, rerotate and the joined prefill of the same tokens, with eager attention, and we
keep the attention of the last question token (the one that predicts the answer's first token)
over the cached context, averaged over layers and heads: its mass on the fragment holding the
answer, on the last fragment, on the later fragments' first tokens, and on the very first token.

The regions (the answer's fragment, the last fragment) leave out each fragment's first token,
which is counted apart (``first_tokens``: the first tokens of fragments 1..k-1).

Comparisons, paired over the same questions, 95% cluster bootstrap over sets, Holm within the
family of all fifteen (5 per count):

1. ``first_tokens``, naive - rerotate: if the sinks are made by the phase, > 0;
2. ``first_tokens``, rerotate - joined: the draw of the fragments' first tokens that no rotation
   changes (in the joined prefill these tokens sit mid-sequence);
3. ``last``, rerotate - naive, on questions whose answer is not in the last fragment: recency
   capture predicts > 0;
4. ``answer``, rerotate - joined, same questions: recency capture predicts < 0;
5. ``answer``, naive - joined, same questions.

    .venv/bin/python studies/attention_mass.py --sets 20          # writes results/attention_mass_<model>.csv/.json
    .venv/bin/python studies/attention_mass.py --markdown         # the table, from the committed rows
"""

from __future__ import annotations

from pathlib import Path

import torch

import kvlab
from kvlab.cache.fragments import clone_cache, tokenize
from kvlab.compat import forward
from kvlab.findings import longctx
from kvlab.findings.evalset import EvalSet
from kvlab.findings.qa import passage_fragments, passage_texts
from kvlab.findings.rows import read_rows
from kvlab.lab.study import run_set_study, set_study_parser
from kvlab.measure.stats import fmt_ci, paired_family

RESULTS = Path(__file__).resolve().parents[1] / "results"
COUNTS = (2, 4, 8)
ONE_PASSAGE = ("town", "year")
MASSES = ("answer", "last", "first_tokens", "sink")
#: (measure, a, b, only questions whose answer is not in the last fragment), named before the run.
COMPARISONS = (
    ("first_tokens", "naive", "rerotate", False),
    ("first_tokens", "rerotate", "joined", False),
    ("last", "rerotate", "naive", True),
    ("answer", "rerotate", "joined", True),
    ("answer", "naive", "joined", True),
)


def asked(full: EvalSet, k: int) -> EvalSet:
    """The first ``k`` passages of ``full`` and every one-passage question about them."""
    qs = [q for q in full.questions if q.kind in ONE_PASSAGE and q.passages[0] < k]
    return EvalSet(full.passages[:k], qs, full.seed, full.facts)


@torch.inference_mode()
def masses(model, cache, probe: str, spans: list[tuple[int, int]], answer: int) -> dict[str, float]:
    """The last probe token's attention over the cached context, mean over layers and heads, summed per region.

    ``cache`` holds ``T`` positions (``[1, kv_heads, T, head_dim]`` per layer), never modified;
    ``spans`` are the fragments' ``[start, end)`` slots.
    """
    ids = tokenize(model, probe)
    total = spans[-1][1]
    # Only eager attention returns its weights; the prefills and merges keep the model's own kernel.
    before = model.model.config._attn_implementation
    model.model.set_attn_implementation("eager")
    try:
        out = forward(
            model.model,
            clone_cache(cache, model.config),
            input_ids=ids[None],
            position_ids=torch.arange(total, total + len(ids))[None],
            use_cache=True,
            output_attentions=True,
            logits_to_keep=1,
        )
    finally:
        model.model.set_attn_implementation(before)
    # [layers, heads, T + probe] -> mean over layers and heads, last query row, context slots only.
    att = torch.stack([a[0, :, -1, :] for a in out.attentions]).double().mean((0, 1))[:total]
    # Every fragment's first token was a sequence's first token when it was prefilled, and draws
    # attention as one (a sink) wherever it lands; the regions below leave those tokens out, so
    # a region's mass is what its content draws.
    firsts = [a for a, _ in spans[1:]]
    return {
        "answer": float(att[spans[answer][0] + 1 : spans[answer][1]].sum()),
        "last": float(att[spans[-1][0] + 1 :].sum()),
        "first_tokens": float(att[firsts].sum()),
        "sink": float(att[0]),
    }


def set_rows(model, j: int, tokens: int, seed: int) -> list[dict]:
    """One row per (count, question, cache) of generated set ``j``."""
    full = longctx.make_set(model, max(COUNTS), tokens, seed=seed + 1000 * j, people_per_passage=1)
    frags, _ = passage_fragments(model, full)
    rows = []
    for k in COUNTS:
        s = asked(full, k)
        _, probes, _ = passage_texts(model, s)
        lands = kvlab.landing_positions(frags[:k])
        spans = [(a, a + f.length) for a, f in zip(lands, frags[:k])]
        caches = {
            "naive": kvlab.merge(frags[:k], "naive", model),
            "rerotate": kvlab.merge(frags[:k], "rerotate", model),
            "joined": kvlab.joined_prefill(model, frags[:k]).cache,
        }
        for qi, (q, probe) in enumerate(zip(s.questions, probes)):
            p = q.passages[0]
            for name, cache in caches.items():
                m = masses(model, cache, probe, spans, p)
                rows.append(
                    {"set": j, "n_fragments": k, "question": qi, "kind": q.kind, "answer_passage": p, "cache": name} | m
                )
    return rows


def compare(rows: list[dict], seed: int = 0) -> list[dict]:
    """The fifteen named comparisons, each with its interval, raw p and Holm-adjusted p."""

    def family():
        for k in COUNTS:
            for measure, a, b, not_last in COMPARISONS:
                sel = [r for r in rows if r["n_fragments"] == k and (not not_last or r["answer_passage"] < k - 1)]
                by = {(r["set"], r["question"], r["cache"]): r[measure] for r in sel}
                keys = sorted({(s, q) for s, q, _ in by})
                what = {"n_fragments": k, "measure": measure, "a": a, "b": b, "answer_not_last": not_last}
                yield what, [by[s, q, a] for s, q in keys], [by[s, q, b] for s, q in keys], [s for s, _ in keys]

    return paired_family(family(), seed=seed)


def table(rows: list[dict], seed: int = 0) -> str:
    """The named comparisons as a Markdown table, and the mean masses beside them."""
    lines = [
        "| fragments | measure | comparison | questions | sets | a - b [95% CI] | Holm p |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in compare(rows, seed):
        ci = c["ci"]
        where = " (answer not in the last fragment)" if c["answer_not_last"] else ""
        lines.append(
            f"| {c['n_fragments']} | {c['measure']}{where} | {c['a']} - {c['b']} | {ci.n} | {ci.n_clusters} "
            f"| {fmt_ci(ci, '+.4f')} | {c['p_holm']:.3g} |"
        )
    lines += ["", "| fragments | cache | " + " | ".join(MASSES) + " |", "|---|---|" + "---|" * len(MASSES)]
    for k in COUNTS:
        for name in ("naive", "rerotate", "joined"):
            sel = [r for r in rows if r["n_fragments"] == k and r["cache"] == name]
            if sel:
                lines.append(
                    f"| {k} | {name} | " + " | ".join(f"{sum(r[m] for r in sel) / len(sel):.4f}" for m in MASSES) + " |"
                )
    return "\n".join(lines)


def main() -> None:
    args = set_study_parser(__doc__, RESULTS, split=False).parse_args()
    path = args.out / f"attention_mass_{args.model}.csv"
    if args.markdown:
        print(table(read_rows(path), args.seed))
        return
    rows, _ = run_set_study(
        "studies/attention_mass.py",
        path,
        args,
        lambda model, j: set_rows(model, j, args.tokens, args.seed),
        counts=list(COUNTS),
    )
    print(table(rows, args.seed))


if __name__ == "__main__":
    main()
