"""Markdown tables of the long-context study's JSON files (results/long_context_*.json).

.venv/bin/python studies/long_context_table.py results/long_context_*.json

Every interval is the 95% cluster-bootstrap interval over caches (generated sets) that the
study wrote; each row states its n questions and n caches.
"""

from __future__ import annotations

import json
import sys

from kvlab.measure.stats import fmt_ci


def fmt(c, spec):
    return fmt_ci(c, spec)


def nc(r):
    return f"{r['n']} / {r['n_caches']}"


def table(path: str) -> str:
    d = json.load(open(path))
    a = d["args"]
    caches = sorted({r["n_caches"] for r in d["summary"]})
    out = [
        f"### {d['model']}: fragments of ≤{a['tokens']} tokens, {'/'.join(map(str, caches))} caches per count, "
        f"{a.get('people', 2)} person per passage, greedy {a['greedy_tokens']} tokens, recompute r={a['ratio']}",
        "",
        f"Command: `{d['command']}`; wall time {d['wall_s_total'] / 60:.1f} min "
        f"({', '.join(f'{k}: {v:.0f} s' for k, v in d['wall_s_per_count'].items())}).",
        "",
        "| fragments | strategy | questions / caches | answer-span KL, nats/token | first-token KL, nats | "
        "exact match | agreement where reprefill is right (n) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(d["summary"], key=lambda r: r["n_fragments"]):
        out.append(
            f"| {r['n_fragments']} | {r['strategy']} | {nc(r)} | {fmt(r['span_kl'], '.3f')} | {fmt(r['kl'], '.3f')} | "
            f"{fmt(r['em'], '.2f')} | {fmt(r['agree_right'], '.2f')} ({r['n_ref_right']}) |"
        )
    shares = {r["n_fragments"]: r["ref_top_share"] for r in d["summary"] if r["strategy"] == "reprefill"}
    out += [
        "",
        "Reprefill's exact match is the full-context ceiling. Share of reprefill's answers that are its one most "
        "common answer: " + ", ".join(f"{k} fragments {v:.2f}" for k, v in sorted(shares.items())) + ".",
        "",
        "By question kind (naive and rerotate):",
        "",
        "| fragments | kind | strategy | questions / caches | answer-span KL | first-token KL | exact match | ceiling |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ceil = {(r["n_fragments"], r["kind"]): r["em"] for r in d["by_kind"] if r["strategy"] == "reprefill"}
    for r in sorted(d["by_kind"], key=lambda r: (r["n_fragments"], r["kind"], r["strategy"])):
        if r["strategy"] in ("naive", "rerotate"):
            out.append(
                f"| {r['n_fragments']} | {r['kind']} | {r['strategy']} | {nc(r)} | {fmt(r['span_kl'], '.3f')} | "
                f"{fmt(r['kl'], '.4f')} | {fmt(r['em'], '.2f')} | {fmt(ceil[r['n_fragments'], r['kind']], '.2f')} |"
            )
    out += [
        "",
        "Paired differences, named before the run (same questions, resampled by cache; p: two-sided bootstrap, "
        "Holm-adjusted within its family, named beside it):",
        "",
    ]
    for k, c in d["paired_differences"].items():
        holm = f", Holm p = {c['p_holm']:.3f} in {c['family']}" if "p_holm" in c else ""
        out.append(f"- {k}: {fmt_ci(c, '+.3f')} (n={c['n']}, {c['caches']} caches{holm})")
    out += ["", "Share of rerotate's answer-span KL that recompute closes (1 - ratio of means, paired):", ""]
    for k, c in d.get("gap_closed", {}).items():
        out.append(f"- {k}: {fmt_ci(c, '.0%')} (n={c['n']}, {c['caches']} caches)")
    if d.get("by_offset"):
        k = max(r["n_fragments"] for r in d["by_offset"])
        out += [
            "",
            f"By the passage holding the answer ({k} fragments; passage i lands after about i × {a['tokens']} tokens):",
            "",
            "| passage | strategy | questions / caches | answer-span KL [CI] | exact match [CI] |",
            "|---|---|---|---|---|",
        ]
        for r in sorted(
            (r for r in d["by_offset"] if r["n_fragments"] == k), key=lambda r: (r["answer_passage"], r["strategy"])
        ):
            if r["strategy"] in ("naive", "rerotate"):
                out.append(
                    f"| {r['answer_passage']} | {r['strategy']} | {nc(r)} | {fmt(r['span_kl'], '.3f')} | "
                    f"{fmt(r['em'], '.2f')} |"
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
