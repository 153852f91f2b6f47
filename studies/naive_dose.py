"""Dose-response of a naive merge (issue 24, part 1): does concatenating fragments at the wrong
rotary phase change answers more than re-rotating them, by the fragment count, by the absolute
landing offset of the passage that holds the answer, and by that passage's relative order within
the merge? And by the fragment length?

Design, named before the run (the count axis, redesigned after the reviewer's issue: the first
design asked a passage p >= 2 only when it was the last one, so its landing offset was confounded
with "the answer is in the last fragment", and it pooled count 1 into passage 0):

* **Count** (``counts``: 2, 4 and 8 fragments of at most ``tokens`` tokens). Each of ``sets``
  generated sets has 8 passages, one person each. The k-fragment merge uses passages 0..k-1 of
  that same set (each passage prefilled once per set and its fragment reused at every count), and
  at every count **every** passage's one-passage questions (town, year) are asked. So passage p
  lands at the same absolute offset (about p x ``tokens``) at every count while its relative
  order p/(k-1) changes with k: offset and order separate. Count 1 (where both merges are the
  joined prefill) is not run. A cache is one generated set at one count; the caches of one set
  share passages, so wherever counts are pooled the set is resampled.
* **Length** (``lengths`` tokens per fragment at ``length_count`` fragments; passages 0, 1 and the
  last asked). A set's seed fixes its people and facts before any filler is drawn, so every length
  asks the same questions about the same facts; the mix of relative positions is the same at every
  length, so this axis is not confounded the way the count axis was.

Every question is read behind ``naive``, ``rerotate`` and the joined prefill of the same tokens
(the reference: KL 0; its exact match is the full-context ceiling). The comparison is
``naive - rerotate``, paired over the same questions, 95% cluster bootstrap over caches
(:func:`kvlab.measure.stats.paired_diff_ci`) with its bootstrap p (:func:`kvlab.measure.stats.paired_p`), in answer-span KL
(nats per token of the true answer, teacher-forced; **primary**), first-token KL and exact match
against the truth. Each is stated on every question of a cell and, beside it, on the questions
the joined prefill answers right (the reference-right stratum). The families (Holm within each
family, per metric and per stratum, :func:`kvlab.measure.stats.holm`):

* ``counts``: per count, every question (3 comparisons);
* ``cells``: per (count, passage) (2 + 4 + 8 = 14);
* ``offsets``: per passage, i.e. per absolute offset p x ``tokens``, pooled over the counts that
  hold it, resampled by set (8);
* ``relative``: per relative position, pooled over counts, resampled by set: ``first`` (p = 0),
  ``early`` (0 < p/(k-1) < 1/2), ``late`` (1/2 < p/(k-1) < 1), ``last`` (p = k-1) (4);
* ``direct``: which of offset and order explains the data (:data:`DIRECT`, 10). Each is a
  difference of differences, (naive - rerotate at cell a) - (naive - rerotate at cell b), paired by
  (set, question kind) and resampled by set. **Order at a fixed offset**: the same passage, so the
  same questions at the same offset, last (or late) in one merge and early in a larger one.
  **Offset at a fixed order**: the last passage at k = 4 against k = 2, and k = 8 against 4 (here
  offset and count move together), and a middle passage at about the same relative position at two
  offsets. **Count at offset 0**: the first passage at k = 4 against 2 and 8 against 4. If the sign
  of naive - rerotate follows relative order, the order tests are above 0 and the offset tests are
  not; if it follows absolute offset, the offset tests are above 0 and the order tests are not.

A comparison resting on a single cache (a reference-right stratum that only one set reaches) is shown
but not tested: its interval has zero width and its bootstrap p would be the floor, so it gets no p
and stays out of its Holm family (this rule was added while the run was going, before any result).

    .venv/bin/python studies/naive_dose.py --model smollm2-135m --axis count --sets 1 --out /tmp/dose
    .venv/bin/python studies/naive_dose.py --sweep-table results/naive_dose   # after kvlab sweep

The count axis writes its per-question rows (one per question and strategy, with the cache:
``set`` and ``n_fragments``) to ``rows_<model>.csv``; :func:`sweep_table` recomputes every count
interval from those rows (the length points of the first design left only their records).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import kvlab
from kvlab.findings import longctx, strata
from kvlab.findings.evalset import EvalSet
from kvlab.findings.qa import ask, passage_fragments, passage_texts
from kvlab.findings.rows import point_rows_path, write_point_rows
from kvlab.measure.stats import fmt_ci, holm, mean_ci, paired_did, paired_diff_ci, paired_p, proportion_ci
from kvlab.sweep.point import read_points

COUNTS = (2, 4, 8)
LENGTHS = (64, 128, 256, 512, 1024)
ONE_PASSAGE = ("town", "year")
METRICS = ("span_kl", "kl", "em")
RELATIVE = ("first", "early", "late", "last")
SEED = 0
#: A comparison resting on fewer caches is shown but not tested (no p, left out of its Holm family).
MIN_CACHES = 2

#: The direct tests, named before the run: (kind, label, cell a, cell b), a cell being (count, passage).
DIRECT = (
    ("order", "passage 1 (offset ~1 x tokens): last of 2 - early of 4", (2, 1), (4, 1)),
    ("order", "passage 1 (offset ~1 x tokens): last of 2 - early of 8", (2, 1), (8, 1)),
    ("order", "passage 3 (offset ~3 x tokens): last of 4 - early of 8", (4, 3), (8, 3)),
    ("order", "passage 2 (offset ~2 x tokens): late of 4 - early of 8", (4, 2), (8, 2)),
    ("offset", "last passage: 3 of 4 (~3 x tokens) - 1 of 2 (~1 x tokens)", (4, 3), (2, 1)),
    ("offset", "last passage: 7 of 8 (~7 x tokens) - 3 of 4 (~3 x tokens)", (8, 7), (4, 3)),
    ("offset", "about 1/3 in: passage 2 of 8 (2/7, ~2 x tokens) - 1 of 4 (1/3, ~1 x tokens)", (8, 2), (4, 1)),
    ("offset", "about 2/3 in: passage 5 of 8 (5/7, ~5 x tokens) - 2 of 4 (2/3, ~2 x tokens)", (8, 5), (4, 2)),
    ("count", "first passage (offset 0): of 4 - of 2", (4, 0), (2, 0)),
    ("count", "first passage (offset 0): of 8 - of 4", (8, 0), (4, 0)),
)


def strategies() -> dict:
    return {"naive": kvlab.Naive(), "rerotate": kvlab.Rerotate()}


def relative(p: int, k: int) -> str:
    """Passage ``p``'s place among ``k``: first, early (p/(k-1) < 1/2), late (> 1/2) or last."""
    if p == 0:
        return "first"
    if p == k - 1:
        return "last"
    return "early" if p / (k - 1) < 0.5 else "late"


def asked(s: EvalSet, k: int, keep=None) -> EvalSet:
    """Passages 0..k-1 of ``s`` and the one-passage questions about each of them (``keep``: only those passages)."""
    keep = set(range(k)) if keep is None else set(keep)
    qs = [q for q in s.questions if q.kind in ONE_PASSAGE and q.passages[0] in keep and q.passages[0] < k]
    return EvalSet(s.passages[:k], qs, s.seed, s.facts)


def _read(model, s: EvalSet, frags, probes, greedy_tokens: int, **tags) -> list[dict]:
    rows = ask(model, s, strategies(), greedy_tokens=greedy_tokens, fragments=frags, probes=probes)
    total = sum(f.length for f in frags)
    for r in rows:
        r.update(tags, n_fragments=len(frags), total_tokens=total)
    return rows


def count_rows(model, counts=COUNTS, tokens=512, *, sets=8, seed=0, greedy_tokens=5, log=None) -> list[dict]:
    """The count axis: one row per (set, count, question, strategy), nested by set; every passage asked at every count."""
    rows = []
    for j in range(sets):
        t0 = time.perf_counter()
        full = longctx.make_set(model, max(2, *counts), tokens, seed=seed + 1000 * j, people_per_passage=1)
        frags, _ = passage_fragments(model, full)
        texts, _, _ = passage_texts(model, full)
        for k in counts:
            s = asked(full, k)
            texts_k, probes, _ = passage_texts(model, s)
            if texts_k != texts[:k]:
                raise kvlab.MergeError("the chat template renders the first passages differently at another count")
            got = _read(model, s, frags[:k], probes, greedy_tokens, axis="count", set=j, fragment_tokens=tokens)
            for r in got:
                p = r["answer_passage"]
                r.update(cache=f"set {j}, {k} fragments", relative=relative(p, k), rel_pos=p / (k - 1))
            rows += got
        if log:
            log(f"{model.name}: count set {j + 1}/{sets}: {time.perf_counter() - t0:.0f} s")
    return rows


def length_rows(model, lengths=LENGTHS, count=4, *, sets=8, seed=0, greedy_tokens=5, log=None) -> list[dict]:
    """The length axis: one row per (set, length, question, strategy); a set's facts are the same at every length."""
    rows = []
    for j in range(sets):
        t0 = time.perf_counter()
        for n in lengths:
            made = longctx.make_set(model, count, n, seed=seed + 1000 * j + 500, people_per_passage=1)
            s = asked(made, count, {0, 1, count - 1})
            frags, probes = passage_fragments(model, s)
            rows += _read(model, s, frags, probes, greedy_tokens, axis="length", set=j, fragment_tokens=n)
        if log:
            log(f"{model.name}: length set {j + 1}/{sets}: {time.perf_counter() - t0:.0f} s")
    return rows


def read_rows(path) -> list[dict]:
    """The rows of ``rows_<model>.csv``, typed back (answers stay text; ``relative`` and ``cache`` are text)."""
    return strata.read_rows(path)


# ---------------------------------------------------------------- the count axis's comparisons


def _diff(rows, where: dict, m: str, cluster: tuple[str, ...], seed: int) -> dict | None:
    a, b, caches = longctx.pairs(rows, "naive", "rerotate", m, where, cluster)
    if not a:
        return None
    d = paired_diff_ci(a, b, clusters=caches, seed=seed).as_dict()
    # One cache gives no interval: such a comparison is shown, not tested.
    d["p"] = paired_p(a, b, clusters=caches, seed=seed) if len(set(caches)) >= MIN_CACHES else None
    return d


def _arms(rows: list[dict], where: dict, m: str, cluster: tuple[str, ...], seed: int):
    """naive's and rerotate's intervals of metric ``m`` where ``where`` holds, and the paired values they came from."""
    a, b, caches = longctx.pairs(rows, "naive", "rerotate", m, where, cluster)
    ci = proportion_ci if m == "em" else mean_ci
    arms = {
        "naive": ci(a, clusters=caches, seed=seed).as_dict(),
        "rerotate": ci(b, clusters=caches, seed=seed).as_dict(),
    }
    return arms, a, b, caches


def _ceiling(rows: list[dict], where: dict, cluster: tuple[str, ...], seed: int) -> tuple[dict, list[dict]]:
    """The reference's exact match, n and caches where ``where`` holds; and naive's rows there (one per question)."""
    sel = [r for r in rows if r["strategy"] == "naive" and all(r[k] == v for k, v in where.items())]
    ref, caches = [bool(r["ref_em"]) for r in sel], [tuple(r[c] for c in cluster) for r in sel]
    out = {
        "ceiling_em": proportion_ci(ref, clusters=caches, seed=seed).as_dict(),
        "n": len(ref),
        "caches": len(set(caches)),
    }
    return out, sel


def cell(rows: list[dict], where: dict, cluster: tuple[str, ...], seed: int = SEED) -> dict:
    """naive, rerotate and their paired difference (every question, and where the reference is right) and the ceiling."""
    out: dict = {}
    for m in METRICS:
        arms, *_ = _arms(rows, where, m, cluster, seed)
        out[m] = {
            **arms,
            "diff": _diff(rows, where, m, cluster, seed),
            "right": _diff(rows, {**where, "ref_em": True}, m, cluster, seed),
        }
    ceiling, sel = _ceiling(rows, where, cluster, seed)
    out.update(ceiling)
    out["n_right"] = sum(bool(r["ref_em"]) for r in sel)
    at = [r["answer_offset"] for r in sel]
    out.update(offset_min=min(at), offset_max=max(at), offset_mean=sum(at) / len(at))
    out["rel_pos"] = sum(r.get("rel_pos", 0.0) for r in sel) / len(sel)
    return out


def _per_question(rows, cellkey: tuple[int, int], m: str) -> dict:
    """(naive, rerotate) per (set, question kind) in one (count, passage) cell."""
    k, p = cellkey
    a, b, labels = longctx.pairs(rows, "naive", "rerotate", m, {"n_fragments": k, "answer_passage": p}, ("set", "kind"))
    if len(set(labels)) != len(labels):
        raise kvlab.KvlabError(f"cell {cellkey} holds two questions of one kind in one set")
    return {lab: (x, y) for lab, x, y in zip(labels, a, b)}


def did(rows: list[dict], a: tuple[int, int], b: tuple[int, int], seed: int = SEED) -> dict:
    """(naive - rerotate at cell ``a``) - (the same at cell ``b``), paired by (set, question kind), resampled by set.

    Exact match is a rate: :func:`kvlab.measure.stats.paired_did` keeps its interval from collapsing
    where no question changes its answer in either cell.
    """
    out: dict = {}
    for m in METRICS:
        da, db = _per_question(rows, a, m), _per_question(rows, b, m)
        keys = sorted(set(da) & set(db))
        sets = [q[0] for q in keys]
        ci, p = paired_did(
            *([pair[i] for pair in (da[q] for q in keys)] for i in (0, 1)),
            *([pair[i] for pair in (db[q] for q in keys)] for i in (0, 1)),
            clusters=sets,
            seed=seed,
        )
        out[m] = {"diff": ci.as_dict()}
        out[m]["diff"]["p"] = p if len(set(sets)) >= MIN_CACHES else None
    out["n"], out["caches"] = len(keys), len(set(sets))
    return out


def _holm(family: dict) -> None:
    """Holm's adjustment within one family, per metric and per stratum (every question / reference right)."""
    for m in METRICS:
        for part in ("diff", "right"):
            got = [c[m][part] for c in family.values() if c[m].get(part) is not None and c[m][part]["p"] is not None]
            for d, adj in zip(got, holm([d["p"] for d in got]) if got else []):
                d["p_holm"] = adj


def summarise_count(rows: list[dict], seed: int = SEED) -> dict:
    """Every named family of the count axis (count 1 rows, if any, left out), Holm-adjusted within each."""
    rows = strata.merges(rows)
    ks = sorted({r["n_fragments"] for r in rows})
    ps = sorted({r["answer_passage"] for r in rows})
    cache, by_set = ("n_fragments", "set"), ("set",)
    doc: dict = {"axis": "count"}
    doc["counts"] = {f"k{k}": cell(rows, {"n_fragments": k}, cache, seed) for k in ks}
    doc["cells"] = {
        f"k{k}_p{p}": cell(rows, {"n_fragments": k, "answer_passage": p}, cache, seed)
        for k in ks
        for p in range(k)
        if p in ps
    }
    doc["offsets"] = {f"p{p}": cell(rows, {"answer_passage": p}, by_set, seed) for p in ps}
    have = {r["relative"] for r in rows}
    doc["relative"] = {c: cell(rows, {"relative": c}, by_set, seed) for c in RELATIVE if c in have}
    doc["direct"] = {}
    for i, (kind, label, a, b) in enumerate(DIRECT):
        if f"k{a[0]}_p{a[1]}" in doc["cells"] and f"k{b[0]}_p{b[1]}" in doc["cells"]:
            d = did(rows, a, b, seed)
            d.update(kind=kind, label=label, a=f"k{a[0]}_p{a[1]}", b=f"k{b[0]}_p{b[1]}")
            doc["direct"][f"d{i}"] = d
    for fam in ("counts", "cells", "offsets", "relative", "direct"):
        _holm(doc[fam])
    return doc


def _d(d: dict | None, spec: str) -> str:
    """An interval with its Holm p, bold when that p is at most 0.05; a dash where there is none."""
    if d is None:
        return "-"
    if d["p"] is None:
        return f"{fmt_ci(d, spec)} (untested)"
    b = "**" if d["p_holm"] <= 0.05 else ""
    return f"{b}{fmt_ci(d, spec)}{b} ({d['p_holm']:.3f})"


HEADS = {
    "counts": "fragments",
    "cells": "fragments, passage (offset, tokens; relative)",
    "offsets": "passage (offset, tokens; counts pooled)",
    "relative": "relative position (counts pooled)",
}


def _key(which: str, key: str, c: dict) -> str:
    at = f"{c['offset_min']}-{c['offset_max']}"
    if which == "cells":
        k, p = key[1:].split("_p")
        return f"{k}, passage {p} ({at}; {c['rel_pos']:.2f})"
    if which == "offsets":
        return f"passage {key[1:]} ({at})"
    return key[1:] if which == "counts" else key


def count_table(doc: dict, which: str) -> str:
    """One family's cells: both merges, the paired difference (Holm p), and the same where the reference is right."""
    out = [
        f"| {HEADS[which]} | n (caches) | naive span KL | rerotate span KL | naive - rerotate span KL (Holm p) | "
        "reference right: n | span KL diff (Holm p) | first-token KL diff (Holm p) | exact match naive | rerotate | "
        "diff (Holm p) | reference right: diff (Holm p) | ceiling |",
        "|" + "---|" * 13,
    ]
    for key, c in doc[which].items():
        s, k, e = c["span_kl"], c["kl"], c["em"]
        out.append(
            f"| {_key(which, key, c)} | {c['n']} ({c['caches']}) | {fmt_ci(s['naive'], '.3f')} | "
            f"{fmt_ci(s['rerotate'], '.3f')} | {_d(s['diff'], '+.3f')} | {c['n_right']} | {_d(s['right'], '+.3f')} | "
            f"{_d(k['diff'], '+.3f')} | {fmt_ci(e['naive'], '.2f')} | {fmt_ci(e['rerotate'], '.2f')} | "
            f"{_d(e['diff'], '+.2f')} | {_d(e['right'], '+.2f')} | {fmt_ci(c['ceiling_em'], '.2f')} |"
        )
    return "\n".join(out)


def direct_table(doc: dict) -> str:
    """The direct tests: each cell's own naive - rerotate span KL, and their difference in every metric (Holm p)."""
    cells = doc["cells"]
    out = [
        "| test | (naive - rerotate at a) - (at b) | pairs (sets) | span KL diff at a | at b | "
        "difference, span KL (Holm p) | first-token KL (Holm p) | exact match (Holm p) |",
        "|" + "---|" * 8,
    ]
    for d in doc["direct"].values():
        a, b = cells[d["a"]]["span_kl"]["diff"], cells[d["b"]]["span_kl"]["diff"]
        out.append(
            f"| {d['kind']} | {d['label']} | {d['n']} ({d['caches']}) | {fmt_ci(a, '+.3f')} | {fmt_ci(b, '+.3f')} | "
            f"{_d(d['span_kl']['diff'], '+.3f')} | {_d(d['kl']['diff'], '+.3f')} | {_d(d['em']['diff'], '+.2f')} |"
        )
    return "\n".join(out)


def verdict(doc: dict, model: str) -> list[str]:
    """Per kind of direct test, how many answer-span KL differences Holm resolves, and with which sign."""
    out = []
    for kind, what in (
        ("order", "order at a fixed offset"),
        ("offset", "offset at a fixed order"),
        ("count", "count at offset 0"),
    ):
        ds = [d for d in doc["direct"].values() if d["kind"] == kind]
        if not ds:
            continue
        ds = [d["span_kl"]["diff"] for d in ds if d["span_kl"]["diff"]["p"] is not None]
        if not ds:
            continue
        up = sum(d["p_holm"] <= 0.05 and d["lo"] > 0 for d in ds)
        down = sum(d["p_holm"] <= 0.05 and d["hi"] < 0 for d in ds)
        out.append(
            f"{model}, {what}: {up} of {len(ds)} answer-span KL differences resolved above 0 and {down} below "
            f"(Holm within the {len(doc['direct'])} direct tests)"
        )
    return out


def count_report(doc: dict, model: str) -> str:
    """Every count-axis table of one model, as markdown."""
    out = ["Per count (count 1 not run):", "", count_table(doc, "counts"), ""]
    out += ["Per count and passage (cache = set at one count):", "", count_table(doc, "cells"), ""]
    out += ["By absolute offset (passage p at about p x tokens), counts pooled, resampled by set:", ""]
    out += [count_table(doc, "offsets"), ""]
    out += ["By relative position within the merge, counts pooled, resampled by set:", ""]
    out += [count_table(doc, "relative"), ""]
    out += ["Direct tests, offset against order (paired by set and question kind, resampled by set):", ""]
    out += [direct_table(doc), "", *("- " + line for line in verdict(doc, model))]
    return "\n".join(out)


# ---------------------------------------------------------------- the length axis (first design's cells)


def length_cell(rows: list[dict], where: dict, cluster: tuple[str, ...], seed: int = SEED) -> dict:
    """naive, rerotate, their paired difference and the ceiling for the rows matching ``where``."""
    out = {}
    for m in METRICS:
        arms, a, b, caches = _arms(rows, where, m, cluster, seed)
        out[m] = {**arms, "diff": paired_diff_ci(a, b, clusters=caches, seed=seed).as_dict()}
    out.update(_ceiling(rows, where, cluster, seed)[0])
    return out


def onset(cells: dict) -> object:
    """The smallest key from which naive - rerotate answer-span KL lies above 0 there and at every larger key; None if none."""
    found = None
    for key in sorted(cells, reverse=True):
        if cells[key]["span_kl"]["diff"]["lo"] > 0:
            found = key
        else:
            break
    return found


def summarise_length(rows: list[dict], seed: int = SEED) -> dict:
    doc: dict = {"axis": "length"}
    doc["cells"] = {
        n: length_cell(rows, {"fragment_tokens": n}, ("fragment_tokens", "set"), seed)
        for n in sorted({r["fragment_tokens"] for r in rows})
    }
    doc["onset"] = onset(doc["cells"])
    return doc


def _f(c: dict, fmt: str = ".3f") -> str:
    return fmt_ci(c, fmt)


def length_table(doc: dict) -> str:
    out = [
        "| tokens/fragment | n (caches) | naive span KL | rerotate span KL | naive - rerotate span KL | "
        "first-token KL diff | exact match naive | rerotate | ceiling |",
        "|" + "---|" * 9,
    ]
    for key, c in doc["cells"].items():
        s, k, e = c["span_kl"], c["kl"], c["em"]
        out.append(
            f"| {key} | {c['n']} ({c['caches']}) | {_f(s['naive'])} | {_f(s['rerotate'])} | {_f(s['diff'], '+.3f')} | "
            f"{_f(k['diff'], '+.3f')} | {_f(e['naive'], '.2f')} | {_f(e['rerotate'], '.2f')} | {_f(c['ceiling_em'], '.2f')} |"
        )
    keys = [str(k) for k in doc["cells"]]
    out += [
        "",
        "| | " + " | ".join(keys) + " |",
        "|" + "---|" * (len(keys) + 1),
        "| exact match, naive - rerotate | "
        + " | ".join(_f(c["em"]["diff"], "+.2f") for c in doc["cells"].values())
        + " |",
    ]
    return "\n".join(out)


def length_conclusion(doc: dict) -> list[str]:
    cells, on = doc["cells"], doc["onset"]
    what = f"{doc['model']}, naive - rerotate answer-span KL by tokens per fragment"
    if on is None:
        n = sum(c["n"] for c in cells.values())
        return [f"{what}: its interval does not stay above 0 from any value on ({n} question reads)"]
    c = cells[on]
    return [
        f"{what}: above 0 from {on} tokens per fragment on; there naive {_f(c['span_kl']['naive'])} against rerotate "
        f"{_f(c['span_kl']['rerotate'])} nats/token, paired difference {_f(c['span_kl']['diff'], '+.3f')} "
        f"over {c['n']} questions in {c['caches']} caches"
    ]


# ---------------------------------------------------------------- one point: run, record, print


def measure(
    model,
    axis: str,
    *,
    counts=COUNTS,
    lengths=LENGTHS,
    tokens=512,
    length_count=4,
    sets=8,
    seed=0,
    greedy_tokens=5,
    log=None,
) -> tuple[list[dict], dict]:
    """Run one axis; the rows and the summary document."""
    if axis == "count":
        if min(counts) < 2:
            raise kvlab.KvlabError("the count axis compares merges: counts start at 2 (one fragment is the prefill)")
        rows = count_rows(model, counts, tokens, sets=sets, seed=seed, greedy_tokens=greedy_tokens, log=log)
        doc = summarise_count(rows)
    elif axis == "length":
        rows = length_rows(model, lengths, length_count, sets=sets, seed=seed, greedy_tokens=greedy_tokens, log=log)
        doc = summarise_length(rows)
    else:
        raise kvlab.KvlabError(f"axis must be 'count' or 'length', got {axis!r}")
    args = dict(counts=list(counts), lengths=list(lengths), tokens=tokens, length_count=length_count, sets=sets)
    args.update(seed=seed, greedy_tokens=greedy_tokens)
    return rows, {"model": model.name, "args": args, **doc}


def report(doc: dict) -> str:
    """What a point prints: every table of its axis."""
    if doc["axis"] == "count":
        return count_report(doc, doc["model"])
    return length_table(doc) + "\n\n" + "\n".join(length_conclusion(doc))


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}_")
        elif v is not None:
            yield f"{prefix}{k}", v


def records(doc: dict) -> list[tuple[str, float, dict]]:
    """``(name, value, keywords)`` for :func:`kvlab.findings.records.record`: one per cell.

    Its value is the naive - rerotate answer-span KL (everything else in flat extras); on the
    length axis also the onset (NaN where there is none).
    """
    out = []
    if doc["axis"] == "count":
        for fam in ("counts", "cells", "offsets", "relative", "direct"):
            for key, c in doc[fam].items():
                d = c["span_kl"]["diff"]
                extra = dict(_flat({k: v for k, v in c.items() if k != "n"}), family=fam, key=key)
                out.append(
                    (f"{fam}_{key}", d["mean"], dict(unit="nats/token", ci=(d["lo"], d["hi"]), n=c["n"], **extra))
                )
        return out
    for key, c in doc["cells"].items():
        d = c["span_kl"]["diff"]
        extra = {"family": "cells", "key": key, "caches": c["caches"]}
        for m in METRICS:
            for w in ("naive", "rerotate", "diff"):
                extra.update({f"{m}_{w}": c[m][w]["mean"], f"{m}_{w}_lo": c[m][w]["lo"], f"{m}_{w}_hi": c[m][w]["hi"]})
        extra.update(ceiling_em=c["ceiling_em"]["mean"], ceiling_em_lo=c["ceiling_em"]["lo"])
        extra.update(ceiling_em_hi=c["ceiling_em"]["hi"])
        out.append((f"length_{key}", d["mean"], dict(unit="nats/token", ci=(d["lo"], d["hi"]), n=c["n"], **extra)))
    out.append(("onset", float("nan") if doc["onset"] is None else doc["onset"], {}))
    return out


def length_from_records(recs: list[dict], model: str) -> dict:
    """A length point's summary document (:func:`summarise_length`) rebuilt from its records."""
    doc: dict = {"model": model, "axis": "length", "cells": {}}
    for r in recs:
        x = r["extra"]
        if "family" not in x:
            v = r["value"]
            doc[r["name"]] = None if isinstance(v, str) or v != v else int(v)
            continue
        c = {"n": r["n"], "caches": x["caches"]}
        for m in METRICS:
            c[m] = {
                w: {"mean": x[f"{m}_{w}"], "lo": x[f"{m}_{w}_lo"], "hi": x[f"{m}_{w}_hi"]}
                for w in ("naive", "rerotate", "diff")
            }
        c["ceiling_em"] = {"mean": x["ceiling_em"], "lo": x["ceiling_em_lo"], "hi": x["ceiling_em_hi"]}
        doc["cells"][int(x["key"])] = c
    return doc


def _points(folder: Path):
    """``(point record, summary document)`` of every ok point: count points from their rows CSV, length from records."""
    for point in read_points(folder):
        pr = point["parameters"]
        if point["status"] != "ok":
            yield point, None
        elif pr["axis"] == "count":
            doc = summarise_count(read_rows(point_rows_path(folder, pr["model_name"])))
            yield point, {"model": pr["model_name"], **doc}
        else:
            yield point, length_from_records(point["records"], pr["model_name"])


def key_tables(docs: dict[str, dict]) -> str:
    """Both models side by side: naive - rerotate by (count, passage), by relative position, by offset, direct tests."""
    ms = list(docs)
    ks = sorted({int(k[1:]) for d in docs.values() for k in d["counts"]})
    ps = sorted({int(p[1:]) for d in docs.values() for p in d["offsets"]})
    out = ["naive - rerotate answer-span KL (Holm p) by count and passage (offset about p x tokens; cache = set):", ""]
    out.append("| passage | " + " | ".join(f"{m}, {k} fragments" for m in ms for k in ks) + " |")
    out.append("|" + "---|" * (1 + len(ms) * len(ks)))
    for p in ps:
        cs = [docs[m]["cells"].get(f"k{k}_p{p}") for m in ms for k in ks]
        out.append(f"| {p} | " + " | ".join(_d(c and c["span_kl"]["diff"], "+.3f") for c in cs) + " |")
    for fam, what in (("relative", "relative position"), ("offsets", "passage (absolute offset)")):
        out += ["", f"naive - rerotate by {what}, counts pooled, resampled by set (Holm p):", ""]
        out.append(
            f"| {what} | "
            + " | ".join(f"{m}: n (sets) | span KL | span KL, reference right | exact match" for m in ms)
            + " |"
        )
        out.append("|" + "---|" * (1 + 4 * len(ms)))
        for key in docs[ms[0]][fam]:
            cells = []
            for m in ms:
                c = docs[m][fam][key]
                cells += [f"{c['n']} ({c['caches']})", _d(c["span_kl"]["diff"], "+.3f")]
                cells += [_d(c["span_kl"]["right"], "+.3f"), _d(c["em"]["diff"], "+.2f")]
            out.append(f"| {key[1:] if fam == 'offsets' else key} | " + " | ".join(cells) + " |")
    out += ["", "Direct tests: (naive - rerotate at a) - (at b), paired by set and question kind (Holm p):", ""]
    out.append("| kind | a - b | " + " | ".join(f"{m}: pairs (sets) | span KL | exact match" for m in ms) + " |")
    out.append("|" + "---|" * (2 + 3 * len(ms)))
    for key, d0 in docs[ms[0]]["direct"].items():
        cells = []
        for m in ms:
            d = docs[m]["direct"][key]
            cells += [f"{d['n']} ({d['caches']})", _d(d["span_kl"]["diff"], "+.3f"), _d(d["em"]["diff"], "+.2f")]
        out.append(f"| {d0['kind']} | {d0['label']} | " + " | ".join(cells) + " |")
    out += ["", *("- " + line for m in ms for line in verdict(docs[m], m))]
    return "\n".join(out)


def sweep_table(folder: Path) -> str:
    """The markdown tables of a ``kvlab sweep studies/naive_dose.toml`` output folder.

    Count points: every interval recomputed from ``rows_<model>.csv`` (seed 0). Length points: their records.
    """
    out, counted = [], {}
    for point, doc in _points(Path(folder)):
        if doc is None:
            out += [f"### {point['point']}: {point['status']} ({point.get('error')})", ""]
            continue
        pr = point["parameters"]
        head = f"#### {doc['model']}, {doc['axis']} axis ({point['wall_s'] / 60:.1f} min"
        if doc["axis"] == "count":
            head += f", {pr['sets']} sets, counts {pr['counts']}, {pr['tokens']} tokens; rows_{doc['model']}.csv)"
            counted[doc["model"]] = doc
        else:
            head += f", {pr['sets']} sets; first design, from its records)"
        out += [head, "", report(doc), ""]
    if counted:
        out = [key_tables(counted), "", *out]
    return "\n".join(out)


# ---------------------------------------------------------------- figures


def _diff_panel(ax, doc: dict, x: str) -> None:
    """naive - rerotate answer-span KL per (count, passage) cell, one line per count, against offset or relative order."""
    ks = sorted({int(key[1:].split("_")[0]) for key in doc["cells"]})
    for k in ks:
        cs = [c for key, c in doc["cells"].items() if key.startswith(f"k{k}_")]
        xs = [c["offset_mean"] if x == "offset" else c["rel_pos"] for c in cs]
        ds = [c["span_kl"]["diff"] for c in cs]
        err = [[d["mean"] - d["lo"] for d in ds], [d["hi"] - d["mean"] for d in ds]]
        ax.errorbar(xs, [d["mean"] for d in ds], yerr=err, marker="o", capsize=3, label=f"{k} fragments")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("landing offset of the answer's passage (tokens)" if x == "offset" else "relative order p/(k-1)")
    ax.set_ylabel("naive - rerotate answer-span KL (nats/token)")
    n, caches = doc["counts"], sum(c["caches"] for c in doc["counts"].values())
    by = "absolute offset" if x == "offset" else "relative order"
    ax.set_title(
        f"{doc['model']}: by {by}\n({sum(c['n'] for c in n.values())} questions, {caches} caches, 95% CI)", fontsize=9
    )
    ax.legend(fontsize=8)


def _length_panel(ax, doc: dict) -> None:
    cells = doc["cells"]
    xs = [int(k) for k in cells]
    for w, colour in (("naive", "tab:red"), ("rerotate", "tab:blue")):
        cs = [c["span_kl"][w] for c in cells.values()]
        err = [[c["mean"] - c["lo"] for c in cs], [c["hi"] - c["mean"] for c in cs]]
        ax.errorbar(xs, [c["mean"] for c in cs], yerr=err, marker="o", capsize=3, color=colour, label=w)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per fragment (4 fragments)")
    ax.set_ylabel("answer-span KL vs joined prefill (nats/token)")
    caches = max(c["caches"] for c in cells.values())
    ax.set_title(f"{doc['model']}: naive vs rerotate by length\n({caches} caches, 95% CI; first design)", fontsize=9)
    ax.legend(fontsize=8)


def figure(doc: dict):
    """A point's figure: the count axis by offset and by relative order, or the length axis."""
    import matplotlib.pyplot as plt

    if doc["axis"] == "count":
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        _diff_panel(axes[0], doc, "offset")
        _diff_panel(axes[1], doc, "relative")
    else:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        _length_panel(ax, doc)
    fig.tight_layout()
    return fig


def sweep_figure(folder: Path, path: Path) -> Path:
    """One row per model (count by offset, count by relative order, length) from a sweep output folder, saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = {(d["model"], d["axis"]): d for _, d in _points(Path(folder)) if d is not None}
    models = list(dict.fromkeys(m for m, _ in docs))
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.2 * len(models)), squeeze=False)
    for row, m in zip(axes, models):
        for ax, panel in zip(row, ("offset", "relative", "length")):
            axis = "length" if panel == "length" else "count"
            if (m, axis) not in docs:
                ax.set_visible(False)
            elif axis == "length":
                _length_panel(ax, docs[m, axis])
            else:
                _diff_panel(ax, docs[m, axis], panel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--axis", choices=("count", "length"), default="count")
    ap.add_argument("--counts", type=int, nargs="+", default=list(COUNTS))
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--length-count", type=int, default=4)
    ap.add_argument("--sets", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/naive_dose", help="where the count axis writes rows_<model>.csv")
    ap.add_argument("--sweep-table", metavar="DIR", help="print the tables of a kvlab sweep output folder and stop")
    ap.add_argument("--figure", metavar="PNG", help="with --sweep-table: also draw every point's curves into PNG")
    args = ap.parse_args()
    if args.sweep_table:
        print(sweep_table(Path(args.sweep_table)))
        if args.figure:
            print(f"figure: {sweep_figure(Path(args.sweep_table), Path(args.figure))}")
        return
    model = kvlab.load_model(args.model)
    t0 = time.perf_counter()
    rows, doc = measure(
        model,
        args.axis,
        counts=args.counts,
        lengths=args.lengths,
        tokens=args.tokens,
        length_count=args.length_count,
        sets=args.sets,
        seed=args.seed,
        log=print,
    )
    if args.axis == "count":
        print(f"rows: {write_point_rows(rows, args.out, model.name)}")
    print(report(doc))
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
