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
