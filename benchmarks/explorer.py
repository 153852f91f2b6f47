"""How long the merge explorer takes to redraw after a strategy change, on a real model.

    .venv/bin/python -m benchmarks.explorer [--model smollm2-135m] [--repeats 5]

Builds :class:`kvlab.lab.explorer.MergeExplorer` on the model with its default fragments and
probes (the model loaded and the fragments prefilled first, untimed), then switches the
strategy widget between ``naive``, ``rerotate`` and ``reprefill`` and times each switch: the
merge, the probe reads, the readout and the figures, i.e. everything a user waits for after
a click. Prints the median and the slowest per strategy. Target: <= 1 s on SmolLM2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("MPLBACKEND", "Agg")

from kvlab.lab.explorer import MergeExplorer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    t0 = time.perf_counter()
    ex = MergeExplorer(args.model)
    print(f"explorer built (model loaded, fragments prefilled, first draw) in {time.perf_counter() - t0:.1f} s")
    times: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for strategy in ("rerotate", "reprefill", "naive"):
            t = time.perf_counter()
            ex.strategy.value = strategy
            times.setdefault(strategy, []).append(time.perf_counter() - t)
    for strategy, ts in times.items():
        print(
            f"  switch to {strategy:<10} median {statistics.median(ts) * 1e3:7.1f} ms, slowest {max(ts) * 1e3:7.1f} ms"
        )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
