"""The recompute-mask defect: a bottom-right-aligned causal mask against kvlab's causal-by-position one.

    .venv/bin/python studies/recompute_mask.py --model smollm2-135m [--counts 4] [--tokens 256] [--sets 12]
    .venv/bin/python studies/recompute_mask.py --table smollm2-135m gemma3-270m   # the README's table, from the rows

A selective recompute runs only the chosen tokens through the model. If their causal mask is
aligned to the bottom right of the (queries x slots) grid, as a plain causal attention call
aligns it, a chosen token early in the merge attends to slots after it
(:func:`kvlab.cache.repro.bottom_right_mask`). This reads every question of ``--sets``
generated sets behind four merges of the same fragments: rerotate, recompute with kvlab's
mask, recompute with the defect (both at ``--ratio``, policy ``deviation``, the same tokens),
and reprefill; and reports answer-span KL against the joined prefill and exact match, with 95%
cluster-bootstrap intervals over caches, and the paired difference defect - kvlab named before
the run. Writes one row per question and strategy to ``results/recompute_mask_<model>.csv``
(after every set, so a stopped run keeps the sets it finished) and the run record with its
summary to ``results/recompute_mask_<model>.json``; ``--table`` prints both models' tables
from the committed rows.
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
from kvlab.findings import longctx, strata
from kvlab.findings.qa import ask, passage_fragments
from kvlab.findings.rows import run_sets
from kvlab.measure.stats import fmt_ci

RESULTS = Path(__file__).resolve().parents[1] / "results"
#: The metrics of the comparisons named before the run (defect - kvlab, per count).
METRICS = ("span_kl", "kl", "em")


def rows_path(folder: Path, model: str) -> Path:
    """Where a model's per-question rows are committed."""
    return Path(folder) / f"recompute_mask_{model}.csv"


def names(ratio: float) -> tuple[str, str]:
    """The two recompute strategies' labels: kvlab's causal mask, then the defect."""
    return f"recompute r={ratio:g}", f"bottom-right r={ratio:g}"


def summarise(rows: list[dict], ratio: float, seed: int = 0) -> tuple[list[dict], dict]:
    """Per (count, strategy) intervals (:func:`kvlab.findings.longctx.summarize`) and the paired defect - kvlab.

    Returns
    -------
    (list of dict, dict)
        The summary rows (intervals as their file form) and ``{label: paired interval}``, the
        comparisons named before the run: per count, the defect minus kvlab's mask in
        answer-span KL, first-token KL and exact match.
    """
    causal, defect = names(ratio)
    summary = [
        {
            **{k: v for k, v in r.items() if not isinstance(v, kvlab.CI)},
            **{m: v.as_dict() for m, v in r.items() if isinstance(v, kvlab.CI)},
        }
        for r in longctx.summarize(rows, seed=seed)
    ]
    counts = sorted({r["n_fragments"] for r in rows})
    diffs = {
        f"{k} fragments: {defect} - {causal} {m}": longctx.paired(
            rows, defect, causal, m, where={"n_fragments": k}, seed=seed
        ).as_dict()
        for k in counts
        for m in METRICS
    }
    return summary, diffs


def markdown(models: list[str], folder: Path = RESULTS) -> str:
    """The README's table, recomputed from each model's committed rows and its run record's arguments."""
    out = [
        "| model | fragments | strategy | questions / caches | answer-span KL, nats/token | first-token KL, nats | exact match |",
        "|---|---|---|---|---|---|---|",
    ]
    pairs = []
    for model in models:
        args = json.loads((Path(folder) / f"recompute_mask_{model}.json").read_text())["args"]
        summary, diffs = summarise(strata.read_rows(rows_path(folder, model)), args["ratio"], args["seed"])
        for r in summary:
            out.append(
                f"| {model} | {r['n_fragments']} × ≤{args['tokens']} | {r['strategy']} | {r['n']} / "
                f"{r['n_caches']} | {fmt_ci(r['span_kl'], '.4f')} | {fmt_ci(r['kl'], '.4f')} | {fmt_ci(r['em'], '.2f')} |"
            )
        for key, c in diffs.items():
            pairs.append(f"- {model}, {key}: {fmt_ci(c, '+.4f')} (n={c['n']}, {c['caches']} caches, paired)")
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
    causal, defect = names(args.ratio)
    strategies = {
        "rerotate": Rerotate(),
        causal: Recompute(ratio=args.ratio, policy="deviation", seed=args.seed),
        defect: BottomRightRecompute(ratio=args.ratio, policy="deviation", seed=args.seed),
        "reprefill": Reprefill(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def one_set(k: int, j: int) -> list[dict]:
        s = longctx.make_set(
            model, k, args.tokens, seed=args.seed + k + 1000 * j, people_per_passage=1, max_questions=args.max_questions
        )
        frags, probes = passage_fragments(model, s)
        rows = ask(model, s, strategies, greedy_tokens=args.greedy_tokens, fragments=frags, probes=probes)
        return [r | {"n_fragments": k, "set": j} for r in rows]

    units = [(k, j) for k in args.counts for j in range(args.sets)]
    rows, _ = run_sets(rows_path(out, model.name), range(len(units)), lambda i: one_set(*units[i]))
    summary, diffs = summarise(rows, args.ratio, args.seed)
    doc = {
        "model": model.name,
        "command": " ".join(["studies/recompute_mask.py"] + sys.argv[1:]),
        "args": vars(args),
        "wall_s_total": time.perf_counter() - started,
        "rows": rows_path(out, model.name).name,
        "summary": summary,
        "paired_differences": diffs,
    }
    atomic_write_text(out / f"recompute_mask_{model.name}.json", json.dumps(doc, indent=1, default=float))
    for key, c in diffs.items():
        print(f"{key}: {fmt_ci(c, '+.4f')} (n={c['n']}, {c['caches']} caches, paired)")
    print(f"done in {doc['wall_s_total']:.0f} s")


if __name__ == "__main__":
    main()
