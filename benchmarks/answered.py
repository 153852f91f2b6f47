"""Scoring answers behind a merge: one read for the greedy answer and the answer span, against two.

    nice -n 10 .venv/bin/python -m benchmarks.answered [--configs 3x128 2x512] [--repeats 3]

``kvlab.fidelity`` with answers (what ``kvlab.findings.qa.ask``, notebooks 05 and 07 and the
long-context studies run per strategy) used to read the probes behind the cache twice: once
with the greedy continuation, once with the true answer teacher-forced. It now reads them once
with both. This times the two ways on the same merge, as the notebooks build it
(``make_set``, ``passage_fragments``, a rerotate merge, the joined prefill as reference), and
checks what they give: the span scores bit for bit, and how many greedy answers agree (a greedy
token is an argmax, so fp32 rounding of another packing can flip a near-tie).

CPU time (``time.process_time``, all threads) of the reads only; the reference's reads are
done once before timing, as a sweep over strategies reuses them. The load average is printed
before and after.
"""

from __future__ import annotations

import argparse
import os
import time

import kvlab
from kvlab.findings.longctx import make_set
from kvlab.findings.qa import passage_fragments
from kvlab.lab import setup
from kvlab.measure.case import FidelityReference
from kvlab.measure.fidelity import fidelity
from kvlab.measure.probes import read_probes
from kvlab.measure.references import context_reference
from kvlab.measure.span import span_scores

GREEDY = 5  # the notebooks' and studies' greedy tokens


def two_reads(model, cache, ref: FidelityReference, probes, answers):
    """kvlab's path before: the greedy read, then the answer-span read."""
    want = ref.reads(probes, GREEDY)
    got = read_probes(model, cache, probes, greedy=GREEDY, draft=[w.greedy for w in want])
    return [g.greedy for g in got], span_scores(model, cache, ref, probes, answers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--configs", nargs="+", default=["3x128", "2x512"], help="passages x tokens")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    setup(0)
    model = kvlab.load_model(args.model)
    print(f"load average at start: {os.getloadavg()[0]:.2f}; model {model.name}")
    for config in args.configs:
        n, tokens = (int(x) for x in config.split("x"))
        s = make_set(model, n, tokens, seed=0, people_per_passage=2)
        frags, probes = passage_fragments(model, s)
        answers = [q.answer for q in s.questions]
        cache = kvlab.merge(frags, "rerotate", model)
        ref = FidelityReference(model, context_reference(model, frags))
        old = two_reads(model, cache, ref, probes, answers)  # warm, and fills the reference's readings
        new = fidelity(model, frags, cache, probes=probes, greedy_tokens=GREEDY, reference=ref, answers=answers)
        times = {"two reads": [], "one read": []}
        for _ in range(args.repeats):
            t0 = time.process_time()
            two_reads(model, cache, ref, probes, answers)
            times["two reads"].append(time.process_time() - t0)
            t0 = time.process_time()
            fidelity(model, frags, cache, probes=probes, greedy_tokens=GREEDY, reference=ref, answers=answers)
            times["one read"].append(time.process_time() - t0)
        same_span = all(
            o["span_kl"] == r["span_kl"] and o["nll"] == r["nll"] for o, r in zip(old[1], new.probes, strict=True)
        )
        agree = sum(model.tokenizer.decode(a) == r["greedy"] for a, r in zip(old[0], new.probes, strict=True))
        best = {k: min(v) for k, v in times.items()}
        print(
            f"{config}: {len(probes)} questions, ~{sum(f.length for f in frags)} tokens; CPU s (best of {args.repeats}): "
            f"two reads {best['two reads']:.2f}, one read {best['one read']:.2f}, "
            f"ratio {best['two reads'] / best['one read']:.2f}x; span scores bit-identical: {same_span}; "
            f"greedy answers alike: {agree}/{len(probes)}"
        )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
