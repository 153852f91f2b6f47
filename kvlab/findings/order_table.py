"""The order-or-nearness arm's tables and its named family, from its committed rows.

The outcome is the naive - rerotate difference per question (answer-span KL, nats/token; below 0:
naive closer to the joined prefill); a comparison ``"a - b"`` of the design is that difference in
layout ``a`` minus in layout ``b``, paired over the same question of the same set and resampled by
set (:func:`kvlab.measure.stats.paired_did`), Holm-adjusted within the model's family.
"""

from __future__ import annotations

from kvlab.findings.order_arm import LAYOUTS
from kvlab.measure.stats import fmt_ci, holm, paired_did, paired_diff_ci, proportion_ci

METRICS = {"span_kl": "answer-span KL", "em": "exact match"}


def _by(rows: list[dict], layout: str, strategy: str) -> dict:
    return {(r["set"], r["question"]): r for r in rows if r["layout"] == layout and r["strategy"] == strategy}


def cell(rows: list[dict], layout: str, metric: str = "span_kl", seed: int = 0):
    """naive - rerotate in one layout: the paired interval over its questions, resampled by set."""
    a, b = _by(rows, layout, "naive"), _by(rows, layout, "rerotate")
    keys = sorted(set(a) & set(b))
    return paired_diff_ci(
        [a[k][metric] for k in keys], [b[k][metric] for k in keys], clusters=[k[0] for k in keys], seed=seed
    )


def contrast(rows: list[dict], first: str, second: str, metric: str = "span_kl", seed: int = 0):
    """``(ci, p)``: (naive - rerotate in layout ``first``) - (the same in ``second``), per question, by set."""
    a1, b1 = _by(rows, first, "naive"), _by(rows, first, "rerotate")
    a2, b2 = _by(rows, second, "naive"), _by(rows, second, "rerotate")
    keys = sorted(set(a1) & set(b1) & set(a2) & set(b2))
    return paired_did(
        *([d[k][metric] for k in keys] for d in (a1, b1, a2, b2)), clusters=[k[0] for k in keys], seed=seed
    )


def family(rows: list[dict], design: dict, seed: int = 0) -> list[dict]:
    """The design's comparisons on the primary outcome: ``label``, ``ci``, ``p``, ``p_holm`` (Holm within the model)."""
    out = []
    for label in design["family"]:
        first, second = (s.strip() for s in label.split(" - "))
        ci, p = contrast(rows, first, second, "span_kl", seed)
        out.append({"label": label, "ci": ci, "p": p})
    for r, adj in zip(out, holm([r["p"] for r in out]), strict=True):
        r["p_holm"] = adj
    return out


def table(rows: list[dict], model: str, design: dict, seed: int = 0) -> str:
    """Markdown: per layout P's offset and distance, naive - rerotate (KL, exact match), the reference; then the family."""
    sets = sorted({r["set"] for r in rows})
    lines = [
        f"**{model}**, {len(sets)} generated sets, {design['fragment_tokens']}-token passages "
        "(95% intervals: cluster bootstrap over sets)",
        "",
        "| layout | P at | tokens from P to the question | n questions | naive − rerotate answer-span KL | "
        "naive − rerotate exact match | joined prefill exact match |",
        "|---|---|---|---|---|---|---|",
    ]
    for lay in LAYOUTS:
        rs = [r for r in rows if r["layout"] == lay and r["strategy"] == "reprefill"]
        ref = proportion_ci([bool(r["em"]) for r in rs], clusters=[r["set"] for r in rs], seed=seed)
        at = sorted({r["p_offset"] for r in rs})
        dist = [r["p_distance"] for r in rs]
        lines.append(
            f"| {lay} | {', '.join(map(str, at))} | {min(dist)}-{max(dist)} | {len(rs)} | "
            f"{fmt_ci(cell(rows, lay, 'span_kl', seed), '+.3f')} | {fmt_ci(cell(rows, lay, 'em', seed), '+.2f')} | "
            f"{fmt_ci(ref, '.2f')} |"
        )
    lines += [
        "",
        "The family named before the run (answer-span KL; difference of naive − rerotate between layouts, "
        "paired per question, Holm-adjusted within the model):",
        "",
        "| comparison | what it moves | n | sets | difference [95% CI] | p | Holm p |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in family(rows, design, seed):
        c = r["ci"]
        lines.append(
            f"| {r['label']} | {design['moves'][r['label']]} | {c.n} | {c.n_clusters} | {fmt_ci(c, '+.3f')} | "
            f"{r['p']:.4f} | {r['p_holm']:.4f} |"
        )
    return "\n".join(lines)


def resolved(r: dict, alpha: float = 0.05) -> bool:
    """A family member is resolved when its Holm p is at most ``alpha`` and its interval excludes 0."""
    return r["p_holm"] <= alpha and r["ci"].excludes(0)


def findings(rows: list[dict], design: dict, seed: int = 0) -> dict[str, object]:
    """What the family says: ``order`` and ``nearness`` (bools) and the ``family`` itself.

    Order matters when the design's first comparison (P's rank alone) is resolved; nearness when
    either of the others (P's distance to the question alone) is.
    """
    fam = family(rows, design, seed)
    return {"order": resolved(fam[0]), "nearness": any(resolved(r) for r in fam[1:]), "family": fam}


def conclusions(rows: list[dict], model: str, design: dict, seed: int = 0) -> list[str]:
    """One sentence per comparison and one for what the family says, worded from intervals and Holm p."""
    got = findings(rows, design, seed)
    out = [
        f"{model}: {r['label']} ({design['moves'][r['label']]}): {fmt_ci(r['ci'], '+.3f')} "
        f"(n={r['ci'].n}, {r['ci'].n_clusters} sets), Holm p {r['p_holm']:.4f}: "
        + ("resolved" if resolved(r) else "not resolved")
        + "."
        for r in got["family"]
    ]
    what = [w for w in ("order", "nearness") if got[w]]
    out.append(
        f"{model}: "
        + (
            " and ".join(what) + (" both move" if len(what) == 2 else " moves")
            if what
            else "neither order nor nearness moves"
        )
        + " naive − rerotate, each with the other held."
    )
    return out


def summary(rows_by_model: dict[str, list[dict]], names: dict[str, str], design: dict, seed: int = 0) -> str:
    """SUMMARY's sentence on the order arm: each comparison per model, and what each model's family says."""
    got = {m: findings(rows, design, seed) for m, rows in rows_by_model.items()}
    first = next(iter(got.values()))["family"][0]["ci"]

    def clause(i: int) -> str:
        return " and ".join(
            f"{fmt_ci(g['family'][i]['ci'], '+.3f')} on {names[m]} (Holm p {g['family'][i]['p_holm']:.3f})"
            for m, g in got.items()
        )

    def says(g: dict) -> str:
        what = [w for w in ("order", "nearness") if g[w]]
        return " and ".join(what) + (" both move it" if len(what) == 2 else " moves it") if what else "neither moves it"

    verdicts = {m: says(g) for m, g in got.items()}
    if len(set(verdicts.values())) == 1:
        said = f"on {' and on '.join(names[m] for m in got)} {next(iter(verdicts.values()))}"
    else:
        said = "; ".join(f"on {names[m]} {v}" for m, v in verdicts.items())
    # A resolved comparison whose sign differs between models is said to: the models disagree on its direction.
    first_family = next(iter(got.values()))["family"]
    split = [
        i for i in range(len(first_family))
        if all(resolved(g["family"][i]) for g in got.values())
        and len({g["family"][i]["ci"].mean > 0 for g in got.values()}) > 1
    ]  # fmt: skip
    if split:
        said += " (" + ", ".join(first_family[i]["label"] for i in split) + " in opposite directions)"
    return (
        f"The order arm ([README.md](README.md#order-or-nearness-issue-56); {first.n_clusters} sets, {first.n} "
        "questions per model) holds the passage asked about at one offset in four layouts. With the passage as "
        f"far from the question, the other passage after it rather than before it changes naive − rerotate by {clause(0)} "
        f"(order alone); with the passage last, a filler between it and the question changes it by {clause(1)}, "
        f"and with the passage first, a filler after the merge by {clause(2)} (nearness alone): "
        + said
        + ", each with the other held."
    )
