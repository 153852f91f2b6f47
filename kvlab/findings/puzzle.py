"""The SmolLM2 puzzle's experiments (a)-(c): the comparisons named before the run, and the tables.

``studies/merge_puzzle.py`` reads the questions behind each arm and commits one row per (set,
count, order, question, arm); this module turns those rows into the named comparisons (paired
over the same questions, 95% cluster bootstrap over sets, Holm within the family of all
eighteen) and the tables ``results/README.md`` and ``results/SUMMARY.md`` print. No model.
"""

from __future__ import annotations

from kvlab.measure.stats import fmt_ci, mean_ci, paired_family, proportion_ci

COUNTS = (2, 4, 8)
#: (number, label, measure, arms for x (a, b), arms for y (a, b), which questions), named before the run.
#: An arm is (order, strategy); x and y are the paired differences a - b.
COMPARISONS = (
    (1, "(a) sinks: gap without first tokens - gap", "span_kl",
     (("forward", "rerotate_nofirst"), ("forward", "naive_nofirst")),
     (("forward", "rerotate"), ("forward", "naive")), "early"),
    (2, "(a) rerotate_nofirst - rerotate", "span_kl",
     (("forward", "rerotate_nofirst"), None), (("forward", "rerotate"), None), "early"),
    (3, "(b) rerotate - naive, in order - reversed", "span_kl",
     (("forward", "rerotate"), ("forward", "naive")),
     (("reversed", "rerotate"), ("reversed", "naive")), "passage 0"),
    (4, "(b) rerotate - naive, in order - reversed", "span_kl",
     (("forward", "rerotate"), ("forward", "naive")),
     (("reversed", "rerotate"), ("reversed", "naive")), "passage k-1"),
    (5, "(c) naive_pcw - naive", "span_kl", (("forward", "naive_pcw"), None), (("forward", "naive"), None), "all"),
    (6, "rerotate - naive", "captured_last", (("forward", "rerotate"), None), (("forward", "naive"), None), "early"),
)  # fmt: skip


def compare(rows: list[dict], seed: int = 0) -> list[dict]:
    """The eighteen named comparisons, each with its interval, raw p and Holm-adjusted p."""

    def family():
        for k in COUNTS:
            for number, label, measure, xa, ya, which in COMPARISONS:
                keep = {
                    "early": lambda r, k=k: r["answer_passage"] != (k - 1),
                    "passage 0": lambda r: r["answer_passage"] == 0,
                    "passage k-1": lambda r, k=k: r["answer_passage"] == k - 1,
                    "all": lambda r: True,
                }[which]
                x, y = (_series(rows, k, arm, keep, measure) for arm in (xa, ya))
                keys = sorted(set(x) & set(y))
                what = {"n_fragments": k, "number": number, "label": label, "measure": measure, "questions": which}
                yield what, [x[key] for key in keys], [y[key] for key in keys], [s for s, _ in keys]

    return paired_family(family(), seed=seed)


def _series(rows, k: int, arm, keep, measure: str) -> dict[tuple[int, int], float]:
    """``(set, question in forward order) -> value``: one arm's measure, or the difference of two arms'."""
    (order_a, a), second = arm
    index = {}
    for r in rows:
        if r["n_fragments"] == k and keep(r):
            # Questions are paired across orders by the passage and kind they ask about.
            index[r["set"], r["answer_passage"], r["kind"], r["order"], r["arm"]] = r[measure]
    out = {}
    for (s, p, kind, order, name), v in index.items():
        if order == order_a and name == a:
            if second is None:
                out[s, (p, kind)] = v
            elif (s, p, kind, *second) in index:
                out[s, (p, kind)] = v - index[s, p, kind, *second]
    return out


def table(rows: list[dict], seed: int = 0) -> str:
    """The named comparisons, then each arm's mean span KL and exact match by where the answer sits."""
    lines = [
        "| fragments | # | comparison | measure | questions | n | sets | a - b [95% CI] | Holm p |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in compare(rows, seed):
        ci = c["ci"]
        lines.append(
            f"| {c['n_fragments']} | {c['number']} | {c['label']} | {c['measure']} | {c['questions']} | {ci.n} "
            f"| {ci.n_clusters} | {fmt_ci(ci, '+.4f')} | {c['p_holm']:.3g} |"
        )
    lines += [
        "",
        "| fragments | order | arm | where | n | span KL [95% CI] | exact match [95% CI] | captured (last) [95% CI] |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for k in COUNTS:
        for order in ("forward", "reversed"):
            arms = dict.fromkeys(r["arm"] for r in rows if r["n_fragments"] == k and r["order"] == order)
            for arm in arms:
                for where, keep in (("first", 0), ("last", k - 1)):
                    sel = [
                        r for r in rows
                        if r["n_fragments"] == k and r["order"] == order and r["arm"] == arm and r["slot"] == keep
                    ]  # fmt: skip
                    if not sel:
                        continue
                    sets = [r["set"] for r in sel]
                    ci = mean_ci([r["span_kl"] for r in sel], clusters=sets, seed=seed)
                    em = proportion_ci([r["em"] for r in sel], clusters=sets, seed=seed)
                    # A question about the last fragment cannot be captured by it.
                    cap = (
                        "-"
                        if where == "last"
                        else fmt_ci(proportion_ci([r["captured_last"] for r in sel], clusters=sets, seed=seed), ".2f")
                    )
                    lines.append(
                        f"| {k} | {order} | {arm} | {where} fragment | {len(sel)} | {fmt_ci(ci, '.4f')} "
                        f"| {fmt_ci(em, '.2f')} | {cap} |"
                    )
    return "\n".join(lines)
