"""The distractor needle study's reads: one row per cache, question and strategy, with where its needle sat.

Haystack ``h`` is its own stretch of the seeded essay order (``h * STRIDE`` sentences on); its
``n_fragments`` caches (one per fragment index, :func:`kvlab.findings.distractors.placements`)
share that text and differ in where the needle and its distractors go. A pilot reads only the
joined prefill (:func:`pilot_rows`); the run reads every strategy (:func:`needle_rows`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from kvlab.cache.merge import landing_positions
from kvlab.cache.recompute.strategy import Recompute
from kvlab.cache.strategies import Naive, Rerotate, Strategy
from kvlab.findings import distractors, haystack, longctx
from kvlab.findings.evalset import Names
from kvlab.findings.needles import joined
from kvlab.findings.qa import ask, passage_fragments
from kvlab.models.loaded import LoadedModel

#: Sentences between one haystack's first sentence and the next's: 4 x 512 tokens use about 110, so
#: the essays' 6664 sentences hold 41 haystacks that share no sentence.
STRIDE = 160
#: Tokens of the greedy answer scored by exact match (a 4-digit value and its space).
GREEDY = 5
#: The recompute policies read, at the ratio the design names.
POLICIES = ("deviation", "fragment_start", "random_later")
TEXT = ("answer", "truth", "ref_answer", "distractors")


def merges(ratio: float, seed: int) -> dict[str, Strategy]:
    """naive, rerotate and one recompute per policy at ``ratio`` (reprefill comes from the joined prefill)."""
    out: dict[str, Strategy] = {"naive": Naive(), "rerotate": Rerotate()}
    for p in POLICIES:
        out[f"recompute {p}"] = Recompute(ratio=ratio, policy=p, seed=seed)
    return out


def caches(model: LoadedModel, h: int, n_fragments: int, tokens: int, seed: int):
    """Haystack ``h``'s caches in draw order: ``(index, evalset, fragments, probes)``, one per fragment index."""
    sents = haystack.corpus(seed)
    count = longctx.token_counter(model)
    rng = random.Random(f"distractor haystack {seed} {h} {n_fragments} {tokens}")
    names = Names(rng)
    start = h * STRIDE
    for c, place in enumerate(distractors.placements(rng, n_fragments)):
        s, end = distractors.distractor_set(sents, start, n_fragments, tokens, place, count, rng, names, seed)
        if end > start + STRIDE:
            raise RuntimeError(f"haystack {h} runs past its stretch ({end - start} > {STRIDE} sentences)")
        frags, probes = passage_fragments(model, s)
        yield c, s, frags, probes


def _tags(model: LoadedModel, h: int, c: int, s, frags, tokens: int) -> dict:
    count = longctx.token_counter(model)
    f = s.facts["fragment"]
    text = distractors.TEMPLATES[[t.name for t in distractors.TEMPLATES].index(s.facts["template"])].sentence(
        s.questions[0].subject, s.facts["truth"]
    )
    before = s.passages[f][: s.passages[f].index(text)]
    lands = landing_positions(frags)
    return {
        "set": h,
        "cache": c,
        "n_fragments": len(frags),
        "fragment_tokens": tokens,
        "template": s.facts["template"],
        "needle_fragment": f,
        "within": round(s.facts["within"], 4),
        "n_distractors": len(s.facts["distractors"]),
        "distractors": " ".join(s.facts["distractors"].values()),
        # Within a token or two at the joins: counted by the tokenizer on the text before it.
        "needle_at": lands[f] + (frags[f].length - count(s.passages[f])) + count(before),
        "total_tokens": lands[-1] + frags[-1].length,
    }


def _captures(r: dict, values: list[str]) -> dict:
    return {
        "captured": distractors.captured(r["answer"], r["truth"], values),
        "ref_captured": distractors.captured(r["ref_answer"], r["truth"], values),
    }


def pilot_rows(model: LoadedModel, h: int, n_fragments: int, tokens: int, seed: int) -> list[dict]:
    """The joined prefill's read of haystack ``h``'s caches: ``ref_em``, ``ref_answer``, ``nll_ref``, captures."""
    rows = []
    for c, s, frags, probes in caches(model, h, n_fragments, tokens, seed):
        (r,) = ask(model, s, {"naive": Naive()}, greedy_tokens=GREEDY, fragments=frags, probes=probes)
        values = list(s.facts["distractors"].values())
        keep = ("question", "truth", "ref_answer", "ref_em", "nll_ref", "span_tokens")
        rows.append(
            _tags(model, h, c, s, frags, tokens)
            | {k: r[k] for k in keep}
            | {"ref_captured": _captures(r, values)["ref_captured"]}
        )
    return rows


def needle_rows(
    model: LoadedModel, h: int, n_fragments: int, tokens: int, seed: int, reads: Mapping[str, Strategy]
) -> list[dict]:
    """One row per (cache, strategy) of haystack ``h``: :func:`kvlab.findings.qa.ask`'s columns and the placement.

    ``reprefill`` is added from the joined prefill's reads (it builds exactly that cache).
    """
    rows = []
    for c, s, frags, probes in caches(model, h, n_fragments, tokens, seed):
        got = ask(model, s, dict(reads), greedy_tokens=GREEDY, fragments=frags, probes=probes)
        got += [joined(r) for r in got if r["strategy"] == next(iter(reads))]
        tags = _tags(model, h, c, s, frags, tokens)
        values = list(s.facts["distractors"].values())
        rows += [tags | r | _captures(r, values) for r in got]
    return rows


def side_rows(model: LoadedModel, h: int, tokens: int, seed: int) -> list[dict]:
    """The joined prefill's read of haystack ``h`` with the distractors before the needle and after it.

    Three fragments of ``tokens`` (:func:`kvlab.findings.distractors.side_placements`); the two
    caches share the needle, its town, value, depth and template, and the distractors' towns,
    values and depths (one seeded draw each). One row per side: ``strategy`` is the side, ``cache``
    0 (so the two pair as one question), ``em``, ``answer``, ``nll`` and ``captured`` the joined
    prefill's. The essay sentences around the needle may shift between the sides: each passage is
    cut to its own budget after its inserted sentences.
    """
    sents = haystack.corpus(seed)
    count = longctx.token_counter(model)
    key = f"distractor sides {seed} {h} {tokens}"
    start = h * STRIDE
    rows = []
    for side, place in distractors.side_placements(random.Random(key)).items():
        rng = random.Random(key + " values")
        s, end = distractors.distractor_set(sents, start, 3, tokens, place, count, rng, Names(rng), seed)
        if end > start + STRIDE:
            raise RuntimeError(f"haystack {h} runs past its stretch ({end - start} > {STRIDE} sentences)")
        frags, probes = passage_fragments(model, s)
        (r,) = ask(model, s, {"naive": Naive()}, greedy_tokens=GREEDY, fragments=frags, probes=probes)
        values = list(s.facts["distractors"].values())
        rows.append(
            _tags(model, h, 0, s, frags, tokens)
            | {"strategy": side, "question": r["question"], "truth": r["truth"], "answer": r["ref_answer"]}
            | {"em": r["ref_em"], "ref_em": r["ref_em"], "nll": r["nll_ref"], "span_tokens": r["span_tokens"]}
            | {"captured": _captures(r, values)["ref_captured"], "ref_answer": r["ref_answer"]}
        )
    return rows
