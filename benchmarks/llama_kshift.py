"""Time llama.cpp's K-shift of a two-fragment merge against kvlab's rerotate, in one run.

    .venv/bin/python -m benchmarks.llama_kshift [--tokens 1024] [--repeats 10]

Both sides merge the same two fragments of N random tokens (SmolLM2, warm, after one
untimed run each). llama.cpp (the ``peers`` extra) holds them as two sequences of one
unified f16 cache; its merge is ``llama_memory_seq_add`` (+N on the second sequence),
``llama_memory_seq_cp`` into the first and ``llama_memory_seq_rm`` of the second, and the
K-shift itself runs inside the next ``llama_decode``. So the script times

* ``shift+decode``: restore the two-sequence state (untimed), then merge and decode one token;
* ``decode``: restore the already-merged state (untimed), then decode the same token;

and reports K-shift = shift+decode - decode (medians). kvlab's figure is
``kvlab.merge(frags, "rerotate", model)`` on fp32 fragments, which builds a new cache (a copy
of every K and V) as well as rotating. llama.cpp rotates f16 keys in place, over every cell
of the cache, so its context is sized to the merge (printed). Each side uses this process's
torch thread count. Like ``benchmarks.merge``, the run is repeated with glibc told to keep
freed memory (:func:`benchmarks.timing.run_each_malloc`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import kvlab
from benchmarks.timing import run_each_malloc, timed
from kvlab.cache.fragments import clone_cache, prefill_tokens
from kvlab.peers.mapping import engine_for


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=["default", "tuned"], help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per fragment")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if args.child is None:
        run_each_malloc(__spec__.name, sys.argv[1:])
        return
    torch.manual_seed(0)
    model = kvlab.load_model("smollm2-135m")
    n = args.tokens
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(100, model.config.vocab_size, (n,), generator=g) for _ in range(2)]
    frags = [prefill_tokens(model, t) for t in ids]
    t_rot = timed(lambda: kvlab.merge(frags, "rerotate", model), args.repeats)
    t_naive = timed(lambda: kvlab.merge(frags, "naive", model), args.repeats)
    # The in-place turn a store that owns its cache uses: fragment 2's f16 keys, where they lie.
    # Each repeat turns them by n again (the time does not depend on the angle).
    f16 = clone_cache(frags[1].cache, model.config, torch.float16)
    t_shift16 = timed(lambda: kvlab.shift_(f16, n, model), args.repeats)

    with engine_for(model, n_ctx=2 * n + 64, n_seq_max=2) as eng:
        for i, t in enumerate(ids):
            eng.decode(t, i, 0)
        split = eng.state_bytes()
        probe = [int(ids[0][0])]

        def merge_and_decode():
            eng.seq_add(1, n)
            eng.seq_cp(1, 0)
            eng.seq_rm(1)
            eng.decode(probe, 0, 2 * n)

        merge_and_decode()
        eng.seq_rm(0, 2 * n)
        merged = eng.state_bytes()

        def run(state, fn):
            times = []
            for _ in range(args.repeats + 1):  # the first is the warm-up
                eng.set_state_bytes(state)
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times[1:])

        t_shift_decode = run(split, merge_and_decode)
        t_decode = run(merged, lambda: eng.decode(probe, 0, 2 * n))
        cells = eng.n_ctx
    t_kshift = t_shift_decode - t_decode
    print(
        f"SmolLM2, 2 fragments x {n} random tokens, torch/llama.cpp threads {torch.get_num_threads()}, "
        f"median of {args.repeats} (warm)"
    )
    print(f"  kvlab naive (fp32, new cache)          {t_naive * 1e3:8.2f} ms")
    print(f"  kvlab rerotate (fp32, new cache)       {t_rot * 1e3:8.2f} ms")
    print(f"  kvlab shift_ (f16, in place, 1 frag)   {t_shift16 * 1e3:8.2f} ms")
    print(f"  llama.cpp shift+decode of 1 token      {t_shift_decode * 1e3:8.2f} ms  (f16 cache, {cells} cells)")
    print(f"  llama.cpp decode of 1 token            {t_decode * 1e3:8.2f} ms")
    print(f"  llama.cpp K-shift (difference)         {t_kshift * 1e3:8.2f} ms")
    print(f"  ratio kvlab rerotate / llama.cpp K-shift: {t_rot / t_kshift:.2f}")
    print(f"  ratio kvlab shift_ f16 / llama.cpp K-shift (f16): {t_shift16 / t_kshift:.2f}  (target <= 1.0)")
    print(f"  ratio kvlab rerotate / naive: {t_rot / t_naive:.2f}  (target <= 1.2)")


if __name__ == "__main__":
    main()
