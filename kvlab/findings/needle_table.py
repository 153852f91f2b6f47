"""The distractor needle study's tables, its named family and its conclusions, from its committed rows.

One home for what ``studies/needle.py`` prints and what ``results/README.md`` and the tests
recompute, so all of them read the same rows the same way. A question is one needle of one cache
(``set``, ``cache``, ``question``); a haystack (``set``) holds one cache per fragment index and
is what the bootstrap resamples: its caches share their text, so they are not independent.
"""

from __future__ import annotations

from kvlab.findings import longctx
from kvlab.measure.stats import fmt_ci, paired_family, proportion_ci

#: A haystack at one design: its caches (one per fragment index) resampled together.
CLUSTER = ("n_fragments", "fragment_tokens", "set")
#: The reference's exact match the design must reach on each model (issue 56: room to fail, and to succeed).
BAND = (0.6, 0.9)
#: The outcomes a design may name, and the row column each reads (exact match and capture are rates).
OUTCOMES = {"exact match": "em", "truth NLL": "nll", "distractor captured": "captured"}


def _cluster(r: dict) -> tuple:
    return tuple(r[c] for c in CLUSTER)


def _key(r: dict) -> tuple:
    return r["set"], r["cache"], r["question"]


def _cells(rs: list[dict], columns: tuple[str, str, str], seed: int) -> str:
    """``n | haystacks | exact match | truth NLL | captured`` of ``rs``, read from ``columns`` (em, nll, captured)."""
    em, nll, cap = columns
    cl = [_cluster(r) for r in rs]
    return " | ".join(
        [
            str(len(rs)),
            str(len(set(cl))),
            fmt_ci(proportion_ci([bool(r[em]) for r in rs], clusters=cl, seed=seed), ".2f"),
            fmt_ci(longctx.mean_ci([float(r[nll]) for r in rs], clusters=cl, seed=seed), ".2f"),
            fmt_ci(proportion_ci([bool(r[cap]) for r in rs], clusters=cl, seed=seed), ".2f"),
        ]
    )


def pilot_table(rows: list[dict], model: str, seed: int = 0, rnd: int | None = None) -> str:
    """Markdown: the joined prefill's exact match, truth NLL and capture rate per pilot design (of round ``rnd``)."""
    designs = sorted({(r["n_fragments"], r["fragment_tokens"]) for r in rows})
    hays = sorted({r["set"] for r in rows})
    lines = [
        f"**{model}**, pilot{'' if rnd is None else f' round {rnd}'}, haystacks {hays[0]}-{hays[-1]} "
        "(joined prefill only; 95% intervals: cluster bootstrap over haystacks)",
        "",
        "| fragments x tokens | n questions | haystacks | exact match | truth NLL, nats (answer span) | "
        "distractor captured |",
        "|---|---|---|---|---|---|",
    ]
    for k, t in designs:
        rs = [r for r in rows if (r["n_fragments"], r["fragment_tokens"]) == (k, t)]
        lines.append(f"| {k} x {t} | {_cells(rs, ('ref_em', 'nll_ref', 'ref_captured'), seed)} |")
    return "\n".join(lines)


def parse(comparison: str, primary: str) -> tuple[str, str, str]:
    """``(a, b, outcome)`` of a design's ``"a - b"`` (on ``primary``) or ``"a - b: outcome"``."""
    pair, _, outcome = comparison.partition(":")
    a, b = (s.strip() for s in pair.split(" - "))
    return a, b, outcome.strip() or primary


def _value(r: dict, outcome: str):
    v = r[OUTCOMES[outcome]]
    return bool(v) if OUTCOMES[outcome] in ("em", "captured") else float(v)


def family(rows: list[dict], design: dict, seed: int = 0) -> list[dict]:
    """The design's comparisons, paired per question and resampled by haystack, Holm-adjusted within the model.

    Returns
    -------
    list of dict
        ``label``, ``a``, ``b``, ``outcome``, ``ci`` (of ``a - b``), ``p`` and ``p_holm``, in the design's order.
    """
    by = {s: {_key(r): r for r in rows if r["strategy"] == s} for s in {r["strategy"] for r in rows}}
    comps = []
    for label in design["family"]:
        a, b, outcome = parse(label, design["primary"])
        if outcome not in OUTCOMES:
            raise KeyError(f"comparison {label!r}: no outcome {outcome!r} in {sorted(OUTCOMES)}")
        x, y = by[a], by[b]
        keys = sorted(set(x) & set(y))
        comps.append(
            (
                {"label": label, "a": a, "b": b, "outcome": outcome},
                [_value(x[k], outcome) for k in keys],
                [_value(y[k], outcome) for k in keys],
                [_cluster(x[k]) for k in keys],
            )
        )
    return paired_family(comps, seed=seed)


def _family_table(rows: list[dict], design: dict, seed: int) -> list[str]:
    """The markdown lines of the design's family: each comparison's outcome, n, interval, p and Holm p."""
    lines = [
        "| comparison | outcome | n | haystacks | difference [95% CI] | p | Holm p |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in family(rows, design, seed):
        c = r["ci"]
        lines.append(
            f"| {r['a']} − {r['b']} | {r['outcome']} | {c.n} | {c.n_clusters} | {fmt_ci(c, '+.2f')} | "
            f"{r['p']:.4f} | {r['p_holm']:.4f} |"
        )
    return lines


def arms(rows: list[dict], design: dict, seed: int = 0) -> list[dict]:
    """Per arm: ``n``, ``caches``, ``haystacks``, ``em``, ``nll``, ``captured``, and ``em_right`` over ``n_right``.

    ``em_right`` is exact match over the questions the joined prefill answers right (None if none).
    """
    out = []
    for arm in design["arms"]:
        rs = [r for r in rows if r["strategy"] == arm]
        cl = [_cluster(r) for r in rs]
        right = [r for r in rs if r["ref_em"]]
        out.append(
            {
                "arm": arm,
                "n": len(rs),
                "caches": len({(r["set"], r["cache"]) for r in rs}),
                "haystacks": len(set(cl)),
                "em": proportion_ci([bool(r["em"]) for r in rs], clusters=cl, seed=seed),
                "n_right": len(right),
                "em_right": proportion_ci(
                    [bool(r["em"]) for r in right], clusters=[_cluster(r) for r in right], seed=seed
                )
                if right
                else None,
                "nll": longctx.mean_ci([float(r["nll"]) for r in rs], clusters=cl, seed=seed),
                "captured": proportion_ci([bool(r["captured"]) for r in rs], clusters=cl, seed=seed),
            }
        )
    return out


def by_fragment(rows: list[dict], strategy: str = "reprefill", seed: int = 0) -> list[tuple[int, object]]:
    """``(needle fragment index, exact match CI)`` of ``strategy``: where in the merge the needle was found."""
    rs = [r for r in rows if r["strategy"] == strategy]
    return [
        (f, proportion_ci([bool(r["em"]) for r in g], clusters=[_cluster(r) for r in g], seed=seed))
        for f in sorted({r["needle_fragment"] for r in rs})
        for g in [[r for r in rs if r["needle_fragment"] == f]]
    ]


def markdown(rows: list[dict], model: str, design: dict, seed: int = 0) -> str:
    """Markdown: every arm's outcomes, the reference by needle fragment, then the family named before the run."""
    a = arms(rows, design, seed)
    lo, hi = BAND
    lines = [
        f"**{model}**, {design['n_fragments']} fragments x {design['fragment_tokens']} tokens, recompute at "
        f"r = {design['ratio']}: {a[0]['n']} questions (one needle per cache) in {a[0]['caches']} caches from "
        f"{a[0]['haystacks']} haystacks (95% intervals: cluster bootstrap over haystacks, each with all its caches)",
        "",
        "| arm | exact match | exact match where the joined prefill is right (n) | truth NLL, nats (answer span) | "
        "distractor captured |",
        "|---|---|---|---|---|",
    ]
    for r in a:
        lines.append(
            f"| {r['arm']} | {fmt_ci(r['em'], '.2f')} | {fmt_ci(r['em_right'], '.2f')} ({r['n_right']}) | "
            f"{fmt_ci(r['nll'], '.2f')} | {fmt_ci(r['captured'], '.2f')} |"
        )
    lines += [
        "",
        f"The joined prefill (reprefill) by the needle's fragment (the band asked of it overall: {lo}-{hi}): "
        + "; ".join(f"fragment {f}: {fmt_ci(c, '.2f')}" for f, c in by_fragment(rows, seed=seed)),
        "",
        "The family named before the run (paired per question, resampled by haystack, Holm-adjusted within the model):",
        "",
        *_family_table(rows, design, seed),
    ]
    return "\n".join(lines)


def sides_markdown(rows: list[dict], model: str, design: dict, seed: int = 0) -> str:
    """Markdown: the joined prefill with the distractors before the needle and after it, then the family."""
    lines = [
        f"**{model}**, distractors before or after the needle: {design['n_fragments']} fragments x "
        f"{design['fragment_tokens']} tokens, the needle in the middle one, joined prefill only "
        "(95% intervals: cluster bootstrap over haystacks)",
        "",
        "| distractors | n needles | haystacks | exact match | truth NLL, nats (answer span) | distractor captured |",
        "|---|---|---|---|---|---|",
    ]
    for side in design["arms"]:
        rs = [r for r in rows if r["strategy"] == side]
        lines.append(f"| {side} | {_cells(rs, ('em', 'nll', 'captured'), seed)} |")
    return "\n".join([*lines, "", *_family_table(rows, design, seed)])


def conclusions(rows: list[dict], model: str, design: dict, seed: int = 0) -> list[str]:
    """One sentence per comparison of the family, worded from its interval and Holm p (0.05)."""
    ref = next(r for r in arms(rows, design, seed) if r["arm"] == "reprefill")["em"]
    lo, hi = BAND
    inside = lo <= ref.mean <= hi
    out = [
        f"{model}: the joined prefill answers {fmt_ci(ref, '.2f')}, "
        + ("inside" if inside else "outside")
        + f" the {lo}-{hi} band the design was piloted for."
    ]
    for r in family(rows, design, seed):
        c = r["ci"]
        verdict = (
            f"resolved ({'higher' if c.mean > 0 else 'lower'} under {r['a']})"
            if r["p_holm"] <= 0.05 and c.excludes(0)
            else "not resolved"
        )
        out.append(
            f"{model}: {r['a']} − {r['b']} on {r['outcome']}: {fmt_ci(c, '+.2f')} (n={c.n}, "
            f"{c.n_clusters} haystacks), Holm p {r['p_holm']:.4f}: {verdict}."
        )
    return out


def summary(rows_by_model: dict[str, list[dict]], names: dict[str, str], design: dict, seed: int = 0) -> str:
    """SUMMARY's sentence on the needle study: the reference against its band, and what the family resolves.

    ``rows_by_model``: each model's committed rows; ``names``: the model's name as the page writes it.
    """
    lo, hi = BAND
    refs, parts = [], []
    for m, rows in rows_by_model.items():
        a = {r["arm"]: r for r in arms(rows, design, seed)}
        fam = {r["label"]: r for r in family(rows, design, seed)}
        ref = a["reprefill"]["em"]
        where = "in the band" if lo <= ref.mean <= hi else "below it" if ref.mean < lo else "above it"
        refs.append(f"{fmt_ci(ref, '.2f')} on {names[m]} ({where})")
        rr = fam["rerotate - naive"]
        others = [r for label, r in fam.items() if r["outcome"] == "exact match" and label != "rerotate - naive"]
        held = [r for r in others if r["p_holm"] <= 0.05 and r["ci"].excludes(0)]
        parts.append(
            f"on {names[m]} rerotate − naive exact match {fmt_ci(rr['ci'], '+.2f')} (Holm p {rr['p_holm']:.3f}), "
            + (
                "and no other exact-match comparison of the family is resolved"
                if not held
                else "and " + ", ".join(f"{r['a']} − {r['b']} {fmt_ci(r['ci'], '+.2f')}" for r in held) + " resolved"
            )
            + f"; distractors take {fmt_ci(a['rerotate']['captured'], '.2f')} of rerotate's answers "
            f"and {fmt_ci(a['reprefill']['captured'], '.2f')} of the joined prefill's"
        )
    n = next(iter(rows_by_model.values()))
    haystacks = len({r["set"] for r in n})
    questions = len([r for r in n if r["strategy"] == "reprefill"])
    return (
        f"Among sentences like them (the needle study: {design['n_fragments']} × {design['fragment_tokens']}, "
        f"paraphrased questions, 2-4 distractors of the needle's form; {haystacks} haystacks, {questions} questions "
        f"per model; [README.md](README.md#needles-with-room-to-fail-issue-56)) the joined prefill, piloted for {lo}-{hi}, "
        "answers " + " and ".join(refs) + "; " + "; ".join(parts) + "."
    )
