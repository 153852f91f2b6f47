"""The recompute-mask defect: a bottom-right-aligned causal mask against kvlab's causal-by-position one.

    .venv/bin/python studies/recompute_mask.py --model smollm2-135m [--counts 4] [--tokens 256] [--sets 12]
    .venv/bin/python studies/recompute_mask.py --table results/recompute_mask_*.json   # the README's table

A selective recompute runs only the chosen tokens through the model. If their causal mask is
aligned to the bottom right of the (queries x slots) grid, as a plain causal attention call
aligns it, a chosen token early in the merge attends to slots after it
(:func:`kvlab.cache.repro.bottom_right_mask`). This reads every question of ``--sets``
generated sets behind four merges of the same fragments: rerotate, recompute with kvlab's
mask, recompute with the defect (both at ``--ratio``, policy ``deviation``, the same tokens),
and reprefill; and reports answer-span KL against the joined prefill and exact match, with 95%
cluster-bootstrap intervals over caches, and the paired difference defect - kvlab named before
the run. Writes ``results/recompute_mask_<model>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import kvlab
from kvlab.atomic import atomic_write_text
from kvlab.cache.recompute.strategy import Recompute
from kvlab.cache.repro import BottomRightRecompute
from kvlab.cache.strategies import Reprefill, Rerotate
from kvlab.findings import longctx
from kvlab.findings.qa import ask, passage_fragments
from kvlab.measure.stats import fmt_ci


def markdown(paths: list[str]) -> str:
    """The README's table of each JSON this script wrote: per model and strategy, then the paired defect - kvlab."""

    def f(c, spec):
        return fmt_ci(c, spec)

    out = [
        "| model | fragments | strategy | questions / caches | answer-span KL, nats/token | first-token KL, nats | exact match |",
        "|---|---|---|---|---|---|---|",
    ]
    pairs = []
    for path in paths:
        d = json.loads(Path(path).read_text())
        for r in d["summary"]:
            out.append(
                f"| {d['model']} | {r['n_fragments']} × ≤{d['args']['tokens']} | {r['strategy']} | {r['n']} / "
                f"{r['n_caches']} | {f(r['span_kl'], '.4f')} | {f(r['kl'], '.4f')} | {f(r['em'], '.2f')} |"
            )
        for key, c in d["paired_differences"].items():
            pairs.append(f"- {d['model']}, {key}: {f(c, '+.4f')} (n={c['n']}, {c['caches']} caches, paired)")
    return "\n".join(out + [""] + pairs)


def main() -> None:
    if sys.argv[1:2] == ["--table"]:
        print(markdown(sys.argv[2:]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--counts", type=int, nargs="+", default=[4])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--sets", type=int, default=12)
    ap.add_argument("--max-questions", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--greedy-tokens", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    started = time.perf_counter()
    model = kvlab.load_model(args.model)
    causal, defect = f"recompute r={args.ratio:g}", f"bottom-right r={args.ratio:g}"
    strategies = {
        "rerotate": Rerotate(),
        causal: Recompute(ratio=args.ratio, policy="deviation", seed=args.seed),
        defect: BottomRightRecompute(ratio=args.ratio, policy="deviation", seed=args.seed),
        "reprefill": Reprefill(),
    }
    rows = []
    for k in args.counts:
        for j in range(args.sets):
            s = longctx.make_set(
                model,
                k,
                args.tokens,
                seed=args.seed + k + 1000 * j,
                people_per_passage=1,
                max_questions=args.max_questions,
            )
            frags, probes = passage_fragments(model, s)
            for r in ask(model, s, strategies, greedy_tokens=args.greedy_tokens, fragments=frags, probes=probes):
                r.update(n_fragments=k, set=j)
                rows.append(r)
        print(
            f"{model.name}: {k} fragments, {args.sets} sets done at {time.perf_counter() - started:.0f} s", flush=True
        )
    summary = longctx.summarize(rows, seed=args.seed)
    diffs = {
        f"{k} fragments: {defect} - {causal} {m}": longctx.paired(
            rows, defect, causal, m, where={"n_fragments": k}, seed=args.seed
        ).as_dict()
        for k in args.counts
        for m in ("span_kl", "kl", "em")
    }
    doc = {
        "model": model.name,
        "command": " ".join(["studies/recompute_mask.py"] + sys.argv[1:]),
        "args": vars(args),
        "wall_s_total": time.perf_counter() - started,
        "summary": [
            {
                **{k: v for k, v in r.items() if not hasattr(v, "mean")},
                **{m: v.as_dict() for m, v in r.items() if isinstance(v, kvlab.CI)},
            }
            for r in summary
        ],
        "paired_differences": diffs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"recompute_mask_{model.name}.json", json.dumps(doc, indent=1, default=float))
    print(longctx.table(summary, list(strategies)))
    for key, c in diffs.items():
        print(f"{key}: {fmt_ci(c, '+.4f')} (n={c['n']}, {c['caches']} caches, paired)")
    print(f"done in {doc['wall_s_total']:.0f} s")


if __name__ == "__main__":
    main()
