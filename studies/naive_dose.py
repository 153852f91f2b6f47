"""Dose-response of a naive merge (issue 24, part 1): where does concatenating fragments at the
wrong rotary phase start changing answers, against the fragment count, the fragment length and
the landing offset of the passage that holds the answer?

Design, named before the run:

* **Count** (1-8 fragments of at most ``tokens`` tokens). Each of ``sets`` generated sets has 8
  passages, one person each. The k-fragment merge uses passages 0..k-1 of that same set, so the
  k case's fragments are the (k-1) case's plus one: count is not confounded with content. Each
  passage is prefilled once per set and its fragment reused at every count. At each count the
  questions are the one-passage ones (town, year) about passages 0 and 1 (the same questions at
  every count from 2 on) and, from 3 fragments on, about the last passage.
* **Length** (``lengths`` tokens per fragment at ``length_count`` fragments). A set's seed fixes
  its people and facts before any filler is drawn, so every length asks the same questions
  about the same facts; only the filler around them grows. Questions: passages 0, 1 and the last.
* **Offset**: the count rows grouped by where the passage holding the answer lands
  (``answer_offset``: 0, ``tokens``, 2 ``tokens``, ...), pooled over counts and resampled by set
  (the caches of one set share passages, so the set is the independent unit).

Every question is read behind ``naive``, ``rerotate`` and the joined prefill of the same tokens
(the reference: KL 0; its exact match is the full-context ceiling). The comparison is
``naive - rerotate``, paired over the same questions, 95% cluster bootstrap over caches: answer-
span KL (nats per token of the true answer, teacher-forced; the primary measure), first-token
KL and exact match against the truth. The finding per axis is the **onset**: the smallest value
from which the answer-span difference's interval lies above 0 there and at every larger value.

    .venv/bin/python studies/naive_dose.py --model smollm2-135m --axis count --sets 8
    .venv/bin/python studies/naive_dose.py --sweep-table results/naive_dose   # after kvlab sweep
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import kvlab
from kvlab.findings import longctx
from kvlab.findings.evalset import EvalSet
from kvlab.findings.qa import ask, passage_fragments, passage_texts
from kvlab.measure.stats import fmt_ci, mean_ci, paired_diff_ci, proportion_ci
from kvlab.sweep.point import read_points

COUNTS = (1, 2, 3, 4, 5, 6, 7, 8)
LENGTHS = (64, 128, 256, 512, 1024)
ONE_PASSAGE = ("town", "year")
METRICS = ("span_kl", "kl", "em")
N_BOOT = 2000


def strategies() -> dict:
    return {"naive": kvlab.Naive(), "rerotate": kvlab.Rerotate()}


def asked(s: EvalSet, k: int) -> EvalSet:
    """Passages 0..k-1 of ``s`` and the one-passage questions about passages 0, 1 and k-1 (k >= 3)."""
    keep = {0, 1} | ({k - 1} if k >= 3 else set())
    qs = [q for q in s.questions if q.kind in ONE_PASSAGE and q.passages[0] in keep and q.passages[0] < k]
    return EvalSet(s.passages[:k], qs, s.seed, s.facts)


def _read(model, s: EvalSet, frags, probes, greedy_tokens: int, **tags) -> list[dict]:
    rows = ask(model, s, strategies(), greedy_tokens=greedy_tokens, fragments=frags, probes=probes)
    total = sum(f.length for f in frags)
    for r in rows:
        r.update(tags, n_fragments=len(frags), total_tokens=total)
    return rows


def count_rows(model, counts=COUNTS, tokens=512, *, sets=8, seed=0, greedy_tokens=5, log=None) -> list[dict]:
    """The count axis: one row per (set, count, question, strategy), nested by set."""
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
            rows += _read(model, s, frags[:k], probes, greedy_tokens, axis="count", set=j, fragment_tokens=tokens)
        if log:
            log(f"{model.name}: count set {j + 1}/{sets}: {time.perf_counter() - t0:.0f} s")
    return rows


def length_rows(model, lengths=LENGTHS, count=4, *, sets=8, seed=0, greedy_tokens=5, log=None) -> list[dict]:
    """The length axis: one row per (set, length, question, strategy); a set's facts are the same at every length."""
    rows = []
    for j in range(sets):
        t0 = time.perf_counter()
        for n in lengths:
            s = asked(longctx.make_set(model, count, n, seed=seed + 1000 * j + 500, people_per_passage=1), count)
            frags, probes = passage_fragments(model, s)
            rows += _read(model, s, frags, probes, greedy_tokens, axis="length", set=j, fragment_tokens=n)
        if log:
            log(f"{model.name}: length set {j + 1}/{sets}: {time.perf_counter() - t0:.0f} s")
    return rows


def cell(rows: list[dict], where: dict, cluster: tuple[str, ...], seed: int = 0) -> dict:
    """naive, rerotate, their paired difference and the ceiling for the rows matching ``where``."""
    out = {}
    for m in METRICS:
        a, b, caches = longctx.pairs(rows, "naive", "rerotate", m, where, cluster)
        ci = proportion_ci if m == "em" else mean_ci
        out[m] = {
            "naive": ci(a, clusters=caches, seed=seed).as_dict(),
            "rerotate": ci(b, clusters=caches, seed=seed).as_dict(),
            "diff": paired_diff_ci(a, b, clusters=caches, seed=seed).as_dict(),
        }
    # The joined prefill's exact match rides on every row; naive's rows carry it once per question.
    sel = [r for r in rows if r["strategy"] == "naive" and all(r[k] == v for k, v in where.items())]
    ref, caches = [bool(r["ref_em"]) for r in sel], [tuple(r[c] for c in cluster) for r in sel]
    out["ceiling_em"] = proportion_ci(ref, clusters=caches, seed=seed).as_dict()
    out["n"], out["caches"] = len(ref), len(set(caches))
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


def summarise(rows: list[dict], axis: str, seed: int = 0) -> dict:
    """Cells per axis value (and, for the count axis, per landing offset) and the onsets."""
    doc: dict = {"axis": axis}
    if axis == "count":
        doc["cells"] = {
            k: cell(rows, {"n_fragments": k}, ("n_fragments", "set"), seed)
            for k in sorted({r["n_fragments"] for r in rows})
        }
        fixed = [r for r in rows if r["answer_passage"] in (0, 1) and r["n_fragments"] >= 2]
        doc["fixed_questions"] = {
            k: cell(fixed, {"n_fragments": k}, ("n_fragments", "set"), seed)
            for k in sorted({r["n_fragments"] for r in fixed})
        }
        # By the passage holding the answer: its landing offset differs a little between sets.
        doc["offsets"] = {}
        for p in sorted({r["answer_passage"] for r in rows}):
            c = cell(rows, {"answer_passage": p}, ("set",), seed)
            at = [r["answer_offset"] for r in rows if r["answer_passage"] == p]
            c.update(offset_min=min(at), offset_max=max(at))
            doc["offsets"][p] = c
        doc["onset_offset"] = onset(doc["offsets"])
    else:
        doc["cells"] = {
            n: cell(rows, {"fragment_tokens": n}, ("fragment_tokens", "set"), seed)
            for n in sorted({r["fragment_tokens"] for r in rows})
        }
    doc["onset"] = onset(doc["cells"])
    return doc


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
        rows = count_rows(model, counts, tokens, sets=sets, seed=seed, greedy_tokens=greedy_tokens, log=log)
    elif axis == "length":
        rows = length_rows(model, lengths, length_count, sets=sets, seed=seed, greedy_tokens=greedy_tokens, log=log)
    else:
        raise kvlab.KvlabError(f"axis must be 'count' or 'length', got {axis!r}")
    args = dict(counts=list(counts), lengths=list(lengths), tokens=tokens, length_count=length_count, sets=sets)
    args.update(seed=seed, greedy_tokens=greedy_tokens)
    return rows, {"model": model.name, "args": args, **summarise(rows, axis, seed)}


def _f(c: dict, fmt: str = ".3f") -> str:
    return fmt_ci(c, fmt)


def table(doc: dict, which: str = "cells") -> str:
    """A markdown table of one family of cells (``cells``, ``fixed_questions`` or ``offsets``)."""
    head = {
        "cells": "fragments" if doc["axis"] == "count" else "tokens/fragment",
        "fixed_questions": "fragments",
        "offsets": "answer passage (landing offset, tokens)",
    }[which]
    out = [
        f"| {head} | n (caches) | naive span KL | rerotate span KL | naive - rerotate span KL | "
        "first-token KL diff | exact match naive | rerotate | ceiling |",
        "|" + "---|" * 9,
    ]
    for key, c in doc[which].items():
        s, k, e = c["span_kl"], c["kl"], c["em"]
        if which == "offsets":
            key = f"passage {key} ({c['offset_min']}-{c['offset_max']})"
        out.append(
            f"| {key} | {c['n']} ({c['caches']}) | {_f(s['naive'])} | {_f(s['rerotate'])} | {_f(s['diff'], '+.3f')} | "
            f"{_f(k['diff'], '+.3f')} | {_f(e['naive'], '.2f')} | {_f(e['rerotate'], '.2f')} | {_f(c['ceiling_em'], '.2f')} |"
        )
    return "\n".join(out)


def em_table(doc: dict, which: str = "cells") -> str:
    """The paired exact-match difference (naive - rerotate) of one family of cells, one column per key."""
    cells = doc[which]
    keys = [f"p{k}" if which == "offsets" else str(k) for k in cells]
    return "\n".join(
        [
            "| | " + " | ".join(keys) + " |",
            "|" + "---|" * (len(keys) + 1),
            "| exact match, naive - rerotate | "
            + " | ".join(_f(c["em"]["diff"], "+.2f") for c in cells.values())
            + " |",
        ]
    )


def conclusion(doc: dict) -> list[str]:
    """Sentences from a summary document: the onset per family, with its interval."""
    unit = {"count": "fragments", "length": "tokens per fragment"}[doc["axis"]]
    fams = [("cells", "onset")] + ([("offsets", "onset_offset")] if doc["axis"] == "count" else [])
    out = []
    for which, name in fams:
        cells, on = doc[which], doc[name]
        what = f"{doc['model']}, naive - rerotate answer-span KL by {'answer passage' if which == 'offsets' else unit}"
        if on is None:
            n = sum(c["n"] for c in cells.values())
            out.append(f"{what}: its interval does not stay above 0 from any value on ({n} question reads)")
            continue
        c = cells[on]
        at = (
            f"passage {on} (landing at {c['offset_min']}-{c['offset_max']} tokens)"
            if which == "offsets"
            else f"{on} {unit}"
        )
        out.append(
            f"{what}: above 0 from {at} on; there naive {_f(c['span_kl']['naive'])} against rerotate "
            f"{_f(c['span_kl']['rerotate'])} nats/token, paired difference {_f(c['span_kl']['diff'], '+.3f')} "
            f"over {c['n']} questions in {c['caches']} caches"
        )
    return out


LABELS = {
    "count": "fragments merged (512 tokens each, at most)",
    "length": "tokens per fragment (4 fragments)",
    "offsets": "landing offset of the answer's passage (tokens)",
}


def _panel(ax, doc: dict, which: str) -> None:
    """naive and rerotate answer-span KL with intervals against one family's keys (offsets: in tokens)."""
    cells = doc[which]
    if which == "offsets":
        xs = [(c["offset_min"] + c["offset_max"]) / 2 for c in cells.values()]
        label = LABELS["offsets"]
    else:
        xs, label = [int(k) for k in cells], LABELS[doc["axis"]]
    for w, colour in (("naive", "tab:red"), ("rerotate", "tab:blue")):
        cs = [c["span_kl"][w] for c in cells.values()]
        mid = [c["mean"] for c in cs]
        err = [[m - c["lo"] for m, c in zip(mid, cs)], [c["hi"] - m for m, c in zip(mid, cs)]]
        ax.errorbar(xs, mid, yerr=err, marker="o", capsize=3, color=colour, label=w)
    if doc["axis"] == "length" and which == "cells":
        ax.set_xscale("log", base=2)
    ax.set_xlabel(label)
    ax.set_ylabel("answer-span KL vs joined prefill (nats/token)")
    n, caches = sum(c["n"] for c in cells.values()), max(c["caches"] for c in cells.values())
    by = "answer's landing offset" if which == "offsets" else doc["axis"]
    ax.set_title(
        f"{doc['model']}: naive vs rerotate by {by}\n({n} question reads, {caches} caches, 95% CI)", fontsize=9
    )
    ax.legend()


def figure(doc: dict):
    """Answer-span KL of naive and rerotate against the axis (and, on the count axis, the landing offset), with intervals."""
    import matplotlib.pyplot as plt

    fams = ["cells"] + (["offsets"] if doc["axis"] == "count" else [])
    fig, axes = plt.subplots(1, len(fams), figsize=(5.5 * len(fams), 3.8), squeeze=False)
    for ax, which in zip(axes[0], fams):
        _panel(ax, doc, which)
    fig.tight_layout()
    return fig


def sweep_figure(folder: Path, path: Path) -> Path:
    """One row per model (count, landing offset, length) from a sweep output folder's records, saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = {}
    for point in read_points(folder):
        if point["status"] == "ok":
            pr = point["parameters"]
            docs[pr["model_name"], pr["axis"]] = from_records(point["records"], pr["model_name"], pr["axis"])
    models = list(dict.fromkeys(m for m, _ in docs))
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.2 * len(models)), squeeze=False)
    for row, m in zip(axes, models):
        for ax, (axis, which) in zip(row, (("count", "cells"), ("count", "offsets"), ("length", "cells"))):
            if (m, axis) in docs:
                _panel(ax, docs[m, axis], which)
            else:
                ax.set_visible(False)
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
    _, doc = measure(
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
    print(table(doc))
    if args.axis == "count":
        print(table(doc, "offsets"))
    print("\n".join(conclusion(doc)))
    print(f"{time.perf_counter() - t0:.0f} s")


FAMILIES = {"cells": None, "fixed_questions": "fixed", "offsets": "offset"}


def records(doc: dict) -> list[tuple[str, float, dict]]:
    """``(name, value, keywords)`` for :func:`kvlab.record`: one per cell (its naive - rerotate answer-span KL,
    everything else in flat extras) and one per onset (NaN where there is none)."""
    out = []
    for which, prefix in FAMILIES.items():
        for key, c in doc.get(which, {}).items():
            d = c["span_kl"]["diff"]
            extra = {"family": which, "key": key, "caches": c["caches"]}
            extra.update({k: c[k] for k in ("offset_min", "offset_max") if k in c})
            for m in METRICS:
                for w in ("naive", "rerotate", "diff"):
                    extra.update(
                        {f"{m}_{w}": c[m][w]["mean"], f"{m}_{w}_lo": c[m][w]["lo"], f"{m}_{w}_hi": c[m][w]["hi"]}
                    )
            extra.update(
                ceiling_em=c["ceiling_em"]["mean"],
                ceiling_em_lo=c["ceiling_em"]["lo"],
                ceiling_em_hi=c["ceiling_em"]["hi"],
            )
            out.append(
                (
                    f"{prefix or doc['axis']}_{key}",
                    d["mean"],
                    dict(unit="nats/token", ci=(d["lo"], d["hi"]), n=c["n"], **extra),
                )
            )
    for name in ("onset", "onset_offset"):
        if name in doc:
            out.append((name, float("nan") if doc[name] is None else doc[name], {}))
    return out


def from_records(recs: list[dict], model: str, axis: str) -> dict:
    """The summary document (:func:`summarise`'s cells and onsets) rebuilt from a point's records."""
    doc: dict = {"model": model, "axis": axis}
    for r in recs:
        x = r["extra"]
        if "family" not in x:
            v = r["value"]
            doc[r["name"]] = None if isinstance(v, str) or v != v else int(v)
            continue
        c = {"n": r["n"], "caches": x["caches"], **{k: x[k] for k in ("offset_min", "offset_max") if k in x}}
        for m in METRICS:
            c[m] = {
                w: {"mean": x[f"{m}_{w}"], "lo": x[f"{m}_{w}_lo"], "hi": x[f"{m}_{w}_hi"]}
                for w in ("naive", "rerotate", "diff")
            }
        c["ceiling_em"] = {"mean": x["ceiling_em"], "lo": x["ceiling_em_lo"], "hi": x["ceiling_em_hi"]}
        doc.setdefault(x["family"], {})[int(x["key"])] = c
    return doc


def sweep_table(folder: Path) -> str:
    """The markdown tables of a ``kvlab sweep studies/naive_dose.toml`` output folder (its points' records)."""
    out = []
    for point in read_points(folder):
        if point["status"] != "ok":
            out += [f"### {point['point']}: {point['status']} ({point.get('error')})", ""]
            continue
        pr = point["parameters"]
        doc = from_records(point["records"], pr["model_name"], pr["axis"])
        out += [f"### {doc['model']}, {doc['axis']} axis ({point['wall_s'] / 60:.1f} min)", "", table(doc)]
        out += ["", em_table(doc)]
        if doc["axis"] == "count":
            out += ["", "Same questions at every count (passages 0 and 1):", "", table(doc, "fixed_questions")]
            out += ["", "By landing offset of the answer's passage (pooled over counts, resampled by set):", ""]
            out.append(table(doc, "offsets"))
            out += ["", em_table(doc, "offsets")]
        out += ["", *("- " + line for line in conclusion(doc)), ""]
    return "\n".join(out)


if __name__ == "__main__":
    main()
