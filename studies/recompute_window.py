"""Why does a partial recompute cost a little inside Gemma 3's window? Two hypotheses, one run.

The haystack study found recompute (r = 0.15, ``deviation``) slightly *worse* than rerotate in
answer-span KL on Gemma 3 at 2 fragments of 192 tokens, where the whole merge (about 400 tokens)
lies inside the 512-token window of its sliding layers; at 4 and 8 fragments it was slightly
better. This study reads the same caches again to tell two explanations apart.

Design, named before the run. The haystack study's haystacks (``kvlab.findings.needles``, same
seed and budget, so the same text, needles and codes) at 2 fragments of at most ``tokens``
tokens, its four single-needle depths: one question per cache, four caches per haystack. Every
question is read behind ``rerotate`` and behind recompute at every ratio of ``RATIOS`` under
both policies of ``POLICIES``, and scored against the joined prefill (answer-span KL, the truth's
NLL, exact match of a 5-token greedy answer).

* **H1, a mixed cache.** A partial recompute gives the chosen tokens keys and values computed
  over a cache whose other later-fragment tokens are still the fragment's own: a state that
  neither the fragment's prefill nor the joined prefill produces. It predicts a cost at small r
  under *either* policy, shrinking as r nears r* (about 0.5 here: every token after fragment 0
  recomputed, which is the joined prefill).
* **H2, the selection.** ``deviation`` picks the tokens whose keys moved most; recomputing those
  first could be what costs. It predicts a cost under ``deviation`` and none under
  ``random_later`` (a random draw among the same later tokens) at the same r.

The family, per model, Holm-adjusted, paired over the same questions, cluster bootstrap over
haystacks: ``<policy> r=<r> - rerotate`` in answer-span KL for every policy and ratio (8
comparisons). SmolLM2 (no sliding window, where recompute helped at every count) is the
contrast.

    .venv/bin/python studies/recompute_window.py --model gemma3-270m [--haystacks 20]
    .venv/bin/python studies/recompute_window.py --model gemma3-270m --markdown   # tables from the committed rows

Writes ``results/recompute_window_<model>.csv`` (the haystack study's columns) and ``.json`` (the run).
"""

from __future__ import annotations

from pathlib import Path

from kvlab.cache.recompute.strategy import Recompute
from kvlab.cache.strategies import Rerotate
from kvlab.findings import longctx
from kvlab.findings.haystack_table import CLUSTER, DEPTHS, TEXT
from kvlab.findings.needles import haystack_rows
from kvlab.findings.rows import read_rows
from kvlab.lab.study import run_set_study, set_study_parser
from kvlab.measure.stats import fmt_ci, mean_ci, paired_family, proportion_ci

RESULTS = Path(__file__).resolve().parents[1] / "results"
COUNT = 2
RATIOS = (0.05, 0.15, 0.3, 0.45)
POLICIES = ("deviation", "random_later")


def label(policy: str, r: float) -> str:
    """An arm's label; ``deviation`` at 0.15 is the haystack study's ``recompute r=0.15``."""
    return f"recompute r={r:g}" if policy == "deviation" else f"{policy} r={r:g}"


def merges(seed: int) -> dict:
    """``rerotate``, then recompute at every ratio under both policies (the same draw seed)."""
    out = {"rerotate": Rerotate()}
    for policy in POLICIES:
        for r in RATIOS:
            out[label(policy, r)] = Recompute(ratio=r, policy=policy, seed=seed)
    return out


def family(rows: list[dict], seed: int = 0) -> list[dict]:
    """The named comparisons: each arm minus rerotate in answer-span KL, with interval, p and Holm p."""
    comparisons = []
    for policy in POLICIES:
        for r in RATIOS:
            x, y, labels = longctx.pairs(rows, label(policy, r), "rerotate", "span_kl", None, cluster=CLUSTER)
            comparisons.append(({"policy": policy, "ratio": r}, x, y, labels))
    return paired_family(comparisons, seed=seed)


def markdown(rows: list[dict], model: str, seed: int = 0) -> str:
    """The run's tables and conclusion lines, from its rows."""
    n = len({r["set"] for r in rows})
    q = len({(r["set"], r["question"]) for r in rows})
    tokens = sorted({r["total_tokens"] for r in rows})
    first = sorted({r["first_tokens"] for r in rows})
    r_star = sorted({round(1 - f / t, 2) for f, t in ((r["first_tokens"], r["total_tokens"]) for r in rows)})
    ref = proportion_ci(
        [r["ref_em"] for r in rows if r["strategy"] == "rerotate"],
        clusters=[r["set"] for r in rows if r["strategy"] == "rerotate"],
        seed=seed,
    )
    out = [
        f"**{model}**, {COUNT} fragments, {n} haystacks, {q} questions (merges of {tokens[0]}-{tokens[-1]} tokens, "
        f"fragment 0 of {first[0]}-{first[-1]}; r* {r_star[0]:.2f}-{r_star[-1]:.2f}); the joined prefill's exact "
        f"match {fmt_ci(ref, '.2f')}. Per arm: answer-span KL against the joined prefill (nats/token), exact "
        "match; then the arm minus rerotate in answer-span KL (paired; Holm over the 8 named comparisons):",
        "",
        "| arm | answer-span KL | exact match | minus rerotate | Holm p |",
        "|---|---|---|---|---|",
    ]
    fam = {(f["policy"], f["ratio"]): f for f in family(rows, seed)}

    def arm(name: str) -> tuple[str, str]:
        rs = [r for r in rows if r["strategy"] == name]
        sets = [r["set"] for r in rs]
        kl = mean_ci([r["span_kl"] for r in rs], clusters=sets, seed=seed)
        em = proportion_ci([r["em"] for r in rs], clusters=sets, seed=seed)
        return fmt_ci(kl, ".4f"), fmt_ci(em, ".2f")

    out.append("| rerotate | {} | {} | - | - |".format(*arm("rerotate")))
    for policy in POLICIES:
        for r in RATIOS:
            f = fam[policy, r]
            b = "**" if f["p_holm"] <= 0.05 else ""
            out.append(
                f"| {label(policy, r)} | {' | '.join(arm(label(policy, r)))} | {b}{fmt_ci(f['ci'], '+.4f')}{b} | "
                f"{f['p_holm']:.3f} |"
            )
    costs = {p: [r for r in RATIOS if fam[p, r]["p_holm"] <= 0.05 and fam[p, r]["ci"].mean > 0] for p in POLICIES}
    gains = {p: [r for r in RATIOS if fam[p, r]["p_holm"] <= 0.05 and fam[p, r]["ci"].mean < 0] for p in POLICIES}
    out += [""] + [
        f"* {p}: costs (resolved above rerotate) at r = {', '.join(map(str, costs[p])) or 'none'}; "
        f"gains (resolved below) at r = {', '.join(map(str, gains[p])) or 'none'}"
        for p in POLICIES
    ]
    return "\n".join(out)


def main() -> None:
    args = set_study_parser(__doc__, RESULTS, sets="haystacks", tokens=192).parse_args()
    path = args.out / f"recompute_window_{args.model}.csv"
    if args.markdown:
        print(markdown(read_rows(path, text=TEXT), args.model, args.seed))
        return
    rows, model = run_set_study(
        "studies/recompute_window.py",
        path,
        args,
        lambda model, h: haystack_rows(
            model, h, args.tokens, args.seed, merges(args.seed), counts=(COUNT,), depths=DEPTHS
        ),
        sets="haystacks",
        count=COUNT,
        depths=list(DEPTHS),
        ratios=list(RATIOS),
        policies=list(POLICIES),
    )
    print(markdown(rows, model.name, args.seed))


if __name__ == "__main__":
    main()
