"""The haystack study's design constants, its named family and its tables, from its committed rows.

One home for what ``studies/haystack.py`` measures and what ``results/README.md`` prints of it,
so both, and the test that recomputes the README, read the same rows the same way.
"""

from __future__ import annotations

from pathlib import Path

from kvlab.findings import longctx
from kvlab.measure.stats import fmt_ci, paired_family, proportion_ci

#: Fragment counts, single-needle depths and the three depths of a multi-needle haystack.
COUNTS = (2, 4, 8)
DEPTHS = (0.1, 0.4, 0.6, 0.9)
MULTI_DEPTHS = (0.2, 0.55, 0.9)
#: A fragment's token budget in the default design.
TOKENS = 192
#: The designs run and committed, ``(counts, tokens)``: the default, and the generated set's longest merge.
DESIGNS = ((COUNTS, TOKENS), ((8,), 512))
STRATEGIES = ("naive", "rerotate", "recompute r=0.15", "reprefill")
CLUSTER = ("n_fragments", "set")  # one haystack at one count, with every layout and question of it
TEXT = ("answer", "truth", "ref_answer")  # columns read back as strings (a code "0042" stays one)


def rows_path(results: Path, model: str, counts=COUNTS, tokens: int = TOKENS) -> Path:
    """A design's rows: ``haystack_<model>.csv`` at the default, ``haystack_<counts>x<tokens>_<model>.csv`` else."""
    if tuple(counts) == COUNTS and tokens == TOKENS:
        return Path(results) / f"haystack_{model}.csv"
    return Path(results) / f"haystack_{'-'.join(map(str, counts))}x{tokens}_{model}.csv"


def named(counts=COUNTS) -> list[tuple[str, dict, str, str, str]]:
    """The family named before the run: ``(label, where, a, b, metric)`` in order."""
    out = []
    for k in counts:
        for stratum, extra in (("all", {}), ("reference right", {"ref_em": True})):
            where = {"n_fragments": k, "layout": "single"} | extra
            out += [
                (f"{k} fragments, single, {stratum}: naive - rerotate span KL", where, "naive", "rerotate", "span_kl"),
                (
                    f"{k} fragments, single, {stratum}: recompute - rerotate span KL",
                    where,
                    "recompute r=0.15",
                    "rerotate",
                    "span_kl",
                ),
                (f"{k} fragments, single, {stratum}: naive - rerotate exact match", where, "naive", "rerotate", "em"),
            ]
        out.append(
            (
                f"{k} fragments, multi: naive - rerotate another needle's code",
                {"n_fragments": k, "layout": "multi"},
                "naive",
                "rerotate",
                "captured",
            )
        )
    return out


def family(rows: list[dict], seed: int = 0) -> list[dict]:
    """Every named comparison: ``label``, ``ci`` (paired, cluster bootstrap over haystacks), ``p``, ``p_holm``."""
    counts = sorted({r["n_fragments"] for r in rows})
    comparisons = []
    for label, where, a, b, m in named(counts):
        x, y, labels = longctx.pairs(rows, a, b, m, where, cluster=CLUSTER)
        comparisons.append(({"label": label}, x, y, labels))
    return paired_family(comparisons, seed=seed)


def _summary(rows: list[dict], by: tuple[str, ...], seed: int) -> dict:
    return {tuple(r[k] for k in by): r for r in longctx.summarize(rows, by, seed=seed)}


def _parts(rows: list[dict], seed: int) -> dict:
    """The single-needle summaries (pooled, by depth) and the family: bootstraps both printers share."""
    single = [r for r in rows if r["layout"] == "single"]
    return {
        "pooled": _summary(single, ("n_fragments", "strategy"), seed),
        "depth": _summary(single, ("n_fragments", "depth", "strategy"), seed),
        "family": family(rows, seed),
    }


def table(rows: list[dict], model: str, seed: int = 0, parts: dict | None = None) -> str:
    """Markdown: exact match and answer-span KL per count and strategy, by depth, the named family, and capture."""
    multi = [r for r in rows if r["layout"] == "multi"]
    counts = sorted({r["n_fragments"] for r in rows})
    n_hay = len({r["set"] for r in rows})
    parts = parts or _parts(rows, seed)
    pooled = parts["pooled"]
    lines = [
        f"**{model}**, {n_hay} haystacks; single needles, pooled over the {len(DEPTHS)} depths "
        "(95% intervals: cluster bootstrap over haystacks)",
        "",
        "| k | strategy | n questions | haystacks | answer-span KL, nats/token | exact match |",
        "|---|---|---|---|---|---|",
    ]
    for k in counts:
        for s in STRATEGIES:
            r = pooled[k, s]
            lines.append(
                f"| {k} | {s} | {r['n']} | {r['n_caches']} | {fmt_ci(r['span_kl'], '.3f')} | {fmt_ci(r['em'], '.2f')} |"
            )
    depth = parts["depth"]
    lines += [
        "",
        "Exact match by needle depth (share of the haystack; one cache per haystack and depth). "
        "reprefill is the joined prefill: the ceiling.",
        "",
        "| k | depth | " + " | ".join(STRATEGIES) + " |",
        "|---|---|" + "---|" * len(STRATEGIES),
    ]
    for k in counts:
        for d in DEPTHS:
            if (k, d, STRATEGIES[0]) in depth:
                lines.append(
                    f"| {k} | {d:g} | " + " | ".join(fmt_ci(depth[k, d, s]["em"], ".2f") for s in STRATEGIES) + " |"
                )
    lines += [
        "",
        "The family named before the run (paired over the same questions, Holm-adjusted within it):",
        "",
        "| comparison | n | haystacks | difference [95% CI] | p | Holm p |",
        "|---|---|---|---|---|---|",
    ]
    for r in parts["family"]:
        c = r["ci"]
        spec = "+.3f" if "KL" in r["label"] else "+.2f"
        lines.append(
            f"| {r['label']} | {c.n} | {c.n_clusters} | {fmt_ci(c, spec)} | {r['p']:.4f} | {r['p_holm']:.4f} |"
        )
    if multi:
        cap = {
            (k, s): proportion_ci(
                [bool(r["captured"]) for r in multi if r["n_fragments"] == k and r["strategy"] == s],
                clusters=[(k, r["set"]) for r in multi if r["n_fragments"] == k and r["strategy"] == s],
                seed=seed,
            )
            for k in counts
            for s in STRATEGIES
        }
        mp = _summary(multi, ("n_fragments", "strategy"), seed)
        lines += [
            "",
            f"Three needles per haystack ({', '.join(f'{d:g}' for d in MULTI_DEPTHS)}): exact match, and the share of "
            "answers that are another needle's code",
            "",
            "| k | strategy | n questions | exact match | another needle's code |",
            "|---|---|---|---|---|",
        ]
        for k in counts:
            for s in STRATEGIES:
                lines.append(
                    f"| {k} | {s} | {mp[k, s]['n']} | {fmt_ci(mp[k, s]['em'], '.2f')} | {fmt_ci(cap[k, s], '.2f')} |"
                )
    return "\n".join(lines)


def _said(r: dict, spec: str) -> str:
    verdict = "resolved" if r["p_holm"] <= 0.05 else "not resolved"
    return f"{fmt_ci(r['ci'], spec)} (Holm p {r['p_holm']:.3f}, {verdict})"


def conclusions(rows: list[dict], model: str, seed: int = 0, parts: dict | None = None) -> list[str]:
    """What the rows say of one model, as markdown bullets printed from them (every number computed here).

    A named comparison is called resolved when its Holm-adjusted p is at most 0.05.
    """
    counts = sorted({r["n_fragments"] for r in rows})
    parts = parts or _parts(rows, seed)
    pooled = parts["pooled"]
    fam = {r["label"]: r for r in parts["family"]}

    def each(what: str, spec: str) -> str:
        return "; ".join(f"{k} fragments {_said(fam[what.format(k=k)], spec)}" for k in counts)

    first = pooled[counts[0], "reprefill"]
    top = counts[-1]
    depth = parts["depth"]
    by_depth = "; ".join(
        f"{s} " + ", ".join(f"{depth[top, d, s]['em'].mean:.2f}" for d in DEPTHS if (top, d, s) in depth)
        for s in STRATEGIES
    )
    return [
        f"* **{model}**, {first['n_caches']} haystacks, {first['n']} single-needle questions per count. The "
        "joined prefill (the ceiling) finds the needle in "
        + ", ".join(f"{fmt_ci(pooled[k, 'reprefill']['em'], '.2f')} at {k} fragments" for k in counts)
        + ".",
        "  * naive − rerotate, exact match: "
        + each("{k} fragments, single, all: naive - rerotate exact match", "+.2f"),
        "  * naive − rerotate, answer-span KL (nats/token; below 0: naive closer to the joined prefill): "
        + each("{k} fragments, single, all: naive - rerotate span KL", "+.3f"),
        "  * the same where the joined prefill is right: "
        + each("{k} fragments, single, reference right: naive - rerotate span KL", "+.3f"),
        "  * recompute r=0.15 − rerotate, answer-span KL: "
        + each("{k} fragments, single, all: recompute - rerotate span KL", "+.3f"),
        "  * three needles, naive − rerotate in the share of answers that are another needle's code: "
        + each("{k} fragments, multi: naive - rerotate another needle's code", "+.2f"),
        f"  * exact match by depth at {top} fragments, depth {' → '.join(f'{d:g}' for d in DEPTHS)} (intervals "
        f"in the table above): {by_depth}",
    ]


def markdown(rows: list[dict], model: str, seed: int = 0) -> str:
    """The README's part for one model: :func:`table`, then :func:`conclusions` (one set of bootstraps for both)."""
    parts = _parts(rows, seed)
    return table(rows, model, seed, parts) + "\n\n" + "\n".join(conclusions(rows, model, seed, parts))
