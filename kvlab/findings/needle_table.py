"""The distractor needle study's tables, its named family and its conclusions, from its committed rows.

One home for what ``studies/needle.py`` prints and what ``results/README.md`` and the tests
recompute, so all of them read the same rows the same way.
"""

from __future__ import annotations

from kvlab.findings import longctx
from kvlab.measure.stats import fmt_ci, proportion_ci

#: A haystack at one design: its caches (one per fragment index) resampled together.
CLUSTER = ("n_fragments", "fragment_tokens", "set")
#: The reference's exact match the design must reach on each model (issue 56: room to fail, and to succeed).
BAND = (0.6, 0.9)


def _cluster(r: dict) -> tuple:
    return tuple(r[c] for c in CLUSTER)


def pilot_table(rows: list[dict], model: str, seed: int = 0) -> str:
    """Markdown: the joined prefill's exact match, truth NLL and capture rate per pilot design."""
    designs = sorted({(r["n_fragments"], r["fragment_tokens"]) for r in rows})
    lines = [
        f"**{model}**, pilot (joined prefill only; 95% intervals: cluster bootstrap over haystacks)",
        "",
        "| fragments x tokens | n questions | haystacks | exact match | truth NLL, nats | distractor captured |",
        "|---|---|---|---|---|---|",
    ]
    for k, t in designs:
        rs = [r for r in rows if (r["n_fragments"], r["fragment_tokens"]) == (k, t)]
        cl = [_cluster(r) for r in rs]
        em = proportion_ci([bool(r["ref_em"]) for r in rs], clusters=cl, seed=seed)
        cap = proportion_ci([bool(r["ref_captured"]) for r in rs], clusters=cl, seed=seed)
        nll = longctx.mean_ci([float(r["nll_ref"]) for r in rs], clusters=cl, seed=seed)
        lines.append(
            f"| {k} x {t} | {len(rs)} | {len(set(cl))} | {fmt_ci(em, '.2f')} | {fmt_ci(nll, '.2f')} | {fmt_ci(cap, '.2f')} |"
        )
    return "\n".join(lines)
