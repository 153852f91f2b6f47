"""Needles with room to fail: do the merge strategies hold when the question paraphrases and distractors compete?

The haystack study (``studies/haystack.py``) left no room to fail: its joined prefill answered 0.99.
Here each haystack (a stretch of Paul Graham's essays, ``kvlab.findings.haystack``) holds one
needle and 2 to 4 distractors of the needle's own template with other towns and values, in other
fragments; the question paraphrases the needle (``kvlab.findings.distractors``); the needle's
fragment and its depth within that fragment are drawn independently (one cache per fragment
index per haystack).

Two steps, in this order, each committed before the next:

1. **The pilot** (``--pilot N``): the joined prefill alone, at round N's fragment counts and
   lengths (:data:`PILOT`), on haystacks :data:`PILOT_HAYSTACKS` (text the run does not read). It
   picks the design whose reference answers between 0.6 and 0.9 on both models. Rows:
   ``results/needle/pilot<N>_<model>.csv``, labelled ``"pilot": true`` in the ``.json`` beside them.
2. **The run**: the design in ``studies/designs/needle.toml`` (committed before the run:
   :func:`kvlab.findings.design.register` refuses it otherwise) names the count, the length, the
   haystacks, the arms, the family and the primary outcome. Rows: ``results/needle/rows_<model>.csv``;
   the ``.json`` records the design's commit.

    .venv/bin/python studies/needle.py --pilot 1 --model smollm2-135m
    .venv/bin/python studies/needle.py --model smollm2-135m
    .venv/bin/python studies/needle.py --model smollm2-135m --markdown   # tables from the committed rows
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvlab.atomic import atomic_write_text
from kvlab.findings import haystack
from kvlab.findings.design import load_design
from kvlab.findings.needle_rows import GREEDY, TEXT, merges, needle_rows, pilot_rows, side_rows
from kvlab.findings.needle_table import conclusions, markdown, pilot_table, sides_markdown
from kvlab.findings.rows import read_rows, run_sets
from kvlab.lab import setup
from kvlab.lab.provenance import study_run
from kvlab.lab.study import run_design_study
from kvlab.models.sources import load_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "needle"
DESIGN = ROOT / "studies" / "designs" / "needle.toml"
SIDES = ROOT / "studies" / "designs" / "needle_sides.toml"
#: The pilot's rounds of designs, ``(fragments, tokens per fragment)``, and its haystacks (none the
#: run reads). Each round follows from the one before (results/README.md, "Needles with room to
#: fail"): round 1 was below the band, so round 2 has fewer fragments (64 tokens cannot hold a needle
#: and four distractors); 3 x 128 cannot hold every haystack either, so round 3 reads 2 x 256 again
#: and 2 x 512 on six more haystacks.
PILOT = {1: ((4, 128), (4, 256), (4, 512)), 2: ((2, 128), (2, 256), (3, 128)), 3: ((2, 256), (2, 512))}
PILOT_HAYSTACKS = {1: range(30, 35), 2: range(30, 35), 3: range(35, 41)}


def pilot(model_name: str, rnd: int, seed: int, out: Path) -> list[dict]:
    setup(seed)
    model = load_model(model_name)
    started = time.perf_counter()
    path = out / f"pilot{rnd}_{model.name}.csv"
    designs, hays = PILOT[rnd], PILOT_HAYSTACKS[rnd]

    def one(j: int) -> list[dict]:
        h, (k, tokens) = hays[j % len(hays)], designs[j // len(hays)]
        return pilot_rows(model, h, k, tokens, seed)

    rows, walls = run_sets(path, range(len(designs) * len(hays)), one)
    record = {
        "pilot": True,
        "round": rnd,
        "model": model.name,
        "designs": [list(d) for d in designs],
        "haystacks": list(hays),
        "seed": seed,
        "essays": f"{haystack.PACKAGE}=={haystack.VERSION}",
        "greedy_tokens": GREEDY,
        "set_wall_s": walls,
        **study_run("studies/needle.py", started),
    }
    atomic_write_text(path.with_suffix(".json"), json.dumps(record, indent=1) + "\n")
    return rows


def run(model_name: str, out: Path) -> list[dict]:
    d = load_design(DESIGN)
    reads = merges(d["ratio"], d["seed"])
    return run_design_study(
        "studies/needle.py",
        DESIGN,
        ROOT,
        out,
        model_name,
        lambda model, d, h: needle_rows(model, h, d["n_fragments"], d["fragment_tokens"], d["seed"], reads),
        **{k: d[k] for k in ("n_fragments", "fragment_tokens", "ratio", "seed")},
        essays=f"{haystack.PACKAGE}=={haystack.VERSION}",
        greedy_tokens=GREEDY,
    )


def sides(model_name: str, out: Path) -> list[dict]:
    sd = load_design(SIDES)
    return run_design_study(
        "studies/needle.py",
        SIDES,
        ROOT,
        out,
        model_name,
        lambda model, d, h: side_rows(model, h, d["fragment_tokens"], d["seed"]),
        **{k: sd[k] for k in ("n_fragments", "fragment_tokens", "seed")},
        essays=f"{haystack.PACKAGE}=={haystack.VERSION}",
        greedy_tokens=GREEDY,
    )


def section(out: Path = RESULTS) -> str:
    """results/README.md's section body: every pilot round's tables, then the run's tables and conclusions."""
    d = load_design(DESIGN)
    parts = []
    for rnd in sorted(PILOT):
        for m in d["models"]:
            parts.append(pilot_table(read_rows(out / f"pilot{rnd}_{m}.csv", text=TEXT), m, rnd=rnd))
    for m in d["models"]:
        path = out / f"rows_{m}.csv"
        if path.exists():
            rows = read_rows(path, text=TEXT)
            parts += [markdown(rows, m, d), "\n".join(f"* {c}" for c in conclusions(rows, m, d))]
    sd = load_design(SIDES)
    for m in sd["models"]:
        path = out / "sides" / f"rows_{m}.csv"
        if path.exists():
            parts.append(sides_markdown(read_rows(path, text=TEXT), m, sd))
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pilot", type=int, choices=sorted(PILOT), help="a pilot round: the joined prefill at its designs")
    ap.add_argument("--seed", type=int, default=0, help="the pilot's seed (the run reads its design's)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--markdown", action="store_true", help="print the tables from the committed rows; no model")
    ap.add_argument("--sides", action="store_true", help="the distractors-before-or-after run (needle_sides.toml)")
    ap.add_argument("--section", action="store_true", help="print results/README.md's tables, every round and model")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.section:
        print(section(args.out))
        return
    if args.pilot:
        rows = pilot(args.model, args.pilot, args.seed, args.out) if not args.markdown else None
        rows = rows or read_rows(args.out / f"pilot{args.pilot}_{args.model}.csv", text=TEXT)
        print(pilot_table(rows, args.model, rnd=args.pilot))
        return
    if args.sides:
        out = args.out / "sides"
        out.mkdir(exist_ok=True)
        rows = read_rows(out / f"rows_{args.model}.csv", text=TEXT) if args.markdown else sides(args.model, out)
        print(sides_markdown(rows, args.model, load_design(SIDES)))
        return
    d = load_design(DESIGN)
    rows = read_rows(args.out / f"rows_{args.model}.csv", text=TEXT) if args.markdown else run(args.model, args.out)
    print(markdown(rows, args.model, d))
    print("\n".join(["", *conclusions(rows, args.model, d)]))


if __name__ == "__main__":
    main()
