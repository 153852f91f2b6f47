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
    out = [f"### {d['model']}: fragments of ≤{a['tokens']} tokens, {a['max_questions']} questions per count, "
           f"greedy {a['greedy_tokens']} tokens, recompute r={a['ratio']}",
           "", f"Command: `{d['command']}`; wall time {d['wall_s_total'] / 60:.1f} min "
           f"({', '.join(f'{k}: {v:.0f} s' for k, v in d['wall_s_per_count'].items())}).", "",
           "| fragments | strategy | n | mean KL, nats [95% CI] | exact match [CI] | agreement with reprefill [CI] |",
           "|---|---|---|---|---|---|"]
    for r in sorted(d["summary"], key=lambda r: r["n_fragments"]):
        out.append(f"| {r['n_fragments']} | {r['strategy']} | {r['n']} | {fmt(r['kl'], '.3f')} | "
                   f"{fmt(r['em'], '.2f')} | {fmt(r['agree'], '.2f')} |")
    out += ["", "Paired differences (same questions, resampled jointly):", ""]
    for k, c in d["paired_differences"].items():
        out.append(f"- {k}: {c['mean']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] (n={c['n']})")
    if "phase" in d:
        out += ["", "Phase error of the largest merge (mean over kept positions, heads, pairs):", ""]
        for p in d["phase"]:
            out.append(f"- {p['layer_type']}: keeps positions {p['positions'][0]}..{p['positions'][1]}; naive "
                       f"{p['naive_mean_rad']:.3f} rad, rerotate max {p['rerotate_max_rad']:.1e} rad")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print("\n".join(table(p) for p in sys.argv[1:]))
