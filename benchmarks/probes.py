"""Questions scored per CPU-second on the long-context study: the old probe reads against read_probes.

    nice -n 10 .venv/bin/python -m benchmarks.probes [--counts 2 8] [--old-questions 3] [--threads 1 2]

Builds each configuration as the study does (``kvlab.findings.longctx``: ``make_set`` with the
study's seed for set 0, ``passage_fragments``, the four default strategies' merges and the
joined prefill) and scores questions as ``kvlab.findings.qa.ask`` does: each question's probe is read
behind the joined prefill and behind every merge, with the study's 5 greedy tokens.

* old: ``read_probe`` as kvlab had it before issue 23 (kept here only, for this comparison):
  per probe a clone of the cache, then one forward pass per greedy token through
  ``DynamicCache``, whose ``update`` concatenates the whole past again each time. Slow, so
  only the first ``--old-questions`` questions are read; a rate needs no more.
* new: :func:`kvlab.measure.probes.read_probes`, every question behind each cache in one call.
* floor: no reading at all, only the arithmetic every path must do: per cache, one plain
  causal forward pass of as many tokens as the new path feeds (each probe's tokens and its
  greedy tokens after the first), behind one copy of the past, keeping one row of logits per
  question. It says how much of the new path's time is left to take out by reading
  differently, rather than by reading fewer tokens.

``--profile`` also runs the new path once more per configuration under torch's profiler and
prints where its CPU time goes (attention, GEMMs, copies, the rest): what is left once the
copies are gone.

Only the probe reads are timed (merges and prefills are the same for both). CPU time is
``time.process_time`` (all threads); it is printed per torch thread count, since on a
loaded machine idle OpenMP threads spinning at barriers are CPU time too. The load average
is printed before and after. The greedy tokens of the questions both paths read are checked
to be the same, and the largest difference of their next-token log-probabilities printed.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import kvlab
from kvlab.cache.fragments import clone_cache, tokenize
from kvlab.compat import forward
from kvlab.findings.longctx import default_strategies, make_set
from kvlab.findings.qa import passage_fragments
from kvlab.measure.case import FidelityReference
from kvlab.measure.fidelity import fidelity
from kvlab.measure.references import context_reference
from kvlab.measure.room import ProbeCache

GREEDY = 5  # the study's --greedy-tokens default


@torch.inference_mode()
def old_read_probe(model, cache, probe: str, greedy_tokens: int = 0):
    """kvlab's ``references.read_probe`` before issue 23, verbatim: clone, then one token per forward pass."""
    ids = tokenize(model, probe).to(model.device)[None]
    work = clone_cache(cache, model.config)
    at = work.get_seq_length()
    log_probs, greedy = None, []
    for _ in range(max(1, greedy_tokens)):
        pos = torch.arange(at, at + ids.shape[-1], device=model.device)[None]
        logits = forward(model.model, work, input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1).logits[
            0, -1
        ]
        at += ids.shape[-1]
        if log_probs is None:
            log_probs = torch.log_softmax(logits.double(), -1)
        if greedy_tokens:
            greedy.append(int(logits.argmax()))
            ids = torch.tensor([[greedy[-1]]], device=model.device)
    return log_probs, greedy


def timed(fn, *args):
    """``(result, cpu_seconds, wall_seconds)`` of ``fn(*args)``."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn(*args)
    return out, time.process_time() - c0, time.perf_counter() - t0


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def old_scores(model, reference, merges, probes):
    """Per question, as ``fidelity`` read them before: the joined prefill's reading, then each merge's."""
    out = []
    for p in probes:
        want = old_read_probe(model, reference, p, GREEDY)
        out.append([want] + [old_read_probe(model, c, p, GREEDY) for c in merges])
    return out


def new_scores(model, frags, reference, merges, probes):
    """As ``kvlab.findings.qa.ask`` reads them now: ``fidelity`` of each merge against one remembered reference."""
    ref = FidelityReference(model, reference)
    fids = [fidelity(model, frags, c, probes=probes, greedy_tokens=GREEDY, reference=ref) for c in merges]
    return ref, fids


@torch.inference_mode()
def floor_scores(model, caches, probes):
    """One causal forward pass per cache of all the questions' tokens, packed: the arithmetic floor."""
    ids = torch.cat([torch.cat([tokenize(model, p), torch.zeros(GREEDY - 1, dtype=torch.long)]) for p in probes])
    for cache in caches:
        work = ProbeCache(cache, ids.numel())
        seen = cache.get_seq_length()
        pos = torch.arange(seen, seen + ids.numel())[None]
        forward(model.model, work, input_ids=ids[None], position_ids=pos, use_cache=True, logits_to_keep=len(probes))


def profile_shares(model, frags, reference, merges, probes) -> str:
    """The new path's CPU time by kind of operator, from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        new_scores(model, frags, reference, merges, probes)
    kinds = {"attention": 0.0, "GEMM": 0.0, "copies": 0.0, "other": 0.0}
    for e in prof.key_averages():
        name = e.key
        kind = (
            "attention"
            if "scaled_dot_product" in name
            else "GEMM"
            if name in ("aten::mm", "aten::bmm", "aten::addmm")
            else "copies"
            if name in ("aten::copy_", "aten::cat", "aten::clone")
            else "other"
        )
        kinds[kind] += e.self_cpu_time_total
    total = sum(kinds.values())
    return ", ".join(f"{k} {v / total:.0%}" for k, v in kinds.items()) + f" of {total / 1e6:.1f} CPU-s"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--counts", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--old-questions", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    ap.add_argument("--profile", action="store_true", help="also print where the new path's CPU time goes")
    args = ap.parse_args()
    model = kvlab.load_model(args.model)
    print(
        f"{model.name}, {GREEDY} greedy tokens per answer, torch {torch.__version__}, {os.cpu_count()} CPUs; {load()}"
    )
    print(
        f"{'config':>8} {'tokens':>6} {'threads':>7} {'path':>5} {'questions':>9} {'CPU s':>7} {'wall s':>7}"
        f" {'q / CPU-s':>9} {'q / wall-s':>10}"
    )
    for k in args.counts:
        s = make_set(model, k, args.tokens, seed=k)  # the study's set 0 (seed 0 + k)
        frags, probes = passage_fragments(model, s)
        reference = context_reference(model, frags)
        merges = [kvlab.merge(frags, strat, model) for strat in default_strategies().values()]
        few = probes[: args.old_questions]
        for threads in dict.fromkeys(args.threads):
            torch.set_num_threads(threads)
            old, old_cpu, old_wall = timed(old_scores, model, reference, merges, few)
            (ref, fids), new_cpu, new_wall = timed(new_scores, model, frags, reference, merges, probes)
            _, floor_cpu, floor_wall = timed(floor_scores, model, [reference] + merges, probes)
            # The questions both paths scored: the same greedy tokens, next-token log-probs to rounding.
            new = [[ref.read(p, GREEDY)] + [(None, f.probes[q]["greedy"]) for f in fids] for q, p in enumerate(few)]
            same = all(
                o[0][1] == n[0][1] and all(model.tokenizer.decode(a[1]) == b[1] for a, b in zip(o[1:], n[1:]))
                for o, n in zip(old, new)
            )
            dlp = max(float((o[0][0] - n[0][0]).abs().max()) for o, n in zip(old, new))
            rates = {}
            for path, n, cpu, wall in (
                ("old", len(few), old_cpu, old_wall),
                ("new", len(probes), new_cpu, new_wall),
                ("floor", len(probes), floor_cpu, floor_wall),
            ):
                rates[path] = n / cpu
                print(
                    f"{k:>3} x {args.tokens:<3} {reference.get_seq_length():>6} {threads:>7} {path:>5} {n:>9}"
                    f" {cpu:>7.1f} {wall:>7.1f} {n / cpu:>9.3f} {n / wall:>10.3f}"
                )
            print(
                f"{'':>8} new / old: {rates['new'] / rates['old']:.1f}x questions per CPU-second, floor / new "
                f"{rates['floor'] / rates['new']:.2f}x; greedy answers "
                f"{'the same' if same else 'DIFFER'}, max |d log p| (joined prefill) {dlp:.1e}; {load()}"
            )
            if args.profile:
                print(f"{'':>8} new path, by operator: {profile_shares(model, frags, reference, merges, probes)}")


if __name__ == "__main__":
    main()
