"""A half-precision reader's forward pass: torch's CPU bf16/fp16 GEMM against kvlab's WideLinear.

    .venv/bin/python benchmarks/halfgemm.py [--model smollm2-135m] [--tokens 256] [--repeats 3]

``kvlab.variants(model, "bf16" | "fp16")`` runs each linear layer as an fp32 GEMM of the
half-precision weights and activations, rounded once to the half dtype
(:class:`kvlab.measure.mismatch.WideLinear`). This times one prefill of ``--tokens`` tokens
through the same variant both ways (median of ``--repeats``, torch's default threads), and
prints how far apart their logits are, in units of the half dtype's rounding.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import kvlab
from kvlab.measure.mismatch import WideLinear


def forward(model, ids) -> tuple[torch.Tensor, float]:
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.model(input_ids=ids).logits[0]
        return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = kvlab.load_model(args.model)
    ids = torch.randint(10, base.config.vocab_size - 10, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    print(
        f"{base.name}, {args.tokens} tokens, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'dtype':>5} {'torch GEMM':>11} {'WideLinear':>11} {'speed-up':>9} {'logits equal':>13} {'max |d|, in eps':>16}"
    )
    for kind in ("bf16", "fp16"):
        v = kvlab.variants(base, kind)
        wide = [m for m in v.model.modules() if type(m) is WideLinear]
        times = {}
        for label, cls in (("torch", torch.nn.Linear), ("wide", WideLinear)):
            for m in wide:
                m.__class__ = cls
            runs = [forward(v, ids) for _ in range(args.repeats)]
            times[label] = statistics.median(t for _, t in runs)
            times[label + " logits"] = runs[0][0]
        a, b = times["torch logits"].double(), times["wide logits"].double()
        eps = torch.finfo(v.dtype).eps
        rel = ((a - b).abs() / (eps * a.abs().clamp_min(1.0))).max()
        print(
            f"{kind:>5} {times['torch'] * 1e3:>9.0f} ms {times['wide'] * 1e3:>9.0f} ms {times['torch'] / times['wide']:>8.1f}x"
            f" {float((a == b).double().mean()):>12.1%} {float(rel):>16.1f}"
        )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
