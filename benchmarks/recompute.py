"""Time recompute (ratio 0.15, each policy) against reprefill on SmolLM2; print ratios of one run.

    .venv/bin/python -m benchmarks.recompute [--tokens 1024] [--ratio 0.15] [--repeats 3] [--threads N]

Two fragments of ``--tokens`` seeded random token ids each, as in benchmarks/merge.py.
Like that script it runs twice, in child processes, with glibc's malloc defaults and with
glibc told to keep freed memory (see its docstring for why); recompute is mostly matrix
products, so the setting mainly moves the memory-bound rerotate. Each row also gives the
process CPU time: on a shared machine other processes stretch wall times (a run whose
CPU and wall ratios disagree was disturbed). ``reprefill`` is kvlab's strategy: one
forward of the joined tokens, with the LM head applied to the last token only.

What recompute costs: re-rotation, then every decoder layer on ``ratio * N`` tokens with
attention over the merged cache; ``deviation`` adds a prefill of all ``N`` tokens through
layers 0..1 (2 of SmolLM2's 30) to score them. Target (issue 5): recompute at ratio 0.15
takes at most 0.3x the time of reprefill at 2x1024 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import kvlab
from benchmarks.timing import run_each_malloc
from kvlab.cache.fragments import prefill_tokens
from kvlab.cache.recompute.strategy import POLICIES
from kvlab.cache.strategies import STRATEGIES

TARGET = 0.3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=["default", "tuned"], help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per fragment (two fragments)")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reprefill-repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    ap.add_argument("--modes", nargs="+", default=["default", "tuned"], choices=["default", "tuned"])
    args = ap.parse_args()
    if args.child is None:
        run_each_malloc(__spec__.name, sys.argv[1:], modes=args.modes)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = kvlab.load_model(args.model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    frags = [prefill_tokens(model, torch.randint(100, vocab, (args.tokens,), generator=g)) for _ in range(2)]
    n = sum(f.length for f in frags)
    k = STRATEGIES["recompute"](ratio=args.ratio).budget(n)
    print(
        f"model {model.name}, fp32, torch threads {torch.get_num_threads()}; 2x{args.tokens} tokens, ratio {args.ratio} "
        f"({k} of {n} tokens); median of {args.repeats} (reprefill: {args.reprefill_repeats}), after one warm-up"
    )
    runs = [
        ("reprefill", lambda: kvlab.merge(frags, "reprefill", model), args.reprefill_repeats),
        ("rerotate", lambda: kvlab.merge(frags, "rerotate", model), args.repeats),
    ]
    runs += [
        (
            f"recompute {p}",
            (lambda p=p: kvlab.merge(frags, "recompute", model, ratio=args.ratio, policy=p)),
            args.repeats,
        )
        for p in args.policies
    ]
    print(f"{'':<26} {'wall s':>8} {'cpu s':>8} {'wall/reprefill':>15} {'cpu/reprefill':>14}")
    base = {}
    for label, fn, repeats in runs:
        wall, cpu = timed(fn, repeats)
        base.setdefault("wall", wall)
        base.setdefault("cpu", cpu)
        ratio = wall / base["wall"]
        verdict = ("ok" if ratio <= TARGET else f"over the {TARGET}x target") if label.startswith("recompute") else ""
        print(f"{label:<26} {wall:>8.3f} {cpu:>8.3f} {ratio:>15.3f} {cpu / base['cpu']:>14.3f}  {verdict}", flush=True)


def timed(fn, repeats: int) -> tuple[float, float]:
    """Median wall and median process CPU seconds over ``repeats`` runs (after one warm-up).

    Like :func:`benchmarks.timing.timed`, plus CPU time (all threads): on a shared machine
    other processes stretch the wall clock but not this process's CPU time.
    """
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


if __name__ == "__main__":
    main()
