"""llama.cpp's K-shift on a quantised K cache: what dequantise, rotate, requantise costs.

    .venv/bin/python studies/quantised_kshift.py [--models smollm2-135m gemma3-270m] [--lengths 512 2048]

llama.cpp issues 5652 and 9743 report that shifting a q4_0 K cache failed; the fix
dequantises the keys, rotates them and quantises them again. For f16, q8_0 and q4_0 K caches
(V f16; Gemma 3 with ``swa_full=True``) and two seeded fragments of each length, this measures
the K-shift's own error (shift-merge against the second fragment decoded at its landing
positions), the shift-merge against llama.cpp's joined prefill, and the K type's own cost
(its joined prefill against the f16 one), all as next-token KL on question probes
(:func:`kvlab.peers.kshift.quantised_shift_table`). Layouts llama.cpp refuses are recorded with its
reason. Writes ``results/quantised_kshift.json`` after every model and length, then prints
the plain-text and markdown tables.
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
from kvlab.peers.kshift import format_quantised, quantised_shift_table

COMPARISONS = (
    ("k_shift", "K-shift: shift vs phase"),
    ("shift_joined", "shift-merge vs joined"),
    ("quantisation", "joined vs f16 joined"),
)


def _fmt(x: float) -> str:
    return f"{x:.4f}" if x == 0 or abs(x) >= 1e-3 else f"{x:.1e}"


def markdown(rows: list[dict]) -> str:
    """One markdown row per model, length and cache layout: KL mean [95% CI] (max) per comparison."""
    head = "| model | cache | tokens | n | " + " | ".join(label for _, label in COMPARISONS) + " |"
    out = [head, "|" + "---|" * (4 + len(COMPARISONS))]
    for r in rows:
        left = f"| {r['model']} | {r['layout']} | 2 × {r['tokens']} | {r['n']} |"
        if r["refused"]:
            out.append(left + " refused: " + r["refused"].replace("|", "/") + " |" * len(COMPARISONS))
            continue
        cells = []
        for key, _ in COMPARISONS:
            c = r[key]
            cells.append(f"{_fmt(c['kl_mean'])} [{_fmt(c['kl_lo'])}, {_fmt(c['kl_hi'])}] ({_fmt(c['kl_max'])})")
        out.append(left + " " + " | ".join(cells) + " |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 2048], help="tokens per fragment (two)")
    ap.add_argument("--probes", type=int, default=8, help="question probes read behind each cache")
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
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
