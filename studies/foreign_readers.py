"""Notebook 03 at full scale: every same-shape reader of a model on many producers' caches.

Notebook 03 runs a quick version (a few caches) and prints this run's numbers, recomputed from
its committed rows. The design is notebook 03's (``kvlab.findings.readers``): each cache is one
generated set (two passages of one person each, one seed per cache) saved by the producer; every
reader (bf16, fp16, an int8 round trip, a 6-step fine-tune) reads every question behind its own
prefill and behind the producer's file forced through. Named before the run: the fine-tune's
answer-span KL minus int8's, paired within caches; intervals are the cluster bootstrap over caches.

    .venv/bin/python studies/foreign_readers.py --model smollm2-135m --caches 20
    .venv/bin/python studies/foreign_readers.py --model gemma3-270m --caches 20
    .venv/bin/python studies/foreign_readers.py --markdown   # results/README.md's tables, from the rows

Writes results/foreign_readers_<model>.csv (one row per reader, cache and question, with the
cache id) and results/foreign_readers_<model>.json (parameters, command, CPU, wall time, which
readers gave no finite KL). ``--markdown`` runs no model.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import kvlab
from kvlab.atomic import atomic_write_text
from kvlab.findings import readers as study
from kvlab.findings.rows import write_rows
from kvlab.lab import setup
from kvlab.lab.provenance import study_run

RESULTS = Path(__file__).resolve().parents[1] / "results"
MODELS = ("smollm2-135m", "gemma3-270m")
KINDS = ("bf16", "fp16", "int8", "finetune")
PRIMARY = ("finetune", "int8")


def run(args: argparse.Namespace) -> None:
    setup(args.seed)
    started = time.perf_counter()
    model = kvlab.load_model(args.model)
    readers = {
        k: kvlab.variants(model, k, **({"steps": args.finetune_steps} if k == "finetune" else {})) for k in KINDS
    }
    with tempfile.TemporaryDirectory(prefix="kvlab-readers-") as tmp:
        caches, exact = study.producer_caches(
            model, Path(tmp), args.caches, n_passages=2, passage_tokens=120, people_per_passage=1, seed=args.seed
        )
        if not exact:
            raise SystemExit("a producer did not reload its own cache bit-exact")
        rows = study.forced_reads(readers, caches)
        unreadable = study.unreadable(readers, rows, caches[0])
    dicts = study.row_dicts(rows)
    write_rows(study.committed_path(args.out, model.name), dicts)
    meta = {
        "model": model.name,
        "caches": args.caches,
        "tokens": [min(c.tokens for c in caches), max(c.tokens for c in caches)],
        "readers": list(KINDS),
        "primary": list(PRIMARY),
        "finetune_steps": args.finetune_steps,
        "seed": args.seed,
        "unreadable": unreadable,
        **study_run("studies/foreign_readers.py", started),
    }
    atomic_write_text(study.committed_path(args.out, model.name, "json"), json.dumps(meta, indent=1) + "\n")
    print("\n".join(study.at_scale(dicts, meta, "this run")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=MODELS)
    ap.add_argument("--caches", type=int, default=20)
    ap.add_argument("--finetune-steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--markdown", action="store_true", help="print results/README.md's tables from the committed rows")
    args = ap.parse_args()
    if args.markdown:
        print(study.committed_markdown(args.out, MODELS), end="")
    elif args.model:
        run(args)
    else:
        ap.error("--model or --markdown")


if __name__ == "__main__":
    main()
