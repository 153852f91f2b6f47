"""Time naive, rerotate and reprefill merges on SmolLM2 and print the ratios of one run.

    .venv/bin/python -m benchmarks.merge [--sizes 256 1024 4096] [--repeats 20]

A merge is memory-bound: it writes every K and V once more. On this VM a fresh 100 MB
allocation costs 4x a copy into memory already touched (page faults; glibc hands big
blocks back to the kernel on free). So the script runs each size twice, in child
processes (:func:`benchmarks.timing.run_each_malloc`): with glibc's defaults, and with glibc
told to keep freed memory (MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_), which is what a
serving process with a caching allocator (jemalloc, tcmalloc) sees. Both tables are printed.

Targets (issue 2): rerotate <= 1.5x naive (a merge copies K and V once anyway), and
rerotate >= 200x faster than reprefill at 2x1024 tokens.
"""

from __future__ import annotations

import argparse
import sys

import torch

import kvlab
from benchmarks.timing import run_each_malloc, timed
from kvlab.cache.fragments import prefill_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=["default", "tuned"], help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--reprefill-repeats", type=int, default=1)
    args = ap.parse_args()
    if args.child is None:
        run_each_malloc(__spec__.name, sys.argv[1:])
        return
    torch.manual_seed(0)
    model = kvlab.load_model(args.model)
    vocab = model.config.vocab_size
    print(
        f"model {model.name}, fp32, torch threads {torch.get_num_threads()}; "
        f"median of {args.repeats} (reprefill: {args.reprefill_repeats})"
    )
    print(
        f"{'tokens/frag':>11} {'naive ms':>9} {'rerotate ms':>12} {'reprefill s':>12} {'rerot/naive':>12} {'reprefill/rerot':>16}"
    )
    g = torch.Generator().manual_seed(0)
    for n in args.sizes:
        frags = [prefill_tokens(model, torch.randint(100, vocab, (n,), generator=g)) for _ in range(2)]
        t_naive = timed(lambda frags=frags: kvlab.merge(frags, "naive", model), args.repeats)
        t_rot = timed(lambda frags=frags: kvlab.merge(frags, "rerotate", model), args.repeats)
        t_pre = timed(lambda frags=frags: kvlab.merge(frags, "reprefill", model), args.reprefill_repeats)
        print(
            f"{n:>11} {t_naive * 1e3:>9.2f} {t_rot * 1e3:>12.2f} {t_pre:>12.2f} {t_rot / t_naive:>12.2f} {t_pre / t_rot:>16.0f}"
        )


if __name__ == "__main__":
    main()
