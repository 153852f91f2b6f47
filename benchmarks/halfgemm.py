"""A half-precision reader's forward pass: torch's CPU bf16/fp16 GEMM against kvlab's WideLinear.

    .venv/bin/python -m benchmarks.halfgemm [--model smollm2-135m] [--tokens 256 8] [--repeats 3]

``kvlab.variants(model, "bf16" | "fp16")`` runs each linear layer as an fp32 GEMM of the
half-precision weights and activations, rounded once to the half dtype
(:class:`kvlab.measure.mismatch.WideLinear`), with the weights' float32 copies made once and
kept. This times one forward pass of each of ``--tokens`` lengths (a prefill; a short probe
read) through the same variant three ways (median of ``--repeats``, torch's default threads):
torch's half GEMM, WideLinear casting its weights again in every call (kvlab before the copies
were kept), and WideLinear as it is. It prints how far torch's logits are from WideLinear's, in
units of the half dtype's rounding, and checks that keeping the copies changed no bit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import kvlab
from kvlab.measure.mismatch import WideLinear


class CastEachCall(WideLinear):
    """WideLinear before its float32 weights were kept: both operands cast in every forward pass."""

    def _wide(self):
        return self._cast()


def forward(model, ids) -> tuple[torch.Tensor, float]:
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.model(input_ids=ids).logits[0]
        return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 8])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = kvlab.load_model(args.model)
    print(f"{base.name}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    print(
        f"{'dtype':>5} {'tokens':>6} {'torch GEMM':>11} {'cast/call':>11} {'WideLinear':>11} {'torch/wide':>10}"
        f" {'cast/wide':>9} {'logits equal':>13} {'max |d|, in eps':>16}"
    )
    for kind in ("bf16", "fp16"):
        v = kvlab.variants(base, kind)
        wide = [m for m in v.model.modules() if type(m) is WideLinear]
        for n in args.tokens:
            ids = torch.randint(10, base.config.vocab_size - 10, (1, n), generator=torch.Generator().manual_seed(0))
            times, logits = {}, {}
            for label, cls in (("torch", torch.nn.Linear), ("cast", CastEachCall), ("wide", WideLinear)):
                for m in wide:
                    m.__class__ = cls
                forward(v, ids)  # warm: the kept copies are made here, once
                runs = [forward(v, ids) for _ in range(args.repeats)]
                times[label] = statistics.median(t for _, t in runs)
                logits[label] = runs[0][0]
            assert torch.equal(logits["cast"], logits["wide"]), "keeping the float32 copies changed a bit"
            a, b = logits["torch"].double(), logits["wide"].double()
            eps = torch.finfo(v.dtype).eps
            rel = ((a - b).abs() / (eps * a.abs().clamp_min(1.0))).max()
            print(
                f"{kind:>5} {n:>6} {times['torch'] * 1e3:>8.0f} ms {times['cast'] * 1e3:>8.0f} ms"
                f" {times['wide'] * 1e3:>8.0f} ms {times['torch'] / times['wide']:>9.1f}x"
                f" {times['cast'] / times['wide']:>8.1f}x {float((a == b).double().mean()):>12.1%} {float(rel):>16.1f}"
            )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
