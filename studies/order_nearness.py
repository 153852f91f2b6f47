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
import json
import time
from pathlib import Path

from kvlab.atomic import atomic_write_text
from kvlab.findings.design import load_design, register
from kvlab.findings.order_arm import GREEDY, set_rows
from kvlab.findings.order_table import table
from kvlab.findings.rows import read_rows, run_sets
from kvlab.lab import setup
from kvlab.lab.provenance import study_run
from kvlab.models.sources import load_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "order_nearness"
DESIGN = ROOT / "studies" / "designs" / "order_nearness.toml"
TEXT = ("answer", "truth", "ref_answer")


def run(model_name: str, out: Path) -> list[dict]:
    record = register(DESIGN, ROOT)  # refuses a design not committed as it is
    d = load_design(DESIGN)
    setup(d["seed"])
    model = load_model(model_name)
    started = time.perf_counter()
    path = out / f"rows_{model.name}.csv"
    rows, walls = run_sets(path, range(d["n_caches"]), lambda j: set_rows(model, j, d["fragment_tokens"], d["seed"]))
    meta = {
        "design": record,
        "model": model.name,
        "sets": d["n_caches"],
        "fragment_tokens": d["fragment_tokens"],
        "seed": d["seed"],
        "greedy_tokens": GREEDY,
        "set_wall_s": walls,
        **study_run("studies/order_nearness.py", started),
    }
    atomic_write_text(path.with_suffix(".json"), json.dumps(meta, indent=1) + "\n")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--markdown", action="store_true", help="print the tables from the committed rows; no model")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    d = load_design(DESIGN)
    rows = read_rows(args.out / f"rows_{args.model}.csv", text=TEXT) if args.markdown else run(args.model, args.out)
    print(table(rows, args.model, d))


if __name__ == "__main__":
    main()
