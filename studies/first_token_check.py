"""Why a re-rotated merge can read worse than a naive one: a diagnostic on one generated set.

    .venv/bin/python studies/first_token_check.py [--model smollm2-135m] [--count 2] [--tokens 512] [--set 8]

Every later fragment was prefilled alone, so its first token was the first token of a forward
pass. Reads each question of one set (the long-context study's seeding) behind the joined
prefill and behind four caches, and prints the mean first-token KL against the joined prefill:

* ``naive`` and ``rerotate`` (kvlab's merges);
* ``phase reference``: each fragment prefilled alone *at its landing positions* (what a
  perfect re-rotation gives: equal to ``rerotate`` up to fp32 rounding);
* ``rerotate, first tokens joined``: rerotate with the K/V of each later fragment's first
  token replaced by the joined prefill's, everything else as rerotate.

One set and its questions: a diagnostic of where the error sits, not a rate.
"""

from __future__ import annotations

import argparse

import kvlab
from kvlab.findings.longctx import make_set
from kvlab.findings.qa import passage_fragments
from kvlab.measure.probes import read_probes


def mean_kl(ref, reads) -> float:
    kls = [float((a.log_probs.exp() * (a.log_probs - b.log_probs)).sum()) for a, b in zip(ref, reads)]
    return sum(kls) / len(kls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--count", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--set", type=int, default=8, help="the study's set index (seed count + 1000 x set)")
    args = ap.parse_args()
    model = kvlab.load_model(args.model)
    s = make_set(
        model, args.count, args.tokens, seed=args.count + 1000 * args.set, people_per_passage=1, max_questions=12
    )
    frags, probes = passage_fragments(model, s)
    case = kvlab.Case(model, frags, probes)
    joined = read_probes(model, case.context, probes)
    fixed = kvlab.merge(frags, "rerotate", model)
    for at in kvlab.landing_positions(frags)[1:]:
        for lr, lj in zip(fixed.layers, case.context.layers):
            if lr.keys.shape[-2] == lj.keys.shape[-2]:  # a layer that keeps every position
                lr.keys[..., at, :] = lj.keys[..., at, :]
                lr.values[..., at, :] = lj.values[..., at, :]
    caches = {
        "naive": kvlab.merge(frags, "naive", model),
        "rerotate": kvlab.merge(frags, "rerotate", model),
        "phase reference": case.phase,
        "rerotate, first tokens joined": fixed,
    }
    print(
        f"{model.name}: {args.count} fragments of {[f.length for f in frags]} tokens, {len(probes)} questions (set {args.set})"
    )
    for name, cache in caches.items():
        print(
            f"  {name:<30} first-token KL vs joined prefill {mean_kl(joined, read_probes(model, cache, probes)):.4f} nats"
        )


if __name__ == "__main__":
    main()
