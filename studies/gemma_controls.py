"""Gemma 3 controls (issue 24, part 2): does a naive merge collapse inside the sliding window too,
and which layer type carries the collapse?

Every Gemma 3 cell of the long-context study was already past the 512-token window of its
sliding layers, and its two layer types turn keys with two rope bases (10k sliding, 1M full).
This study reads the long-context questions behind two fragments, inside the window
(2 x 200 and 2 x 250 tokens: about 400 and 495 < 512) and past it (2 x 270: about 535, nearly
the offset of 2 x 250; and 2 x 512), for naive, rerotate, rerotate on the sliding
layers only (naive on the full ones), rerotate on the full layers only, and reprefill (the
reference).

Named before the run, paired within caches, 95% cluster bootstrap over caches:

1. naive - rerotate, answer-span KL and exact match, at each length (is there a collapse inside
   the window?), and the straddle: 2 x 250 against 2 x 270, whose offsets differ by 8% while
   only the second passes the window;
2. at each length, the share of naive's excess answer-span KL over rerotate that rerotating
   only one layer type removes (``kvlab.gap_closed_ci`` of (only - rerotate) against
   (naive - rerotate)), and each ablation's exact match against rerotate's.

    .venv/bin/python studies/gemma_controls.py --sets 20      # results/gemma_controls_gemma3-270m.{csv,json}
    .venv/bin/python studies/gemma_controls.py --table            # the tables of the committed run
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import kvlab
from kvlab.atomic import atomic_path, atomic_write_text
from kvlab.cache.repro import RerotateOnly
from kvlab.findings import longctx

STRATEGIES = {
    "naive": kvlab.Naive(),
    "rerotate": kvlab.Rerotate(),
    "rerotate sliding only": RerotateOnly("sliding_attention"),
    "rerotate full only": RerotateOnly("full_attention"),
    "reprefill": kvlab.Reprefill(),
}
ONLY = ("rerotate sliding only", "rerotate full only")


def excess(rows: list[dict], a: str, tokens: int) -> tuple[list, list, list]:
    """Per question of one length: (a - rerotate, naive - rerotate) answer-span KL and the cache labels."""
    where = {"fragment_tokens": tokens}
    x, r, caches = longctx.pairs(rows, a, "rerotate", "span_kl", where)
    y, r2, caches2 = longctx.pairs(rows, "naive", "rerotate", "span_kl", where)
    assert caches == caches2 and list(r) == list(r2)
    return [a_ - b for a_, b in zip(x, r)], [n - b for n, b in zip(y, r)], caches


def summarise(rows: list[dict], lengths: list[int], seed: int) -> dict:
    summary = longctx.json_ready(longctx.summarize(rows, ("fragment_tokens", "strategy"), seed=seed))
    diffs, shares = {}, {}
    for t in lengths:
        where = {"fragment_tokens": t}
        for m in ("span_kl", "em", "kl"):
            diffs[f"2 x {t}: naive - rerotate {m}"] = longctx.paired(
                rows, "naive", "rerotate", m, where=where
            ).as_dict()
            for a in ONLY:
                diffs[f"2 x {t}: {a} - rerotate {m}"] = longctx.paired(rows, a, "rerotate", m, where=where).as_dict()
        for a in ONLY:
            x, y, caches = excess(rows, a, t)
            shares[f"2 x {t}: {a} removes of naive's excess span KL"] = kvlab.gap_closed_ci(
                x, y, clusters=caches, seed=seed
            ).as_dict()
    return {"summary": summary, "paired_differences": diffs, "share_of_naive_excess_removed": shares}


def tables(doc: dict) -> str:
    f = lambda c, p=3: f"{c['mean']:.{p}f} [{c['lo']:.{p}f}, {c['hi']:.{p}f}]"  # noqa: E731
    g = lambda c: f"{c['mean']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]"  # noqa: E731
    out = [
        "| 2 x tokens | strategy | n q / caches | answer-span KL | first-token KL | exact match |",
        "|---|---|---|---|---|---|",
    ]
    for s in doc["summary"]:
        out.append(
            f"| {s['fragment_tokens']} | {s['strategy']} | {s['n']} / {s['n_caches']} | {f(s['span_kl'])} | "
            f"{f(s['kl'])} | {f(s['em'], 2)} |"
        )
    out += ["", "| paired comparison | difference [95% CI] |", "|---|---|"]
    out += [f"| {k} | {g(v)} |" for k, v in doc["paired_differences"].items() if "first" not in k]
    out += ["", "| share of naive's excess answer-span KL over rerotate removed | [95% CI] |", "|---|---|"]
    out += [f"| {k} | {f(v, 2)} |" for k, v in doc["share_of_naive_excess_removed"].items()]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument(
        "--lengths", type=int, nargs="+", default=[200, 250, 270, 512], help="tokens per fragment (two fragments)"
    )
    ap.add_argument("--sets", type=int, default=20, help="independent generated sets (caches) per length")
    ap.add_argument("--people", type=int, default=1)
    ap.add_argument("--max-questions", type=int, default=12)
    ap.add_argument("--greedy-tokens", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results")
    ap.add_argument("--table", action="store_true", help="print the tables of --out's JSON and stop")
    args = ap.parse_args()
    out = Path(args.out)
    path = out / f"gemma_controls_{args.model}.json"
    if args.table:
        print(tables(json.loads(path.read_text())))
        return
    started = time.perf_counter()
    model = kvlab.load_model(args.model)
    rows, timings = [], {}
    for t in args.lengths:
        r, tm = longctx.run(
            model,
            [2],
            t,
            seed=args.seed,
            people_per_passage=args.people,
            max_questions=args.max_questions,
            greedy_tokens=args.greedy_tokens,
            sets=args.sets,
            strategies=STRATEGIES,
            log=lambda m: print(m, flush=True),
        )
        rows += r
        timings[t] = tm[2]
    with atomic_path(out / f"gemma_controls_{args.model}.csv") as tmp, open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    doc = {
        "model": model.name,
        "command": " ".join(["studies/gemma_controls.py"] + sys.argv[1:]),
        "args": vars(args),
        "wall_s_per_length": timings,
        "wall_s_total": time.perf_counter() - started,
        **summarise(rows, args.lengths, args.seed),
    }
    atomic_write_text(path, json.dumps(doc, indent=1, default=float))
    print(tables(doc))
    print(f"done in {doc['wall_s_total']:.0f} s -> {path}")


if __name__ == "__main__":
    main()
