"""Markdown tables of the long-context study's JSON files (results/long_context_*.json).

.venv/bin/python studies/long_context_table.py results/long_context_*.json
"""

from __future__ import annotations

import json
import sys


def fmt(c, spec):
    return f"{c['mean']:{spec}} [{c['lo']:{spec}}, {c['hi']:{spec}}]"


def table(path: str) -> str:
    d = json.load(open(path))
    a = d["args"]
    ns = sorted({r["n"] for r in d["summary"]})
    out = [
        f"### {d['model']}: fragments of ≤{a['tokens']} tokens, n = {'/'.join(map(str, ns))} questions per count, "
        f"greedy {a['greedy_tokens']} tokens, recompute r={a['ratio']}",
        "",
        f"Command: `{d['command']}`; wall time {d['wall_s_total'] / 60:.1f} min "
        f"({', '.join(f'{k}: {v:.0f} s' for k, v in d['wall_s_per_count'].items())}).",
        "",
        "| fragments | strategy | n | mean KL, nats [95% CI] | exact match [CI] | agreement with reprefill [CI] |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(d["summary"], key=lambda r: r["n_fragments"]):
        out.append(
            f"| {r['n_fragments']} | {r['strategy']} | {r['n']} | {fmt(r['kl'], '.3f')} | "
            f"{fmt(r['em'], '.2f')} | {fmt(r['agree'], '.2f')} |"
        )
    out += ["", "Paired differences (same questions, resampled jointly):", ""]
    for k, c in d["paired_differences"].items():
        out.append(f"- {k}: {c['mean']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] (n={c['n']})")
    if d.get("per_set"):
        out += ["", "Range over the seeded sets of each count (mean of each set):", ""]
        for k in sorted({r["n_fragments"] for r in d["per_set"]}):
            for strat in ("naive", "rerotate"):
                sel = [r for r in d["per_set"] if r["n_fragments"] == k and r["strategy"] == strat]
                if len(sel) > 1:
                    kl = [r["kl"] for r in sel]
                    ag = [r["agree"] for r in sel]
                    out.append(
                        f"- {k} fragments, {strat}, {len(sel)} sets: KL {min(kl):.3f}-{max(kl):.3f}, "
                        f"agreement {min(ag):.2f}-{max(ag):.2f}"
                    )
    if d.get("by_offset"):
        k = max(r["n_fragments"] for r in d["by_offset"])
        out += [
            "",
            f"By the landing offset of the passage holding the answer ({k} fragments):",
            "",
            "| answer offset (tokens) | strategy | n | mean KL [CI] | agreement with reprefill [CI] |",
            "|---|---|---|---|---|",
        ]
        for r in sorted(
            (r for r in d["by_offset"] if r["n_fragments"] == k), key=lambda r: (r["answer_offset"], r["strategy"])
        ):
            if r["strategy"] in ("naive", "rerotate"):
                out.append(
                    f"| {r['answer_offset']} | {r['strategy']} | {r['n']} | {fmt(r['kl'], '.3f')} | {fmt(r['agree'], '.2f')} |"
                )
    if "phase" in d:
        out += ["", "Phase error of the largest merge (mean over kept positions, heads, pairs):", ""]
        for p in d["phase"]:
            out.append(
                f"- {p['layer_type']}: keeps positions {p['positions'][0]}..{p['positions'][1]}; naive "
                f"{p['naive_mean_rad']:.3f} rad, rerotate max {p['rerotate_max_rad']:.1e} rad"
            )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print("\n".join(table(p) for p in sys.argv[1:]))
