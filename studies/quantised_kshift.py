"""llama.cpp's K-shift on a quantised K cache: what dequantise, rotate, requantise costs.

    .venv/bin/python studies/quantised_kshift.py [--models smollm2-135m gemma3-270m] [--lengths 512 2048]
    .venv/bin/python studies/quantised_kshift.py --markdown    # the README's tables, from the committed JSON

llama.cpp issues 5652 and 9743 report that shifting a q4_0 K cache failed; the fix
dequantises the keys, rotates them and quantises them again. For f16, q8_0 and q4_0 K caches
(V f16; Gemma 3 with ``swa_full=True``) and two seeded fragments of each length, this measures
the K-shift's own error (shift-merge against the second fragment decoded at its landing
positions), the shift-merge against llama.cpp's joined prefill, and the K type's own cost
(its joined prefill against the f16 one), all as next-token KL on question probes
(:func:`kvlab.peers.kshift.quantised_shift_table`). Layouts llama.cpp refuses are recorded with its
reason. Writes ``results/quantised_kshift.json`` after every model and length (each comparison
with every probe's KL), then prints the plain-text and markdown tables.

Paired comparisons, named after the run (2026-12-01) and before this analysis of its committed
rows (issue 38 found the cells compared unpaired): each quantised K type minus f16, paired over
the same probes of the same cache, in the K-shift's own error and, as a second family, in the
shift-merge against the joined prefill; 8 comparisons per family (2 models x 2 lengths x q8_0,
q4_0), Holm within each. Each cell is one cache, so the intervals are over its probes: how
the probes vary behind that cache, not how another text would fare.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import kvlab
from kvlab.atomic import atomic_write_text
from kvlab.measure.stats import fmt_ci, paired_family
from kvlab.peers.kshift import format_quantised, quantised_shift_table

RESULTS = Path(__file__).resolve().parents[1] / "results"
#: The quantised K types, each compared with f16 on the same probes.
QUANTISED = ("q8_0", "q4_0")

COMPARISONS = (
    ("k_shift", "K-shift: shift vs phase"),
    ("shift_joined", "shift-merge vs joined"),
    ("quantisation", "joined vs f16 joined"),
)


def _fmt(x: float) -> str:
    return f"{x:.4f}" if x == 0 or abs(x) >= 1e-3 else f"{x:.1e}"


def measured(rows: list[dict]) -> list[dict]:
    """The table's rows: every K type with an f16 V cache in the layout that keeps every token."""
    return [r for r in rows if not r["refused"] and r["type_v"] == "f16" and r["swa_full"]]


def markdown(rows: list[dict]) -> str:
    """One markdown row per model, length and K type: KL mean [95% CI over probes], max, per comparison."""
    head = "| model | fragments | K cache | " + " | ".join(label for _, label in COMPARISONS) + " |"
    out = [head, "|" + "---|" * (3 + len(COMPARISONS))]
    for r in measured(rows):
        cells = [
            f"{_fmt(r[k]['kl_mean'])} [{_fmt(r[k]['kl_lo'])}, {_fmt(r[k]['kl_hi'])}], {_fmt(r[k]['kl_max'])}"
            for k, _ in COMPARISONS
        ]
        out.append(f"| {r['model']} | 2 × {r['tokens']} | {r['type_k']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def family(rows: list[dict], key: str, seed: int = 0) -> list[dict]:
    """Each quantised K type minus f16 in comparison ``key``, paired over the same probes; Holm over the family."""
    cells = {(r["model"], r["tokens"], r["type_k"]): r for r in measured(rows)}
    comparisons = []
    for model, tokens, k in cells:
        if k in QUANTISED:
            a, b = cells[model, tokens, k][key]["kls"], cells[model, tokens, "f16"][key]["kls"]
            comparisons.append(({"model": model, "tokens": tokens, "type_k": k}, a, b, None))
    return paired_family(comparisons, seed=seed)


def paired_markdown(rows: list[dict], seed: int = 0) -> str:
    """The two families' table: K type minus f16 per cell, paired over its probes (bold: Holm p at most 0.05)."""
    fams = {key: family(rows, key, seed) for key, _ in COMPARISONS[:2]}
    out = [
        "| model | fragments | K cache − f16 | "
        + " | ".join(f"{label} (Holm p)" for _, label in COMPARISONS[:2])
        + " |",
        "|" + "---|" * (3 + len(fams)),
    ]
    for i, what in enumerate(fams[COMPARISONS[0][0]]):
        cells = []
        for key, _ in COMPARISONS[:2]:
            f = fams[key][i]
            b = "**" if f["p_holm"] <= 0.05 else ""
            cells.append(f"{b}{fmt_ci(f['ci'], '+.4f')}{b} ({f['p_holm']:.3f})")
        out.append(f"| {what['model']} | 2 × {what['tokens']} | {what['type_k']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 2048], help="tokens per fragment (two)")
    ap.add_argument("--probes", type=int, default=8, help="question probes read behind each cache")
    ap.add_argument("--out", default="results")
    ap.add_argument("--markdown", action="store_true", help="print the tables from the committed JSON; no model")
    args = ap.parse_args()
    if args.markdown:
        rows = json.loads((Path(args.out) / "quantised_kshift.json").read_text())["rows"]
        print(markdown(rows) + "\n\n" + paired_markdown(rows))
        return
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"command": " ".join(["studies/quantised_kshift.py"] + sys.argv[1:]), "rows": [], "wall_s": {}}
    for name in args.models:
        torch.manual_seed(0)
        model = kvlab.load_model(name)
        for n_tokens in args.lengths:
            t0 = time.perf_counter()
            cells = quantised_shift_table(model, lengths=(n_tokens,), n_probes=args.probes)
            doc["rows"] += [c.row() for c in cells]
            doc["wall_s"][f"{name} 2x{n_tokens}"] = time.perf_counter() - t0
            doc["wall_s_total"] = time.perf_counter() - started
            atomic_write_text(out / "quantised_kshift.json", json.dumps(doc, indent=1, default=float))
            print(f"\n{name}, 2 x {n_tokens} tokens ({time.perf_counter() - t0:.0f} s)", flush=True)
            print(format_quantised(cells), flush=True)
    print("\n" + markdown(doc["rows"]))
    print(f"\ndone in {doc['wall_s_total']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
