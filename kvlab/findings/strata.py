"""A merge's damage by stratum: pooled, by the passage holding the answer, and where the reference is right.

A pooled difference can hide opposite effects (at 2 x 512 on SmolLM2 naive answers passage 0
better than rerotate and passage 1 worse), and a difference in KL against the joined prefill
means little where that reference answers wrong. So each paired difference ``a - b`` (naive -
rerotate by default) is stated per fragment count over the merges' questions, split by stratum:

* ``pooled``: every question of the count;
* ``passage i``: the questions whose answer stands in passage ``i`` (``answer_passage``);
* ``reference right`` / ``reference wrong``: the questions the joined prefill answers exactly
  (``ref_em``) or not.

Rows of one fragment (``n_fragments == 1``) are left out: there every merge is the joined
prefill, and pooling them would credit a merge with answers it never had to make. Intervals are
kvlab's cluster bootstrap over caches (:func:`kvlab.paired_diff_ci`), each with its raw
:func:`kvlab.measure.stats.paired_p` and Holm's adjustment within its family (:func:`kvlab.measure.stats.holm`): one family
per model and metric, holding every count x stratum comparison this module names.

Read from the rows a study committed (``results/long_context_<model>.csv``); no model is run.
"""

from __future__ import annotations

from pathlib import Path

from kvlab.findings import rows as committed
from kvlab.findings.longctx import pairs
from kvlab.measure.stats import fmt_ci, paired_family

#: The metrics whose ``a - b`` is stated: answer-span KL against the joined prefill (nats/token),
#: the truth's NLL (nats) and exact match with the truth.
METRICS = ("span_kl", "nll", "em")

#: CSV columns that hold text even when they read as a number (an answer "1893").
TEXT = {"question", "kind", "strategy", "answer", "truth", "ref_answer"}


def read_rows(path: str | Path) -> list[dict]:
    """The rows of the long-context study's per-question CSV, typed back (:func:`kvlab.findings.rows.read_rows`)."""
    return committed.read_rows(path, TEXT)


def merges(rows: list[dict]) -> list[dict]:
    """The rows of real merges: count 1 (where every merge is the joined prefill) left out."""
    return [r for r in rows if int(r["n_fragments"]) > 1]


def strata(rows: list[dict], n_fragments: int) -> list[tuple[str, dict]]:
    """``(stratum, where)`` for one count: pooled, each answer passage, reference right and wrong."""
    at = [r for r in rows if r["n_fragments"] == n_fragments]
    out = [("pooled", {"n_fragments": n_fragments})]
    out += [
        (f"passage {p}", {"n_fragments": n_fragments, "answer_passage": p})
        for p in sorted({r["answer_passage"] for r in at})
    ]
    out += [("reference right", {"n_fragments": n_fragments, "ref_em": True})]
    out += [("reference wrong", {"n_fragments": n_fragments, "ref_em": False})]
    return out


def compare(rows: list[dict], a: str = "naive", b: str = "rerotate", *, seed: int = 0) -> list[dict]:
    """``metric(a) - metric(b)`` per count, stratum and metric, paired and resampled by cache, Holm within family.

    Returns
    -------
    list of dict
        ``n_fragments``, ``stratum``, ``metric``, ``family`` (``"<metric>: <a> - <b>, every count x stratum"``),
        ``ci`` (:class:`kvlab.CI`), ``p`` and ``p_holm``.
    """
    rows = merges(rows)

    def family(metric: str, name: str):
        for k in sorted({r["n_fragments"] for r in rows}):
            for stratum, where in strata(rows, k):
                x, y, caches = pairs(rows, a, b, metric, where)
                if x:
                    yield {"n_fragments": k, "stratum": stratum, "metric": metric, "family": name}, x, y, caches

    out = []
    for metric in METRICS:
        name = f"{metric}: {a} - {b}, every count x stratum"
        out += paired_family(family(metric, name), seed=seed)
    return out


SPECS = {"span_kl": "+.3f", "nll": "+.3f", "em": "+.2f"}
NAMES = {"span_kl": "answer-span KL", "nll": "truth NLL", "em": "exact match"}


def markdown(model: str, rows: list[dict], a: str = "naive", b: str = "rerotate", *, seed: int = 0) -> str:
    """The strata table of one model: per count and stratum, ``a - b`` in each metric with n, caches and Holm's p."""
    res = compare(rows, a, b, seed=seed)
    by = {(r["n_fragments"], r["stratum"], r["metric"]): r for r in res}
    keys = list(dict.fromkeys((r["n_fragments"], r["stratum"]) for r in res))
    out = [
        f"#### {model}: {a} - {b} by stratum",
        "",
        "| fragments | stratum | questions / caches | "
        + " | ".join(f"{NAMES[m]} [95% CI] (Holm p)" for m in METRICS)
        + " |",
        "|---|---|---|" + "---|" * len(METRICS),
    ]
    for k, s in keys:
        first = by[k, s, METRICS[0]]["ci"]
        cells = []
        for m in METRICS:
            r = by[k, s, m]
            mark = "**" if r["p_holm"] <= 0.05 else ""
            cells.append(f"{mark}{fmt_ci(r['ci'], SPECS[m])}{mark} ({r['p_holm']:.3f})")
        out.append(f"| {k} | {s} | {first.n} / {first.n_clusters} | " + " | ".join(cells) + " |")
    out += [
        "",
        f"Paired over the same questions, 95% cluster bootstrap over caches; bold: Holm-adjusted p <= 0.05 within "
        f"the family of its metric (every count x stratum above, {len(keys)} comparisons). Count 1 is excluded. "
        "Reference: the joined prefill; span KL is measured against it, exact match and NLL against the truth.",
    ]
    return "\n".join(out) + "\n"
