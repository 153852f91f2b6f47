"""The compaction audit on the real models: kvlab's right compaction beside each defect, one run each, timed.

    .venv/bin/python -m benchmarks.compact_audit [--models smollm2-135m gemma3-270m]

Prints, per model and target, the verdict, the failing lines (value against bound) and the
seconds the audit took (target: <= 60 s for one function on SmolLM2 on 2 cores). The defects are
the test suite's (``tests/measure/compact_targets.py``), written from each defect's description.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from kvlab.measure.audit.run import audit
from kvlab.models.sources import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "measure"))
import compact_targets as T  # noqa: E402 -- the suite's wrong compactions, from their folder

#: (target, kind, positions), right ones first; per model, the defects that apply to its layout.
RIGHT = [
    ("kvlab.testing:rerotate_compact", "compact", "kept"),
    ("kvlab.testing:inplace_compact", "compact", "original"),
]
DEFECTS = {
    "smollm2-135m": [
        ("not_rerotated", "compact", "kept"), ("off_by_one", "compact", "kept"),
        ("store_interleaved", "compact", "kept"), ("in_place_at_kept", "compact", "original"),
        ("assigned_layers", "compact", "kept"), ("trims_its_input", "compact", "kept"),
        ("press_at_kept", "press", "original"),
    ],
    "gemma3-270m": [
        ("store_compact", "compact", "kept"), ("not_rerotated", "compact", "kept"),
        ("global_base_everywhere", "compact", "kept"), ("one_inv_freq", "compact", "kept"),
        ("plain_sliding_layers", "compact", "kept"), ("in_place_at_kept", "compact", "original"),
    ],
}  # fmt: skip


def _show(x) -> str:
    return "-" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(DEFECTS))
    args = p.parse_args(argv)
    torch.manual_seed(0)
    print(f"load average {os.getloadavg()[0]:.2f}, torch threads {torch.get_num_threads()}")
    for name in args.models:
        model = load_model(name)
        for spec, kind, positions in RIGHT + DEFECTS[name]:
            fn = spec if ":" in spec else getattr(T, spec)
            t0 = time.perf_counter()
            cert = audit(model, **{kind: fn}, positions=positions)
            took = time.perf_counter() - t0
            bad = [x for x in cert.lines if x.failed]
            said = "; ".join(
                f"{x.check} {x.scope.split(',')[0]}: {_show(x.value)} vs {_show(x.bound)} {x.unit}" for x in bad
            )
            verdict = "certified" if cert.passed else "NOT certified"
            phase = ", ".join(
                f"{x.scope.split(' layers')[0]} {_show(x.value)}" for x in cert.lines if x.check == "phase"
            )
            print(
                f"{name} | {spec.split(':')[-1]} | {kind} | {positions} | {verdict} | phase x rounding: {phase} | "
                f"{said or '-'} | {took:.1f} s"
            )
            ctx = next(x for x in cert.lines if x.check == "context error")
            print(f"    context error {_show(ctx.value)} nats/token; {ctx.detail[:140]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
