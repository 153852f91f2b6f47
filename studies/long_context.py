"""Full-scale long-context study (issue 14): phase error by position, and KL, exact match and
agreement with reprefill against the number of fragments, for naive, rerotate, recompute and
reprefill, with 95% bootstrap CIs.

    nice -n 10 .venv/bin/python studies/long_context.py --model smollm2-135m --counts 2 4 8 --tokens 512
    nice -n 10 .venv/bin/python studies/long_context.py --model gemma3-270m --counts 2 3 4 --tokens 400

Writes, under --out (default results/): long_context_<model>.csv (one row per question and
strategy), long_context_<model>.json (CIs, paired differences, wall times, the command) and
figures. Each fragment count is written as soon as it is done, so a stopped run keeps what
it finished. On a terminal a progress bar counts the fragment counts done.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

import kvlab  # noqa: E402
from kvlab.atomic import atomic_write_text  # noqa: E402
from kvlab.findings import longctx, strata  # noqa: E402
from kvlab.findings.rows import write_rows  # noqa: E402

CI_KEYS = ("kl", "span_kl", "nll", "em", "agree", "ref_em", "agree_right")


def write(out: Path, model, args, rows, timings, profile, started, keep: dict | None = None):
    """Write the CSV, the JSON summary and the figures; ``keep``: JSON fields carried over unchanged."""
    name = model.name
    write_rows(out / f"long_context_{name}.csv", rows)
    summary = longctx.json_ready(longctx.summarize(rows))
    by_offset = longctx.json_ready(longctx.summarize(rows, ("n_fragments", "strategy", "answer_passage")))
    by_kind = longctx.json_ready(longctx.summarize(rows, ("n_fragments", "strategy", "kind")))
    # The primary comparison, named before the run: naive against rerotate, paired within
    # caches, per count, pooled (family "pooled": every count x metric) and per question kind
    # (family "by kind": every count x kind x metric), each with its Holm-adjusted p.
    diffs, gap, named = {}, {}, {}
    kinds = sorted({r["kind"] for r in rows})
    for k in sorted(t for t in timings if isinstance(t, int)):
        for m in ("kl", "span_kl", "nll", "agree", "em"):
            named[f"{k} fragments: naive - rerotate {m}"] = ("pooled", {"n_fragments": k}, m)
            for kind in kinds if m in ("span_kl", "em") else ():
                named[f"{k} fragments, {kind}: naive - rerotate {m}"] = ("by kind", {"n_fragments": k, "kind": kind}, m)
    for family in ("pooled", "by kind"):
        names = [n for n, (f, _, _) in named.items() if f == family]
        found = [longctx.named_paired(rows, "naive", "rerotate", named[n][2], where=named[n][1]) for n in names]
        for n, (c, p), adj in zip(names, found, kvlab.holm([p for _, p in found])):
            diffs[n] = {**c.as_dict(), "p": p, "p_holm": adj, "family": f"naive - rerotate, {family}"}
    for k in sorted(t for t in timings if isinstance(t, int)):
        recompute = next(s for s in dict.fromkeys(r["strategy"] for r in rows) if s.startswith("recompute"))
        gap[f"{k} fragments: {recompute} closes of rerotate's span KL"] = longctx.gap_closed(
            rows, recompute, "rerotate", "span_kl", where={"n_fragments": k}
        ).as_dict()
    per_set = [
        {
            **{k: v for k, v in r.items() if k not in CI_KEYS},
            **{m: None if r.get(m) is None else r[m].mean for m in CI_KEYS},
        }
        for r in longctx.summarize(rows, ("n_fragments", "set", "strategy"))
    ]
    doc = {
        "model": name,
        "command": " ".join(["studies/long_context.py"] + sys.argv[1:]),
        "args": vars(args),
        "wall_s_per_count": timings,
        "wall_s_total": time.perf_counter() - started,
        "summary": summary,
        "paired_differences": diffs,
        "gap_closed": gap,
        "by_kind": by_kind,
        "by_offset": by_offset,
        "strata": [{**{k: v for k, v in r.items() if k != "ci"}, **r["ci"].as_dict()} for r in strata.compare(rows)],
        "per_set": per_set,
    }
    if profile is not None:
        doc["phase"] = [
            {
                "layer_type": p.layer_type,
                "positions": [int(p.positions[0]), int(p.positions[-1])],
                "naive_mean_rad": float(np.nanmean(p.naive)),
                "rerotate_max_rad": float(np.nanmax(p.rerotate)),
            }
            for p in profile
        ]
    doc.update(keep or {})
    atomic_write_text(out / f"long_context_{name}.json", json.dumps(doc, indent=1, default=float))
    figures(out, name, rows, profile, args)


def resummarize(out: Path, name: str) -> None:
    """Summarise ``long_context_<name>.csv`` again (new measures, new tables) without re-reading a question.

    The run's command, arguments, wall times and phase profile are carried over from its JSON.
    """
    old = json.loads((out / f"long_context_{name}.json").read_text())
    rows = strata.read_rows(out / f"long_context_{name}.csv")
    timings = {int(k) if k.isdigit() else k: v for k, v in old["wall_s_per_count"].items()}
    keep = {k: old[k] for k in ("command", "args", "wall_s_total", "phase") if k in old}
    write(out, argparse.Namespace(name=name), argparse.Namespace(**old["args"]), rows, timings, None, 0.0, keep)


def figures(out, name, rows, profile, args):
    import matplotlib.pyplot as plt

    if not rows:
        return phase_figure(out, name, profile, args, plt)
    summ = longctx.summarize(rows)
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
    for j, m in enumerate(("span_kl", "kl", "em")):
        for i, s in enumerate(strategies):
            pts = sorted((r["n_fragments"], r[m]) for r in summ if r["strategy"] == s)
            x = [p[0] + (i - 1.5) * 0.06 for p in pts]
            y = [p[1].mean for p in pts]
            err = [[p[1].mean - p[1].lo for p in pts], [p[1].hi - p[1].mean for p in pts]]
            axes[j].errorbar(x, y, yerr=err, fmt="o-", capsize=3, label=s)
        axes[j].set(xlabel=f"fragments of {args.tokens} tokens", xticks=sorted({r["n_fragments"] for r in rows}))
    axes[0].set(
        ylabel="answer-span KL vs joined prefill (nats/token)", title=f"{name}: answer-span KL, 95% CI over caches"
    )
    axes[1].set(ylabel="first-token KL vs joined prefill (nats)", title=f"{name}: first-token KL, 95% CI over caches")
    axes[2].set(ylabel="exact match with the truth (fraction)", title=f"{name}: exact match", ylim=(-0.05, 1.05))
    axes[0].legend()
    fig.savefig(out / f"long_context_{name}.png", dpi=90)
    plt.close(fig)
    if profile is not None:
        phase_figure(out, name, profile, args, plt)


def phase_figure(out, name, profile, args, plt):
    if profile is not None:
        fig, ax = plt.subplots(figsize=(10, 3.8), constrained_layout=True)
        for p in profile:
            ax.plot(p.positions, p.naive, lw=0.8, label=f"naive, {p.layer_type}")
            ax.plot(p.positions, p.rerotate, lw=0.8, label=f"rerotate, {p.layer_type}")
        ax.set(
            xlabel="position in the merged cache (tokens)",
            ylabel="mean phase error (rad)",
            title=f"{name}: phase error vs position, {args.counts[-1]} fragments of {args.tokens} tokens",
        )
        ax.legend(fontsize=8)
        fig.savefig(out / f"phase_by_position_{name}.png", dpi=90)
        plt.close(fig)


def phase_only(out: Path, model, args, started):
    """Phase error by position of the largest count's merge; no questions are read."""
    s = longctx.make_set(
        model, args.counts[-1], args.tokens, seed=args.seed + args.counts[-1], people_per_passage=args.people
    )
    frags, _ = kvlab.findings.qa.passage_fragments(model, s)
    profile = longctx.phase_profile(model, frags)
    lands = kvlab.landing_positions(frags)
    doc = {
        "model": model.name,
        "command": " ".join(["studies/long_context.py"] + sys.argv[1:]),
        "fragment_lengths": [f.length for f in frags],
        "landing": lands,
        "wall_s_total": time.perf_counter() - started,
        "phase": [
            {
                "layer_type": p.layer_type,
                "positions": [int(p.positions[0]), int(p.positions[-1])],
                "naive_mean_rad": float(np.nanmean(p.naive)),
                "rerotate_max_rad": float(np.nanmax(p.rerotate)),
                "naive_by_fragment_rad": {
                    str(a): float(np.nanmean(p.naive[(p.positions >= a) & (p.positions < a + f.length)]))
                    for a, f in zip(lands, frags)
                    if ((p.positions >= a) & (p.positions < a + f.length)).any()
                },
            }
            for p in profile
        ],
    }
    atomic_write_text(out / f"phase_{model.name}.json", json.dumps(doc, indent=1))
    figures(out, model.name, [], profile, args)
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--counts", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--max-questions", type=int, default=None, help="keep the first N questions of each set")
    ap.add_argument(
        "--questions-per-count",
        type=int,
        default=48,
        help="read enough seeded sets per fragment count for at least this many questions",
    )
    ap.add_argument(
        "--sets",
        type=int,
        default=None,
        help="independent seeded sets (merged caches) per fragment count; overrides --questions-per-count",
    )
    ap.add_argument("--people", type=int, default=2)
    ap.add_argument("--greedy-tokens", type=int, default=5)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-phase", action="store_true", help="skip the phase profile of the largest count")
    ap.add_argument(
        "--phase-only",
        action="store_true",
        help="only the phase profile of the largest count (no questions), to phase_<model>.json",
    )
    ap.add_argument("--out", default="results")
    ap.add_argument(
        "--resummarize",
        action="store_true",
        help="summarise the CSV under --out again (tables, intervals, figures) without reading any question",
    )
    args = ap.parse_args()
    out = Path(args.out)
    if args.resummarize:
        resummarize(out, args.model)
        return
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = kvlab.load_model(args.model)
    # Each count reads every strategy over its questions (minutes): a bar on a terminal, none
    # when stderr is a file or pipe (a background run's log), as kvlab's own bars do.
    bar = tqdm(
        total=len(args.counts),
        desc=f"{model.name} fragment counts",
        unit="count",
        disable=args.phase_only or not sys.stderr.isatty(),
    )
    rows, timings, profile = [], {}, None
    if args.phase_only:
        phase_only(out, model, args, started)
        return
    for k in args.counts:
        per_set = min(3 * args.people * k, args.max_questions or 10**9)
        sets = args.sets or max(1, -(-args.questions_per_count // per_set))
        r, t = longctx.run(
            model,
            [k],
            args.tokens,
            seed=args.seed,
            people_per_passage=args.people,
            sets=sets,
            max_questions=args.max_questions,
            greedy_tokens=args.greedy_tokens,
            ratio=args.ratio,
            log=lambda m: (tqdm.write(m), sys.stdout.flush()),
        )  # above the bar, not through it
        rows += r
        timings.update(t)
        bar.update(1)
        write(out, model, args, rows, timings, profile, started)
    bar.close()
    if not args.no_phase:
        t0 = time.perf_counter()
        s = longctx.make_set(
            model, args.counts[-1], args.tokens, seed=args.seed + args.counts[-1], people_per_passage=args.people
        )
        frags, _ = kvlab.findings.qa.passage_fragments(model, s)
        profile = longctx.phase_profile(model, frags)
        timings["phase_profile"] = time.perf_counter() - t0
        write(out, model, args, rows, timings, profile, started)
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
