"""Order or nearness? The same passage first or last, with or without a filler before the question.

The naive-dose study found SmolLM2's naive − rerotate gap changing sign with a passage's place in
the merge, but there a passage's place is also its distance to the question. This arm
(``kvlab.findings.order_arm``) holds the passage P at one absolute offset in four layouts that
move its rank among the passages and its distance to the question apart, on naive-dose's own
generated sets (two passages of ``fragment_tokens`` tokens; the questions are the one-passage
questions about P).

The design (layouts, family, primary outcome, sets) is ``studies/designs/order_nearness.toml``,
committed before the run (:func:`kvlab.findings.design.register` refuses it otherwise). Rows:
``results/order_nearness/rows_<model>.csv``; the ``.json`` beside them records the design's commit.

    .venv/bin/python studies/order_nearness.py --model smollm2-135m
    .venv/bin/python studies/order_nearness.py --model smollm2-135m --markdown   # tables from the committed rows
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.findings.design import load_design
from kvlab.findings.order_arm import GREEDY, set_rows
from kvlab.findings.order_table import conclusions, table
from kvlab.findings.rows import read_rows
from kvlab.lab.study import run_design_study

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "order_nearness"
DESIGN = ROOT / "studies" / "designs" / "order_nearness.toml"
TEXT = ("answer", "truth", "ref_answer")


def run(model_name: str, out: Path) -> list[dict]:
    d = load_design(DESIGN)
    return run_design_study(
        "studies/order_nearness.py",
        DESIGN,
        ROOT,
        out,
        model_name,
        lambda model, d, j: set_rows(model, j, d["fragment_tokens"], d["seed"]),
        fragment_tokens=d["fragment_tokens"],
        seed=d["seed"],
        greedy_tokens=GREEDY,
    )


def section(out: Path = RESULTS) -> str:
    """results/README.md's section body: each model's table and conclusions, from the committed rows."""
    d = load_design(DESIGN)
    parts = []
    for m in d["models"]:
        rows = read_rows(out / f"rows_{m}.csv", text=TEXT)
        parts += [table(rows, m, d), "\n".join(f"* {c}" for c in conclusions(rows, m, d))]
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--markdown", action="store_true", help="print the tables from the committed rows; no model")
    ap.add_argument("--section", action="store_true", help="print results/README.md's tables, both models")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.section:
        print(section(args.out))
        return
    d = load_design(DESIGN)
    rows = read_rows(args.out / f"rows_{args.model}.csv", text=TEXT) if args.markdown else run(args.model, args.out)
    print(table(rows, args.model, d))
    print("\n".join(["", *conclusions(rows, args.model, d)]))


if __name__ == "__main__":
    main()
