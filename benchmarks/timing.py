"""What the merge, recompute, cache-file and llama.cpp benchmarks share: a run under each malloc setting, a timer.

A merge is memory-bound, and on the project's VM a fresh 100 MB allocation costs about 4x a
copy into memory already touched (page faults; glibc hands big blocks back to the kernel on
free). So those benchmarks run their measurements twice, each in a child process of its own
(malloc settings are read at process start): with glibc's defaults, and with glibc told to
keep freed memory (:data:`TUNED`), which is what a serving process with a caching allocator
(jemalloc, tcmalloc) sees.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

#: glibc told to keep freed memory: no mmap for blocks under 32 MiB, no trimming, 256 MiB of top pad.
TUNED = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
    "MALLOC_TOP_PAD_": str(256 << 20),
}


def run_each_malloc(module: str, argv: list[str], modes=("default", "tuned"), title: str = "glibc malloc") -> None:
    """Run ``python -m module --child MODE argv`` once per malloc mode: glibc's defaults and :data:`TUNED`.

    ``module`` is the benchmark's own name (``__spec__.name``, e.g. ``benchmarks.merge``); the
    child inherits this process's working directory and environment, so it imports the same
    ``benchmarks`` and ``kvlab``. Malloc settings are read at process start, so each mode needs
    a process of its own.
    """
    for mode in modes:
        env = dict(os.environ, **(TUNED if mode == "tuned" else {}))
        print(f"\n== {title}: {mode} ==", flush=True)
        subprocess.run([sys.executable, "-m", module, "--child", mode] + argv, env=env, check=True)


def timed(fn, repeats: int) -> float:
    """Median wall time in seconds over ``repeats`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
