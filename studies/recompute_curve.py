"""The recompute curve (issue 24, part 3): how much of rerotate's answer-span error does selective
recompute remove at each ratio, per policy, and at what ratio does it remove 90%?

The long-context questions (one person per passage) behind merges of 4 fragments of at most 256
tokens, read behind rerotate, reprefill (the reference: error 0) and recompute at ratios 0.05, 0.1,
0.15, 0.3, 0.5, 0.6 and 0.7 (below every cache's r*, about 0.73-0.76) with three policies:
``deviation`` (CacheBlend's selection), ``fragment_start`` (EPIC's) and ``random_later`` (the fair
control: seeded, from the tokens after fragment 0, the only ones a recompute can change). Ratio 0 is
rerotate bit for bit and ratio 1 the joined prefill (``kvlab certify`` checks both), so the curve
runs from 0 to 1 by construction.

Named before the run: for each policy and ratio, the share of rerotate's answer-span KL it
removes, ``1 - mean(recompute) / mean(rerotate)`` over the same questions
(``kvlab.measure.stats.gap_closed_ci``, resampled by cache, 95%); and per policy ``r90``, the ratio removing 90%,
by linear interpolation of that curve, with a cluster-bootstrap interval over caches (the whole
curve resampled at once). Exact match against the truth is reported beside it.

The curve's far end is ``r* = (N - L0) / N`` (N the merged tokens, L0 fragment 0's): a recompute
of that many tokens recomputes every token after fragment 0, which every policy here does at r*
(they pick among those tokens first), so it *is* the joined prefill and removes the whole gap.
The curve runs through (0, 0), the measured ratios and (r*, 1), r* the mean over the caches in
the sample (each cache's from its rows: ``total_tokens``, ``first_tokens``); a ratio above r*
adds nothing. (The first run of this study ended the curve at (1, 1), which put r90 beyond r*; the
second measured up to 0.5 only, so every r90 lay on the line from 0.5 to r*.) :func:`bracket` says
between which two points each r90 lies.

    .venv/bin/python studies/recompute_curve.py --model smollm2-135m --sets 12
    .venv/bin/python studies/recompute_curve.py --model smollm2-135m --table
    .venv/bin/python studies/recompute_curve.py --sweep-table results/recompute_curve   # after kvlab sweep
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import kvlab
from kvlab.atomic import atomic_write_text
from kvlab.findings import longctx, strata
from kvlab.findings import rows as committed
from kvlab.findings.curve import label, r90
from kvlab.findings.rows import point_rows_path
from kvlab.measure.stats import fmt_ci
from kvlab.sweep.point import read_points

RATIOS = (0.05, 0.1, 0.15, 0.3, 0.5, 0.6, 0.7)
POLICIES = ("deviation", "fragment_start", "random_later")


def strategies(ratios, policies, seed: int) -> dict:
    out = {"rerotate": kvlab.Rerotate(), "reprefill": kvlab.Reprefill()}
    for p in policies:
        for r in ratios:
            out[label(p, r)] = kvlab.Recompute(ratio=r, policy=p, seed=seed)
    return out


def summarise(rows: list[dict], ratios, policies, seed: int) -> dict:
    summary = longctx.json_ready(longctx.summarize(rows, ("strategy",), seed=seed))
    shares, em = {}, {}
    for p in policies:
        for r in ratios:
            shares[label(p, r)] = longctx.gap_closed(rows, label(p, r), "rerotate", "span_kl", seed=seed).as_dict()
            em[label(p, r)] = longctx.paired(rows, label(p, r), "rerotate", "em", seed=seed).as_dict()
    return {
        "summary": summary,
        "share_of_rerotate_span_kl_removed": shares,
        "paired_em_minus_rerotate": em,
        "r90": {p: r90(rows, p, ratios, seed) for p in policies},
    }


def tables(doc: dict) -> str:
    ratios, policies = doc["args"]["ratios"], doc["args"]["policies"]
    f = lambda c, p=2: fmt_ci(c, f".{p}f")  # noqa: E731
    head = "| policy | " + " | ".join(f"r = {r:g}" for r in ratios) + " | r90 |"
    out = [
        f"Share of rerotate's answer-span KL removed ({doc['model']}, {doc['args']['count']} x "
        f"{doc['args']['tokens']} tokens):",
        "",
        head,
        "|" + "---|" * (len(ratios) + 2),
    ]
    for p in policies:
        cells = [f(doc["share_of_rerotate_span_kl_removed"][label(p, r)]) for r in ratios]
        out.append(f"| {p} | " + " | ".join(cells) + f" | {f(doc['r90'][p])} (r* {doc['r90'][p]['r_star']:.2f}) |")
    out += [
        "",
        "Exact match, recompute - rerotate (paired):",
        "",
        head.replace(" r90 |", ""),
        "|" + "---|" * (len(ratios) + 1),
    ]
    g = lambda c: fmt_ci(c, "+.3f")  # noqa: E731
    for p in policies:
        out.append(f"| {p} | " + " | ".join(g(doc["paired_em_minus_rerotate"][label(p, r)]) for r in ratios) + " |")
    by = {s["strategy"]: s for s in doc["summary"]}
    rot, ref = by["rerotate"], by["reprefill"]
    out += [
        "",
        f"rerotate: answer-span KL {f(rot['span_kl'], 3)} nats/token, exact match {f(rot['em'])}; reprefill's "
        f"exact match (the ceiling) {f(ref['em'])}; n = {rot['n']} questions over {rot['n_caches']} caches",
    ]
    return "\n".join(out)


def measure(
    model: kvlab.LoadedModel,
    *,
    policies=POLICIES,
    ratios=RATIOS,
    count: int = 4,
    tokens: int = 256,
    sets: int = 12,
    people: int = 1,
    max_questions: int = 6,
    greedy_tokens: int = 5,
    seed: int = 0,
    log=None,
) -> tuple[list[dict], dict]:
    """Read the questions behind every strategy; the rows and the summary document (without wall time)."""
    rows, _ = longctx.run(
        model,
        [count],
        tokens,
        seed=seed,
        people_per_passage=people,
        max_questions=max_questions,
        greedy_tokens=greedy_tokens,
        sets=sets,
        strategies=strategies(ratios, policies, seed),
        log=log,
    )
    args = dict(count=count, tokens=tokens, ratios=list(ratios), policies=list(policies), sets=sets, people=people)
    args.update(max_questions=max_questions, greedy_tokens=greedy_tokens, seed=seed)
    return rows, {"model": model.name, "args": args, **summarise(rows, ratios, policies, seed)}


def _between(x: dict) -> str:
    lo, hi = x["between"]
    return f"{lo:g} and {hi:g} (measured)" if hi is not None else f"{lo:g} and r* (interpolated)"


def sweep_table(folder: Path) -> str:
    """The markdown tables of a ``kvlab sweep studies/recompute_curve.toml`` output folder.

    Every interval is recomputed from each point's committed rows (``rows_<model>_<policy>.csv``,
    the same functions and seed as the run), so r90 is anchored at r*; a point without rows (a run
    before they were kept) is refused rather than shown with its old anchor.
    """
    points = read_points(folder)
    out = []
    for model in dict.fromkeys(p["parameters"]["model_name"] for p in points):
        mine = [p for p in points if p["parameters"]["model_name"] == model and p["status"] == "ok"]
        docs = []
        for p in mine:
            par = p["parameters"]
            path = point_rows_path(folder, model, par["policy"])
            if not path.exists():
                raise FileNotFoundError(f"{path}: point {p['point']} committed no rows; rerun the sweep")
            rows = strata.read_rows(path)
            docs.append(summarise(rows, par["ratios"], [par["policy"]], par.get("seed", 0)))
        ratios = mine[0]["parameters"]["ratios"]
        f = lambda c, fmt=".2f": fmt_ci(c, fmt)  # noqa: E731
        rot = {s["strategy"]: s for s in docs[0]["summary"]}["rerotate"]
        out += [
            f"{model}: share of rerotate's answer-span KL removed ({rot['n']} questions over "
            f"{rot['n_caches']} caches; rerotate's answer-span KL {f(rot['span_kl'], '.3f')} nats/token)",
            "",
            "| policy | " + " | ".join(f"r = {r:g}" for r in ratios) + " | r90 | r90 between | r* (range) | wall |",
            "|" + "---|" * (len(ratios) + 5),
        ]
        for p, doc in zip(mine, docs):
            pol = p["parameters"]["policy"]
            cells = [f(doc["share_of_rerotate_span_kl_removed"][label(pol, r)]) for r in ratios]
            x = doc["r90"][pol]
            out.append(
                f"| {pol} | "
                + " | ".join(cells)
                + f" | {f(x)} | {_between(x)} | {x['r_star']:.2f} ({x['r_star_min']:.2f}-"
                f"{x['r_star_max']:.2f}) | {p['wall_s'] / 60:.1f} min |"
            )
        out += ["", "Exact match, recompute - rerotate (paired):", ""]
        out += ["| policy | " + " | ".join(f"r = {r:g}" for r in ratios) + " |", "|" + "---|" * (len(ratios) + 1)]
        for p, doc in zip(mine, docs):
            pol = p["parameters"]["policy"]
            cells = [f(doc["paired_em_minus_rerotate"][label(pol, r)], "+.3f") for r in ratios]
            out.append(f"| {pol} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--count", type=int, default=4, help="fragments per merge")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per fragment (at most)")
    ap.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--sets", type=int, default=12, help="independent generated sets (caches)")
    ap.add_argument("--people", type=int, default=1)
    ap.add_argument("--max-questions", type=int, default=6)
    ap.add_argument("--greedy-tokens", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results")
    ap.add_argument("--table", action="store_true", help="print the tables of --out's JSON and stop")
    ap.add_argument("--sweep-table", metavar="DIR", help="print the tables of a kvlab sweep output folder and stop")
    args = ap.parse_args()
    if args.sweep_table:
        print(sweep_table(Path(args.sweep_table)))
        return
    path = Path(args.out) / f"recompute_curve_{args.model}.json"
    if args.table:
        print(tables(json.loads(path.read_text())))
        return
    started = time.perf_counter()
    model = kvlab.load_model(args.model)
    rows, doc = measure(
        model,
        policies=args.policies,
        ratios=args.ratios,
        count=args.count,
        tokens=args.tokens,
        sets=args.sets,
        people=args.people,
        max_questions=args.max_questions,
        greedy_tokens=args.greedy_tokens,
        seed=args.seed,
        log=lambda m: print(m, flush=True),
    )
    committed.write_rows(path.with_suffix(".csv"), rows)
    doc = {**doc, "command": " ".join(["studies/recompute_curve.py"] + sys.argv[1:])}
    doc["wall_s"] = time.perf_counter() - started
    atomic_write_text(path, json.dumps(doc, indent=1, default=float))
    print(tables(doc))
    print(f"done in {doc['wall_s']:.0f} s -> {path}")


if __name__ == "__main__":
    main()
