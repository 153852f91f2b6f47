"""The fine-tune dose-response (issue 24, part 4): how far does a same-shape fine-tune move a reader
forced through the producer's cache, as the fine-tune grows, and is it refused at every step?

The foreign-reader study of notebook 03 (:mod:`kvlab.findings.readers`: independent producer
caches, one generated set of 2 passages per cache, every question read behind the reader's own
prefill and behind the producer's file forced through with ``strict=False``) with one reader per
fine-tune step count, 0, 1, 2, 4, 8 and 16 AdamW steps. The readers are nested: they are the
snapshots of one training run (:func:`kvlab.measure.mismatch.finetune_snapshots`: one seed, the
same batches), so the steps are not confounded with data order; the snapshot at ``check_step``
is compared, weight for weight and in its fingerprint, with an independent
``kvlab.variants(model, "finetune", steps=check_step)``. Step 0 is the producer itself: it must
load silently and read its own cache with KL exactly 0 (both asserted).

Per step: refused or not (and the differing fields), first-token KL, answer-span KL (nats per
token, teacher forced), the true answer's NLL change, and the top-1 flip rate of the first
token, each with its n questions, n caches and a 95% cluster-bootstrap interval over caches.

Named before the run: the answer-span KL at step k minus at step 0 (step 0 is exactly 0, so
this is the step-k value itself) and between adjacent steps (k minus the previous step), paired
over the same questions and resampled by cache (``kvlab.paired_diff_ci``, 95%). The dose-response
is called monotone where every adjacent difference is positive, and resolved where its interval
excludes 0.

    .venv/bin/python studies/finetune_dose.py --model smollm2-135m --caches 4   # one model, printed
    .venv/bin/python studies/finetune_dose.py --sweep-table results/finetune_dose   # after kvlab sweep
    .venv/bin/python studies/finetune_dose.py --sweep-table results/finetune_dose --figure results/finetune_dose/kl_by_steps.png
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

import kvlab
from kvlab.findings import readers as study
from kvlab.findings import rows as committed
from kvlab.findings.rows import point_rows_path
from kvlab.measure.mismatch import finetune_snapshots
from kvlab.measure.stats import fmt_ci
from kvlab.sweep.point import read_points

STEPS = (0, 1, 2, 4, 8, 16)
#: metric -> (label, unit, format) for the tables and the figure.
METRICS = {
    "kl": ("first-token KL", "nats", ".4f"),
    "span_kl": ("answer-span KL", "nats/token", ".4f"),
    "dnll": ("answer NLL change", "nats", "+.3f"),
    "flip": ("top-1 flips", "", ".3f"),
}


def reader_name(k: int) -> str:
    return f"step{k}"


def same_weights(a: kvlab.LoadedModel, b: kvlab.LoadedModel) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)


def measure(
    model: kvlab.LoadedModel,
    *,
    steps=STEPS,
    n_caches: int = 16,
    n_passages: int = 2,
    passage_tokens: int = 120,
    people_per_passage: int = 1,
    max_questions: int | None = None,
    check_step: int | None = 2,
    seed: int = 0,
    log=None,
) -> dict:
    """Every snapshot reads every question of every producer cache: ``(rows, summary document)`` (no wall time).

    ``rows``: one per (reader, cache, question), as :func:`kvlab.findings.rows.write_point_rows` commits them.

    ``check_step`` (one of ``steps``, or ``None``): the snapshot compared with an independent
    fine-tune of that many steps. The fine-tune takes :data:`kvlab.measure.mismatch.FINETUNE_DEFAULTS`
    (its seed is the fine-tune's own, 0, whatever ``seed`` is; ``seed`` picks the caches and the
    bootstrap).
    """
    steps = sorted(set(steps))
    say = log or (lambda m: None)
    with tempfile.TemporaryDirectory(prefix="kvlab-dose-") as d:
        caches, exact = study.producer_caches(
            model,
            Path(d),
            n_caches,
            n_passages=n_passages,
            passage_tokens=passage_tokens,
            people_per_passage=people_per_passage,
            max_questions=max_questions,
            seed=seed,
        )
        say(f"{len(caches)} producer caches of {min(c.tokens for c in caches)}-{max(c.tokens for c in caches)} tokens")
        rows, refusal, nested = [], {}, None
        for k, reader in finetune_snapshots(model, steps):
            t0 = time.perf_counter()
            try:
                kvlab.load_cache(caches[0].path, reader)
                refusal[k] = None
            except kvlab.FingerprintMismatch as e:
                refusal[k] = [x.field for x in e.differences]
            if k == check_step and k > 0:
                alone = kvlab.variants(model, "finetune", steps=k)
                nested = {
                    "step": k,
                    "same_weights": same_weights(reader, alone),
                    "same_fingerprint": kvlab.fingerprint(reader) == kvlab.fingerprint(alone),
                }
                del alone
            rows += study.forced_reads({reader_name(k): reader}, caches)
            say(f"step {k}: refused on {refusal[k]}, read in {time.perf_counter() - t0:.0f} s")
            del reader
    rows = study.row_dicts(rows)
    per_step = step_entries(rows, steps, refusal, seed=seed)
    args = dict(steps=steps, n_caches=n_caches, n_passages=n_passages, passage_tokens=passage_tokens, seed=seed)
    args.update(people_per_passage=people_per_passage, max_questions=max_questions, check_step=check_step)
    return rows, {
        "model": model.name,
        "args": args,
        "caches_reload_exact": exact,
        "cache_tokens": [c.tokens for c in caches],
        "nested_check": nested,
        "steps": per_step,
    }


def step_entries(rows: list[dict], steps, refusal: dict, *, seed: int = 0) -> dict[str, dict]:
    """Per step: the four metrics' intervals, flips, refusal, and the paired differences the docstring names.

    ``rows``: one per (reader, cache, question) (:func:`kvlab.findings.readers.row_dicts`, or the
    committed CSV read back); ``refusal``: step -> the differing fields, or ``None`` where it loaded.
    """
    ci = study.summarize(rows, seed=seed)
    per_step = {}
    for i, k in enumerate(steps):
        name = reader_name(k)
        entry = {m: ci[name, m].as_dict() for m in METRICS}
        entry["flips"] = sum(r["flip"] for r in rows if r["reader"] == name)
        entry["refused"] = refusal[k] is not None
        entry["fields"] = refusal[k] or []
        entry["finite"] = all(
            math.isfinite(r[m]) for r in rows if r["reader"] == name for m in ("kl", "span_kl", "dnll")
        )
        entry["exact_zero"] = all(
            r["kl"] == 0 and r["span_kl"] == 0 and r["dnll"] == 0 and not r["flip"] for r in rows if r["reader"] == name
        )
        if i > 0:
            entry["span_kl_minus_step0"] = study.paired(rows, name, reader_name(steps[0]), seed=seed).as_dict()
            entry["span_kl_minus_previous"] = study.paired(rows, name, reader_name(steps[i - 1]), seed=seed).as_dict()
            entry["kl_minus_previous"] = study.paired(rows, name, reader_name(steps[i - 1]), "kl", seed=seed).as_dict()
        per_step[str(k)] = entry
    return per_step


def _f(c: dict, fmt: str) -> str:
    return fmt_ci(c, fmt)


def table(doc: dict) -> str:
    """One row per step: refusal, the four metrics with their intervals, and the adjacent span-KL difference."""
    steps = doc["args"]["steps"]
    first = doc["steps"][str(steps[0])]
    out = [
        f"{doc['model']}: {first['kl']['n']} questions over {first['kl']['caches']} caches per step; "
        "means with 95% cluster-bootstrap intervals over caches",
        "",
        "| steps | refused (differing fields) | first-token KL, nats | answer-span KL, nats/token | "
        "answer NLL change, nats | top-1 flips | span KL minus previous step (paired) |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in steps:
        e = doc["steps"][str(k)]
        refused = f"yes ({', '.join(e['fields'])})" if e["refused"] else "**no**"
        prev = _f(e["span_kl_minus_previous"], "+.4f") if "span_kl_minus_previous" in e else ""
        out.append(
            f"| {k} | {refused} | {_f(e['kl'], '.4f')} | {_f(e['span_kl'], '.4f')} | {_f(e['dnll'], '+.3f')} | "
            f"{e['flips']}/{e['flip']['n']} [{e['flip']['lo']:.2f}, {e['flip']['hi']:.2f}] | {prev} |"
        )
    return "\n".join(out)


def conclusions(doc: dict) -> list[str]:
    """The study's conclusions for one model, built from its numbers."""
    steps = doc["args"]["steps"]
    on = [k for k in steps if k > 0]
    e0, last = doc["steps"][str(steps[0])], doc["steps"][str(steps[-1])]
    out = []
    refused = [k for k in on if doc["steps"][str(k)]["refused"]]
    fields = sorted({f for k in on for f in doc["steps"][str(k)]["fields"]})
    out.append(
        f"On {doc['model']}, {e0['kl']['n']} questions over {e0['kl']['caches']} caches per step: step 0 (the producer) "
        + ("loads silently" if not e0["refused"] else "is REFUSED")
        + (" and reads with KL exactly 0" if e0["exact_zero"] else " but its KL is NOT exactly 0")
        + f"; {len(refused)} of {len(on)} fine-tuned steps are refused"
        + (f" (differing fields: {', '.join(fields)})" if fields else "")
        + "."
    )
    s = last["span_kl"]
    out.append(
        f"At {steps[-1]} steps the answer-span KL is {_f(s, '.4f')} nats/token and the first-token KL "
        f"{_f(last['kl'], '.4f')} nats; the answer NLL changes by {_f(last['dnll'], '+.3f')} nats ("
        + ("resolved" if last["dnll"]["lo"] > 0 or last["dnll"]["hi"] < 0 else "not resolved")
        + f"), top-1 flips {last['flips']}/{last['flip']['n']}."
    )
    diffs = {k: doc["steps"][str(k)]["span_kl_minus_previous"] for k in steps[1:]}
    up = [k for k, d in diffs.items() if d["mean"] > 0]
    resolved = [k for k, d in diffs.items() if d["lo"] > 0]
    down = [k for k, d in diffs.items() if d["hi"] < 0]
    out.append(
        f"Answer-span KL between adjacent steps (paired, {steps[0]}->{steps[1]} to {steps[-2]}->{steps[-1]}): "
        f"rises at {len(up)} of {len(diffs)} steps "
        f"({'monotone' if len(up) == len(diffs) else 'not monotone'}); resolved increases at steps "
        f"{', '.join(map(str, resolved)) or 'none'}"
        + (f"; resolved decreases at steps {', '.join(map(str, down))}" if down else "")
        + "."
    )
    ratio = [
        doc["steps"][str(b)]["span_kl"]["mean"] / doc["steps"][str(a)]["span_kl"]["mean"] for a, b in zip(on, on[1:])
    ]
    out.append(
        "Mean answer-span KL, ratio to the previous step: "
        + ", ".join(f"{a}->{b} x{r:.1f}" for (a, b), r in zip(zip(on, on[1:]), ratio))
        + "."
    )
    n = doc["nested_check"]
    if n:
        out.append(
            f"The nested snapshot at step {n['step']} is "
            + ("bit for bit" if n["same_weights"] else "NOT")
            + f" an independent {n['step']}-step fine-tune"
            + (" with the same fingerprint." if n["same_fingerprint"] else " (fingerprints differ).")
        )
    return out


def figure(docs: list[dict], title: str | None = None):
    """Answer-span and first-token KL against fine-tune steps (symlog x), one line per model, with intervals."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for ax, metric in zip(axes, ("span_kl", "kl")):
        label, unit, _ = METRICS[metric]
        for j, doc in enumerate(docs):
            steps = doc["args"]["steps"]
            m = [doc["steps"][str(k)][metric]["mean"] for k in steps]
            lo = [doc["steps"][str(k)][metric]["lo"] for k in steps]
            hi = [doc["steps"][str(k)][metric]["hi"] for k in steps]
            yerr = [[a - b for a, b in zip(m, lo)], [b - a for a, b in zip(m, hi)]]
            first = doc["steps"][str(steps[0])][metric]
            ax.errorbar(
                steps, m, yerr=yerr, marker="o", capsize=3, color=f"C{j}",
                label=f"{doc['model']} ({first['n']} questions, {first['caches']} caches)",
            )  # fmt: skip
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xticks(docs[0]["args"]["steps"], [str(k) for k in docs[0]["args"]["steps"]])
        ax.set_xlabel("fine-tune steps (AdamW, nested snapshots of one run; symlog)")
        ax.set_ylabel(f"{label}, {unit} (mean, 95% CI over caches)")
        ax.set_title(f"{label} of a forced-through producer cache")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "Fine-tune dose-response: the reader at each step against the producer's cache")
    return fig


def _doc_from_point(point: dict, folder: Path) -> dict:
    """A :func:`measure`-shaped document rebuilt from one sweep point.

    Refusals and the nested check come from the point's records. Where the point committed its
    rows (``rows_<model>.csv`` in ``folder``), every interval is recomputed from them (the same
    function and seed as the run); otherwise (a run before the rows were kept) it is read from the
    records.
    """
    recs = {r["name"]: r for r in point["records"]}
    par = point["parameters"]
    steps = par["steps"]
    doc = {"model": par["model_name"], "args": {"steps": steps}, "steps": {}, "nested_check": None}

    def c(r: dict) -> dict:
        return {"mean": r["value"], "lo": r["ci_low"], "hi": r["ci_high"], "n": r["n"], "caches": r["extra"]["caches"]}

    for i, k in enumerate(steps):
        e = {m: c(recs[f"{m}_step{k}"]) for m in METRICS}
        e["flips"] = recs[f"flip_step{k}"]["extra"]["flips"]
        ref = recs[f"refused_step{k}"]
        e["refused"], e["fields"] = bool(ref["value"]), ref["extra"]["fields"]
        e["exact_zero"] = recs[f"span_kl_step{k}"]["extra"]["exact_zero"]
        if i > 0:
            e["span_kl_minus_previous"] = c(recs[f"span_kl_step{k}_minus_step{steps[i - 1]}"])
        doc["steps"][str(k)] = e
    rows = point_rows_path(folder, par["model_name"])
    if rows.exists():
        refusal = {k: doc["steps"][str(k)]["fields"] if doc["steps"][str(k)]["refused"] else None for k in steps}
        doc["steps"] = step_entries(
            committed.read_rows(rows, text=("reader", "kind")), steps, refusal, seed=par.get("seed", 0)
        )
        doc["rows"] = rows.name
    if "nested_check" in recs:
        r = recs["nested_check"]
        doc["nested_check"] = {
            "step": r["extra"]["step"],
            "same_weights": bool(r["value"]),
            "same_fingerprint": r["extra"]["same_fingerprint"],
        }
    return doc


def sweep_table(folder: Path, figure_path: Path | None = None) -> str:
    """The markdown tables and conclusions of a ``kvlab sweep studies/finetune_dose.toml`` output folder."""
    points = read_points(folder)
    ok = [p for p in points if p["status"] == "ok"]
    order = {"smollm2-135m": 0, "gemma3-270m": 1}
    ok.sort(key=lambda p: order.get(p["parameters"]["model_name"], 9))
    docs = [_doc_from_point(p, folder) for p in ok]
    out = []
    for p, doc in zip(ok, docs):
        out += [
            table(doc),
            "",
            *("- " + line for line in conclusions(doc)),
            f"- point wall time {p['wall_s'] / 60:.1f} min"
            + (f"; every interval recomputed from {doc['rows']}" if "rows" in doc else "; intervals from its records"),
            "",
        ]
    failed = [p["point"] for p in points if p["status"] != "ok"]
    if failed:
        out.append(f"FAILED points: {', '.join(failed)}")
    if figure_path is not None and docs:
        fig = figure(docs)
        fig.savefig(figure_path, dpi=110)
        out.append(f"figure -> {figure_path}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, nargs="+", default=list(STEPS))
    ap.add_argument("--caches", type=int, default=16, help="independent producer caches (generated sets)")
    ap.add_argument("--passage-tokens", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep-table", metavar="DIR", help="print the tables of a kvlab sweep output folder and stop")
    ap.add_argument("--figure", metavar="PNG", help="with --sweep-table: also write the KL-by-steps figure there")
    args = ap.parse_args()
    if args.sweep_table:
        print(sweep_table(Path(args.sweep_table), Path(args.figure) if args.figure else None))
        return
    t0 = time.perf_counter()
    _, doc = measure(
        kvlab.load_model(args.model),
        steps=args.steps,
        n_caches=args.caches,
        passage_tokens=args.passage_tokens,
        seed=args.seed,
        log=lambda m: print(m, flush=True),
    )
    print(table(doc))
    print("\n".join("- " + line for line in conclusions(doc)))
    print(f"done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
