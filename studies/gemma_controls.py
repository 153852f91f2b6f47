"""Gemma 3 controls (issue 24, part 2): does a naive merge collapse inside the sliding window too,
which layer type carries the collapse, and which carries rerotate's remaining context gap?

Every Gemma 3 cell of the long-context study was already past the 512-token window of its
sliding layers, and its two layer types turn keys with two rope bases (10k sliding, 1M full).
This study reads the long-context questions behind two fragments, inside the window
(2 x 200 and 2 x 250 tokens: about 400 and 495 < 512) and past it (2 x 270: about 535, nearly
the offset of 2 x 250; and 2 x 512), one length per point of ``kvlab sweep
studies/gemma_controls.toml``, behind:

* ``naive`` and ``rerotate``;
* ``rerotate sliding only`` / ``rerotate full only`` (``kvlab.cache.repro.RerotateOnly``):
  rerotate on one layer type, naive on the other;
* ``exact sliding only`` / ``exact full only`` (``kvlab.cache.repro.ExactOnly``): the joined
  prefill's K/V on one layer type, rerotate's on the other;

and the joined prefill of the same tokens (the reference: KL 0; its exact match is the ceiling).

Named before the run, at each length, paired within caches, 95% cluster bootstrap over caches:

1. naive - rerotate, answer-span KL, first-token KL and exact match (a collapse inside the
   window?); the straddle is 2 x 250 against 2 x 270, whose offsets differ by 8% while only the
   second passes the window (separate caches: two intervals side by side, not a paired test);
2. the share of naive's excess answer-span KL over rerotate that rerotating only one layer type
   removes (``kvlab.measure.stats.gap_closed_ci`` of (only - rerotate) against (naive - rerotate));
3. the share of rerotate's own answer-span KL (its context gap) that the joined prefill's K/V on
   one layer type removes (``kvlab.measure.stats.gap_closed_ci`` of exact-only against rerotate).

    .venv/bin/kvlab sweep studies/gemma_controls.toml --workers 2     # results/gemma_controls/
    .venv/bin/python studies/gemma_controls.py --sweep-table results/gemma_controls
    .venv/bin/python studies/gemma_controls.py --markdown results/gemma_controls   # the README section's numbers

The comparisons of 1. at every length form one family, Holm-adjusted (:func:`family`); the shares
of 2. and 3. are estimates with intervals, not tests. :func:`markdown` prints the tables and the
measured lines of ``results/README.md``'s section from the committed rows alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import kvlab
from kvlab.cache.repro import ExactOnly, RerotateOnly
from kvlab.findings import longctx, strata
from kvlab.findings.rows import point_rows_path
from kvlab.measure.stats import fmt_ci, gap_closed_ci, paired_family
from kvlab.sweep.point import read_points

RER_ONLY = ("rerotate sliding only", "rerotate full only")
EXACT_ONLY = ("exact sliding only", "exact full only")
#: Gemma 3 270M's sliding window in tokens (its config's ``sliding_window``; a test checks it).
WINDOW = 512
#: The metrics of comparison 1., their names and formats.
FAMILY_METRICS = (
    ("span_kl", "answer-span KL", "+.3f"),
    ("kl", "first-token KL", "+.3f"),
    ("em", "exact match", "+.2f"),
)


def strategies() -> dict:
    return {
        "naive": kvlab.Naive(),
        "rerotate": kvlab.Rerotate(),
        RER_ONLY[0]: RerotateOnly("sliding_attention"),
        RER_ONLY[1]: RerotateOnly("full_attention"),
        EXACT_ONLY[0]: ExactOnly("sliding_attention"),
        EXACT_ONLY[1]: ExactOnly("full_attention"),
    }


def excess(rows: list[dict], a: str) -> tuple[list, list, list]:
    """Per question: (a - rerotate, naive - rerotate) answer-span KL and the cache labels."""
    x, r, caches = longctx.pairs(rows, a, "rerotate", "span_kl", None)
    y, r2, caches2 = longctx.pairs(rows, "naive", "rerotate", "span_kl", None)
    if caches != caches2 or list(r) != list(r2):
        raise kvlab.KvlabError(f"{a!r} and naive were not read over the same questions")
    return [a_ - b for a_, b in zip(x, r)], [n - b for n, b in zip(y, r)], caches


def summarise(rows: list[dict], seed: int = 0) -> dict:
    """Per strategy, the paired differences and the shares named in the module docstring (one length)."""
    summary = longctx.json_ready(longctx.summarize(rows, ("strategy",), seed=seed))
    diffs = {}
    for a in ("naive", *RER_ONLY, *EXACT_ONLY):
        for m in ("span_kl", "kl", "em"):
            diffs[f"{a} - rerotate {m}"] = longctx.paired(rows, a, "rerotate", m, seed=seed).as_dict()
    shares = {}
    for a in (*RER_ONLY, *EXACT_ONLY):
        if a in RER_ONLY:
            key, (x, y, caches) = f"{a}: of naive's excess", excess(rows, a)
        else:
            key, (x, y, caches) = f"{a}: of rerotate's gap", longctx.pairs(rows, a, "rerotate", "span_kl", None)
        if sum(y) > 0:
            shares[key] = gap_closed_ci(x, y, clusters=caches, seed=seed).as_dict()
        else:  # no error to remove: a share of it is undefined, not 0
            shares[key] = {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": len(x)}
            shares[key]["caches"] = len(set(caches))
    return {"summary": summary, "paired_differences": diffs, "shares": shares}


def measure(model, tokens: int, *, sets=20, people=1, max_questions=12, greedy_tokens=5, seed=0, log=None):
    """Two fragments of at most ``tokens`` tokens, ``sets`` caches: the rows and the summary document."""
    rows, timings = longctx.run(
        model,
        [2],
        tokens,
        seed=seed,
        people_per_passage=people,
        max_questions=max_questions,
        greedy_tokens=greedy_tokens,
        sets=sets,
        strategies=strategies(),
        log=log,
    )
    totals = [r["total_tokens"] for r in rows]
    args = dict(tokens=tokens, sets=sets, people=people, max_questions=max_questions, greedy_tokens=greedy_tokens)
    doc = {"model": model.name, "args": {**args, "seed": seed}, "total_tokens": [min(totals), max(totals)]}
    return rows, {**doc, **summarise(rows, seed)}


def records(doc: dict) -> list[tuple[str, float, dict]]:
    """``(name, value, keywords)`` for :func:`kvlab.findings.records.record`: every strategy's answer-span KL and exact match,
    every paired difference and every share, each with its interval, n and caches."""
    out = []

    def put(name, c, unit=""):
        out.append((name, c["mean"], dict(unit=unit, ci=(c["lo"], c["hi"]), n=c["n"], caches=c["caches"])))

    for s in doc["summary"]:
        slug = s["strategy"].replace(" ", "_")
        put(f"{slug}_span_kl", s["span_kl"], "nats/token")
        put(f"{slug}_em", s["em"])
        if s["strategy"] == "naive":
            put("ceiling_em", s["ref_em"])
    for k, c in doc["paired_differences"].items():
        put(k.replace(" - ", "_minus_").replace(" ", "_"), c, "" if k.endswith("em") else "nats/token")
    for k, c in doc["shares"].items():
        put(
            "share_" + k.split(":")[0].replace(" ", "_") + ("_of_naive_excess" if "naive" in k else "_of_rerotate_gap"),
            c,
        )
    return out


def tables(doc: dict) -> str:
    f = lambda c, p=3: fmt_ci(c, f".{p}f")  # noqa: E731
    g = lambda c: fmt_ci(c, "+.3f")  # noqa: E731
    lo, hi = doc["total_tokens"]
    out = [
        f"{doc['model']}, 2 x <={doc['args']['tokens']} tokens (merged totals {lo}-{hi}):",
        "",
        "| strategy | n q / caches | answer-span KL | first-token KL | exact match | ceiling |",
        "|---|---|---|---|---|---|",
    ]
    for s in doc["summary"]:
        out.append(
            f"| {s['strategy']} | {s['n']} / {s['n_caches']} | {f(s['span_kl'])} | {f(s['kl'])} | "
            f"{f(s['em'], 2)} | {f(s['ref_em'], 2)} |"
        )
    out += ["", "| paired comparison | difference [95% CI] |", "|---|---|"]
    out += [f"| {k} | {g(v)} |" for k, v in doc["paired_differences"].items()]
    out += ["", "| share removed | [95% CI] |", "|---|---|"]
    out += [f"| {k} | {f(v, 2)} |" for k, v in doc["shares"].items()]
    return "\n".join(out)


def _recorded(point: dict, folder: Path) -> tuple[dict[str, dict], bool]:
    """A point's records by name: recomputed from its committed rows where it has them (then ``True``)."""
    par = point["parameters"]
    path = point_rows_path(folder, par["model_name"], par["tokens"])
    if not path.exists():
        return {r["name"]: r for r in point["records"]}, False
    doc = summarise(strata.read_rows(path), par.get("seed", 0))
    rec = {}
    for name, value, kw in records(doc):
        lo, hi = kw["ci"]
        rec[name] = {"value": value, "ci_low": lo, "ci_high": hi, "n": kw["n"], "extra": {"caches": kw["caches"]}}
    return rec, True


def sweep_table(folder: Path) -> str:
    """One row per length from a ``kvlab sweep studies/gemma_controls.toml`` output folder.

    A point that committed its rows (``rows_<model>_<tokens>.csv``) has every interval recomputed
    from them (the same functions and seed as the run); an older point's come from its records.
    """
    points = read_points(folder)
    points = sorted((p for p in points if p["status"] == "ok"), key=lambda p: p["parameters"]["tokens"])
    f = lambda r, fmt=".2f": f"{r['value']:{fmt}} [{r['ci_low']:{fmt}}, {r['ci_high']:{fmt}}]"  # noqa: E731
    out = [
        "| 2 x tokens | n q / caches | naive - rerotate span KL | naive - rerotate exact match | "
        "naive's excess removed: rerotate sliding only | full only | rerotate's gap removed: exact sliding only | "
        "full only | rerotate span KL | wall | from |",
        "|" + "---|" * 11,
    ]
    for p in points:
        rec, from_rows = _recorded(p, folder)
        d = rec["naive_minus_rerotate_span_kl"]
        out.append(
            f"| {p['parameters']['tokens']} | {d['n']} / {d['extra']['caches']} | {f(d, '+.3f')} | "
            f"{f(rec['naive_minus_rerotate_em'], '+.3f')} | {f(rec['share_rerotate_sliding_only_of_naive_excess'])} | "
            f"{f(rec['share_rerotate_full_only_of_naive_excess'])} | {f(rec['share_exact_sliding_only_of_rerotate_gap'])} | "
            f"{f(rec['share_exact_full_only_of_rerotate_gap'])} | {f(rec['rerotate_span_kl'], '.3f')} | "
            f"{p['wall_s'] / 60:.1f} min | {'rows' if from_rows else 'records'} |"
        )
    return "\n".join(out)


def point_rows(folder: Path) -> list[tuple[int, dict, list[dict]]]:
    """``(tokens, point, rows)`` per length, shortest first, from the rows each point committed.

    Raises
    ------
    kvlab.KvlabError
        When a point committed no rows: :func:`markdown` prints from rows only.
    """
    out = []
    for p in sorted((p for p in read_points(folder) if p["status"] == "ok"), key=lambda p: p["parameters"]["tokens"]):
        par = p["parameters"]
        path = point_rows_path(folder, par["model_name"], par["tokens"])
        if not path.exists():
            raise kvlab.KvlabError(f"{path}: the point at {par['tokens']} tokens committed no rows")
        out.append((par["tokens"], p, strata.read_rows(path)))
    if not out:
        raise kvlab.KvlabError(f"{folder}: no finished point")
    return out


def family(loaded: list[tuple[int, dict, list[dict]]], seed: int = 0) -> list[dict]:
    """Comparison 1. (naive - rerotate in each metric of :data:`FAMILY_METRICS`) at every length: one Holm family.

    Returns :func:`kvlab.measure.stats.paired_family`'s dicts with ``tokens`` and ``metric`` added, in order.
    """
    comparisons = []
    for tokens, _, rows in loaded:
        for metric, _, _ in FAMILY_METRICS:
            x, y, caches = longctx.pairs(rows, "naive", "rerotate", metric, None)
            comparisons.append(({"tokens": tokens, "metric": metric}, x, y, caches))
    return paired_family(comparisons, seed=seed)


def _where(lo: int, hi: int) -> str:
    if hi < WINDOW:
        return "inside the window"
    return "past the window" if lo >= WINDOW else "straddling the window"


def markdown(folder: Path, seed: int = 0) -> str:
    """``results/README.md``'s tables and measured lines for the study, printed from its committed rows only.

    A named comparison is called resolved when its Holm-adjusted p is at most 0.05.
    """
    loaded = point_rows(folder)
    fam = {(r["tokens"], r["metric"]): r for r in family(loaded, seed)}
    docs = {t: summarise(rows, seed) for t, _, rows in loaded}
    summ = {t: {s["strategy"]: s for s in d["summary"]} for t, d in docs.items()}
    span = {t: (min(r["total_tokens"] for r in rows), max(r["total_tokens"] for r in rows)) for t, _, rows in loaded}
    lengths = [t for t, _, _ in loaded]
    f2 = lambda c: fmt_ci(c, ".2f")  # noqa: E731
    order = ("naive", "rerotate", *RER_ONLY, *EXACT_ONLY)
    out = [
        sweep_table(folder),
        "",
        "Exact match [95% CI] of every strategy, and of the joined prefill (the ceiling):",
        "",
    ]
    out += [
        "| 2 × tokens | merged tokens | joined prefill | " + " | ".join(order) + " |",
        "|" + "---|" * (3 + len(order)),
    ]
    for t in lengths:
        lo, hi = span[t]
        out.append(
            f"| {t} | {lo}-{hi} ({_where(lo, hi)}) | {f2(summ[t]['naive']['ref_em'])} | "
            + " | ".join(f2(summ[t][s]["em"]) for s in order)
            + " |"
        )
    out += ["", "The named family (naive − rerotate at every length and metric; paired, Holm within it):", ""]
    out += ["| 2 × tokens | metric | naive − rerotate [95% CI] | p | Holm p |", "|---|---|---|---|---|"]
    for t in lengths:
        for metric, name, spec in FAMILY_METRICS:
            r = fam[t, metric]
            out.append(f"| {t} | {name} | {fmt_ci(r['ci'], spec)} | {r['p']:.4f} | {r['p_holm']:.4f} |")

    def said(t, metric, spec):
        r = fam[t, metric]
        verdict = "resolved" if r["p_holm"] <= 0.05 else "not resolved"
        return f"{t} {fmt_ci(r['ci'], spec)} ({verdict})"

    top = lengths[-1]
    n0 = summ[lengths[0]]["naive"]
    shares = {t: d["shares"] for t, d in docs.items()}
    rer = lambda t, i: fmt_ci(shares[t][f"{RER_ONLY[i]}: of naive's excess"], ".0%")  # noqa: E731
    exact_full = lambda t: shares[t][f"{EXACT_ONLY[1]}: of rerotate's gap"]  # noqa: E731
    exact_sliding = lambda t: shares[t][f"{EXACT_ONLY[0]}: of rerotate's gap"]  # noqa: E731
    apart = all(exact_full(t)["lo"] > exact_sliding(t)["hi"] for t in lengths)
    right = {
        t: longctx.paired(rows, "naive", "rerotate", "span_kl", where={"ref_em": True}, seed=seed)
        for t, _, rows in loaded
    }
    ef = {t: longctx.paired(rows, EXACT_ONLY[1], "rerotate", "em", seed=seed) for t, _, rows in loaded}
    out += [
        "",
        f"Measured ({n0['n_caches']} caches and {n0['n']} questions per length; the window is {WINDOW} tokens):",
        "",
        "* naive − rerotate, answer-span KL (nats/token): "
        + "; ".join(said(t, "span_kl", "+.3f") for t in lengths)
        + "; exact match: "
        + "; ".join(said(t, "em", "+.2f") for t in lengths)
        + ".",
        "* the same answer-span KL where the joined prefill is right (paired, not in the family): "
        + "; ".join(f"{t} {fmt_ci(right[t], '+.3f')} (n {right[t].n})" for t in lengths)
        + ".",
        f"* at 2 × {top}, naive's exact match {f2(summ[top]['naive']['em'])}; rerotating the sliding layers only "
        f"removes {rer(top, 0)} of naive's excess answer-span KL over rerotate and the full layers only "
        f"{rer(top, 1)} (exact match {f2(summ[top][RER_ONLY[1]]['em'])}); at 2 × {lengths[0]} the two shares are "
        f"{rer(lengths[0], 0)} and {rer(lengths[0], 1)} (not compared as a pair).",
        "* of rerotate's own answer-span KL, the joined prefill's K/V on the full layers only removes "
        + ", ".join(f"{fmt_ci(exact_full(t), '.0%')}" for t in lengths)
        + " and on the sliding layers only "
        + ", ".join(f"{fmt_ci(exact_sliding(t), '.0%')}" for t in lengths)
        + f" (lengths {', '.join(map(str, lengths))}); the intervals are "
        + ("apart at every length." if apart else "not apart at every length."),
        "* exact match, exact full only − rerotate (paired, not in the family): "
        + "; ".join(f"{t} {fmt_ci(ef[t], '+.2f')}" for t in lengths)
        + ".",
    ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--sweep-table", metavar="DIR", help="print the table of a kvlab sweep output folder")
    what.add_argument("--markdown", metavar="DIR", help="print the README section's tables and lines from its rows")
    args = ap.parse_args()
    print(sweep_table(Path(args.sweep_table)) if args.sweep_table else markdown(Path(args.markdown)))


if __name__ == "__main__":
    main()
