"""The foreign-reader study (notebook 03): many independent producer caches, each read by every same-shape reader.

Each cache is one generated set (:func:`kvlab.findings.longctx.make_set`, one seed per cache)
read through the chat template and saved by the producer as a cache file. Every reader
(:func:`kvlab.variants`) reads every question of every file twice, behind its own prefill and
behind the producer's file forced through with ``strict=False``
(:func:`kvlab.mismatch_kl` with the true answers). A question's scores are one row; the cache
is the unit that varies, so every interval resamples caches, each with all its questions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlab.cache.fragments import prefill, tokenize
from kvlab.files.io import load_cache, save_cache
from kvlab.findings.evalset import Question
from kvlab.findings.longctx import make_set
from kvlab.findings.qa import passage_texts
from kvlab.findings.rows import read_rows
from kvlab.measure.mismatch import mismatch_kl
from kvlab.measure.stats import CI, fmt_ci, mean_ci, paired_diff_ci, proportion_ci
from kvlab.models.loaded import LoadedModel

#: Per-question scores: first-token KL, answer-span KL per token, answer NLL change, top-1 flip.
METRICS = ("kl", "span_kl", "dnll", "flip")


@dataclass(frozen=True)
class ProducerCache:
    """One producer cache file and what it was made from."""

    path: Path
    text: str
    bos: bool
    tokens: int
    probes: list[str]
    questions: list[Question]


def producer_caches(
    model: LoadedModel,
    folder: Path,
    n_caches: int,
    *,
    n_passages: int,
    passage_tokens: int,
    people_per_passage: int,
    max_questions: int | None = None,
    seed: int = 0,
) -> tuple[list[ProducerCache], bool]:
    """``n_caches`` producer files (generated sets ``seed .. seed + n_caches - 1``), and whether each reloads bit-exact.

    Each file holds keys/values ``[1, kv_heads, tokens, head_dim]`` per layer of one set's
    passages, joined as one text.
    """
    caches, exact = [], True
    for i in range(n_caches):
        s = make_set(model, n_passages, passage_tokens, seed + i, people_per_passage, max_questions)
        texts, probes, bos = passage_texts(model, s)
        fragment = prefill(model, "".join(texts), bos=bos)
        path = save_cache(Path(folder) / f"producer-{i}.kvcache", fragment, model)
        same = load_cache(path, model)  # the producer itself: a silent load, bit for bit
        exact &= all(
            torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            for a, b in zip(same.cache.layers, fragment.cache.layers)
        )
        caches.append(ProducerCache(path, "".join(texts), bos, fragment.length, probes, s.questions))
    return caches, exact


def forced_reads(readers: dict[str, LoadedModel], caches: list[ProducerCache]) -> list[dict]:
    """One row per (reader, cache, question): ``reader``, ``cache``, ``kind`` and :data:`METRICS`.

    ``dnll`` is the true answer's negative log-likelihood behind the foreign cache minus behind
    the reader's own (nats; positive: the truth became less likely).
    """
    rows = []
    for kind, reader in readers.items():
        for i, c in enumerate(caches):
            res = mismatch_kl(c.path, reader, c.probes, answers=[q.answer for q in c.questions])
            for q, r in zip(c.questions, res.rows, strict=True):
                rows.append(
                    {
                        "reader": kind,
                        "cache": i,
                        "kind": q.kind,
                        "kl": r.kl,
                        "span_kl": r.span_kl,
                        "dnll": r.nll - r.nll_own,
                        "flip": r.flipped,
                    }
                )
    return rows


def unreadable(readers: dict[str, LoadedModel], rows: list[dict], cache: ProducerCache) -> dict[str, bool]:
    """The readers with a non-finite score, each mapped to whether its *own* prefill of ``cache`` is finite.

    Gemma 3's activations exceed the fp16 range (65504): a Gemma 3 cast to fp16 cannot even
    read its own cache, and its KL is undefined rather than large.
    """
    out = {}
    for kind, reader in readers.items():
        if all(math.isfinite(r["kl"]) and math.isfinite(r["span_kl"]) for r in rows if r["reader"] == kind):
            continue
        own = prefill(reader, cache.text, bos=cache.bos).cache
        out[kind] = all(torch.isfinite(l.keys).all() and torch.isfinite(l.values).all() for l in own.layers)
    return out


def summarize(rows: list[dict], *, seed: int = 0) -> dict[tuple, CI]:
    """Intervals over caches: ``(reader, metric)`` and ``(reader, question kind, metric)`` -> :class:`kvlab.CI`.

    Means for the KLs and ``dnll`` (:func:`kvlab.mean_ci`), a rate for ``flip``
    (:func:`kvlab.proportion_ci`); per kind only the two KLs.
    """
    ci: dict[tuple, CI] = {}
    for reader in dict.fromkeys(r["reader"] for r in rows):
        rs = [r for r in rows if r["reader"] == reader]
        clusters = [r["cache"] for r in rs]
        for m in METRICS[:3]:
            ci[reader, m] = mean_ci([r[m] for r in rs], clusters=clusters, seed=seed)
        ci[reader, "flip"] = proportion_ci([r["flip"] for r in rs], clusters=clusters, seed=seed)
        for kind in sorted({r["kind"] for r in rs}):
            ks = [r for r in rs if r["kind"] == kind]
            for m in ("kl", "span_kl"):
                ci[reader, kind, m] = mean_ci([r[m] for r in ks], clusters=[r["cache"] for r in ks], seed=seed)
    return ci


def paired(rows: list[dict], a: str, b: str, metric: str = "span_kl", *, seed: int = 0) -> CI:
    """``metric(a) - metric(b)`` over the same questions, paired, resampled by cache."""
    x = {(r["cache"], i): r[metric] for i, r in enumerate(r for r in rows if r["reader"] == a)}
    y = {(r["cache"], i): r[metric] for i, r in enumerate(r for r in rows if r["reader"] == b)}
    keys = sorted(set(x) & set(y))
    return paired_diff_ci([x[k] for k in keys], [y[k] for k in keys], clusters=[k[0] for k in keys], seed=seed)


def first_tokens(model: LoadedModel, caches: list[ProducerCache]) -> dict[str, list[str]]:
    """Per question kind, the distinct first tokens of the true answers (as fed: after a space)."""
    out: dict[str, set] = {}
    for c in caches:
        for q in c.questions:
            out.setdefault(q.kind, set()).add(model.tokenizer.decode(tokenize(model, " " + q.answer)[:1]))
    return {k: sorted(v) for k, v in sorted(out.items())}


_ci = fmt_ci


def table(rows: list[dict], ci: dict, readers: list[str], unreadable_: dict[str, bool], model_name: str) -> str:
    """The per-reader table: first-token KL, answer-span KL, answer NLL change, flips, each with its interval."""
    n_caches = len({r["cache"] for r in rows})
    n = len(rows) // max(1, len(readers))
    lines = [
        f"{n} questions over {n_caches} caches per reader; means with 95% intervals over caches",
        f"{'reader':<9}  {'first-token KL, nats':<24}  {'answer-span KL, nats/token':<26}  "
        f"{'answer NLL change, nats':<24}  top-1 flips",
    ]
    for kind in readers:
        if kind in unreadable_:
            why = "finite, its reading of the foreign cache is not" if unreadable_[kind] else "not finite (an overflow)"
            lines.append(f"{kind:<9}  no finite KL on {model_name}: the reader's own prefill is {why}")
            continue
        flips = sum(r["flip"] for r in rows if r["reader"] == kind)
        f = ci[kind, "flip"]
        lines.append(
            f"{kind:<9}  {_ci(ci[kind, 'kl']):<24}  {_ci(ci[kind, 'span_kl']):<26}  {_ci(ci[kind, 'dnll'], '+.3f'):<24}  "
            f"{flips}/{n} [{f.lo:.2f}, {f.hi:.2f}]"
        )
    lines.append(
        "KL(p_own || p_foreign); answer NLL change: -log p(truth) behind the foreign cache minus behind the own"
    )
    return "\n".join(lines)


def kind_table(rows: list[dict], ci: dict, readers: list[str]) -> str:
    """First-token against answer-span KL per question kind (5 decimals: the year rows sit near 0)."""
    lines = [f"{'reader':<9} {'kind':<10} {'n':>4}  {'first-token KL':<27} {'answer-span KL':<27}"]
    for reader in readers:
        for kind in sorted({r["kind"] for r in rows}):
            n = sum(r["reader"] == reader and r["kind"] == kind for r in rows)
            a, b = ci[reader, kind, "kl"], ci[reader, kind, "span_kl"]
            lines.append(f"{reader:<9} {kind:<10} {n:>4}  {_ci(a, '.5f'):<27} {_ci(b, '.5f'):<27}")
    return "\n".join(lines)


def conclusions(
    rows: list[dict],
    ci: dict,
    *,
    model_name: str,
    refused: bool,
    cross_named: str,
    primary: tuple[str, str],
    diff: CI | None,
    first: dict[str, list[str]],
    unreadable_: dict[str, bool],
) -> list[str]:
    """The study's conclusions, built from its numbers: the first is the finding."""
    finite = list(dict.fromkeys(r["reader"] for r in rows))
    worst = max(finite, key=lambda k: ci[k, "span_kl"].mean)
    d = ci[worst, "dnll"]
    out = [
        f"On {model_name}, forced through, the {worst} reader moves the answers most: answer-span KL "
        f"{_ci(ci[worst, 'span_kl'])} "
        f"nats per token; the true answer's negative log-likelihood changes by {_ci(d, '+.3f')} nats "
        + ("(resolved)." if d.excludes(0) else "(not resolved: the truth is not measurably less likely)."),
        f"On {model_name}, over {len(rows) // len(finite)} questions from {len({r['cache'] for r in rows})} "
        f"independent caches: every same-shape reader is {'refused, its differing fields named' if refused else 'NOT refused'}"
        f", and a reader of another architecture is refused with its {cross_named} named.",
    ]
    rest = [k for k in finite if k != worst]
    if rest:
        top = max(ci[k, "span_kl"].hi for k in rest)
        line = (
            f"The other readers ({', '.join(rest)}) stay at or below {top:.4f} nats per token (upper bounds): the "
            + ("intervals do not overlap" if ci[worst, "span_kl"].lo > top else "intervals overlap")
        )
        if diff is not None:
            line += f"; the named comparison {primary[0]} - {primary[1]} is {_ci(diff, '+.3f')} " + (
                "(resolved)" if diff.excludes(0) else "(not resolved)"
            )
        out.append(line + ".")
    out.append(f"The {worst} reader's top-1 first-token flip rate is {_ci(ci[worst, 'flip'], '.3f')}.")
    for kind, toks in first.items():
        a, b = ci.get((worst, kind, "kl")), ci.get((worst, kind, "span_kl"))
        # Said only where the two intervals are apart: the span's lower bound above the first token's upper one.
        if len(toks) == 1 and a is not None and b.lo > a.hi:
            out.append(
                f"Every {kind} answer starts with the token {toks[0]!r}: for the {worst} reader its first-token KL is "
                f"{a.mean:.5f} against an answer-span KL of {b.mean:.5f}, so a first-token measure misses what "
                "happens to these answers."
            )
    if unreadable_:
        out.append(
            "No finite KL for "
            + ", ".join(
                f"{k} ({'its own prefill is finite' if ok else 'its own prefill overflows'})"
                for k, ok in unreadable_.items()
            )
            + "."
        )
    return out


def committed_path(results: str | Path, model_name: str, suffix: str = "csv") -> Path:
    """Where the full-scale run of this study (``studies/foreign_readers.py``) keeps ``model_name``'s rows or summary."""
    return Path(results) / f"foreign_readers_{model_name}.{suffix}"


def row_dicts(rows: list[dict]) -> list[dict]:
    """The rows as committed: one per (reader, cache, question), the cache id and the question's index in it."""
    seen: dict[tuple, int] = {}
    out = []
    for r in rows:
        i = seen[r["reader"], r["cache"]] = seen.get((r["reader"], r["cache"]), -1) + 1
        out.append({"reader": r["reader"], "cache": r["cache"], "question": i, **{k: r[k] for k in ("kind", *METRICS)}})
    return out


def markdown_table(rows: list[dict], readers: list[str], *, seed: int = 0) -> str:
    """The per-reader table in Markdown (``results/README.md``), with the two-stage answer-span interval beside it.

    The two-stage bootstrap also resamples questions within each drawn cache: a sensitivity
    column (``docs/statistics.md``), wider where questions in a cache are correlated.
    """
    ci = summarize(rows, seed=seed)
    head = (
        "| reader | first-token KL, nats [95% CI] | answer-span KL, nats/token [95% CI] | "
        "answer NLL change, nats [95% CI] | top-1 flips [95% CI] | answer-span KL, two-stage CI |"
    )
    out = [head, "|---|---|---|---|---|---|"]
    for kind in readers:
        rs = [r for r in rows if r["reader"] == kind]
        f = ci[kind, "flip"]
        two = mean_ci([r["span_kl"] for r in rs], clusters=[r["cache"] for r in rs], seed=seed, two_stage=True)
        out.append(
            f"| {kind} | {fmt_ci(ci[kind, 'kl'])} | {fmt_ci(ci[kind, 'span_kl'])} | {fmt_ci(ci[kind, 'dnll'], '+.3f')} "
            f"| {sum(r['flip'] for r in rs)}/{len(rs)} [{f.lo:.2f}, {f.hi:.2f}] | [{two.lo:.4f}, {two.hi:.4f}] |"
        )
    return "\n".join(out)


def at_scale(rows: list[dict], meta: dict, where: str, *, seed: int = 0) -> list[str]:
    """What the committed full-scale run shows, recomputed from its rows: one line per reader, then the named comparison."""
    unread = meta.get("unreadable", {})
    finite = [k for k in dict.fromkeys(r["reader"] for r in rows) if k not in unread]
    rows = [r for r in rows if r["reader"] in finite]
    ci = summarize(rows, seed=seed)
    n = len(rows) // max(1, len(finite))
    out = [
        f"{meta['model']}, {n} questions over {len({r['cache'] for r in rows})} caches per reader "
        f"({where}; {meta['cpu']}; {meta['command']}):"
    ]
    for k in finite:
        out.append(
            f"{k}: answer-span KL {fmt_ci(ci[k, 'span_kl'])} nats/token, answer NLL change "
            f"{fmt_ci(ci[k, 'dnll'], '+.3f')} nats, top-1 flips {fmt_ci(ci[k, 'flip'], '.3f')}"
        )
    out += [f"{k}: no finite KL (its own prefill {'is finite' if ok else 'overflows'})" for k, ok in unread.items()]
    a, b = meta["primary"]
    if a in finite and b in finite:
        d = paired(rows, a, b, seed=seed)
        out.append(
            f"named comparison {a} - {b} answer-span KL {fmt_ci(d, '+.3f')} nats/token (paired, {d.n_clusters} caches): "
            + ("resolved" if d.excludes(0) else "not resolved")
        )
    return out


def committed_markdown(folder: str | Path, models: tuple[str, ...]) -> str:
    """``results/README.md``'s foreign-reader tables, recomputed from each model's committed rows under ``folder``."""
    out = []
    for name in models:
        path = committed_path(folder, name)
        if not path.exists():
            continue
        meta = json.loads(committed_path(folder, name, "json").read_text())
        rows = read_rows(path)
        finite = [k for k in meta["readers"] if k not in meta["unreadable"]]
        lines = at_scale(rows, meta, f"results/{path.name}")
        out += [f"#### {name}", "", lines[0], ""]
        out += [markdown_table([r for r in rows if r["reader"] in finite], finite), ""]
        for k, own_finite in meta["unreadable"].items():
            why = "finite, its reading of the foreign cache is not" if own_finite else "not finite (an overflow)"
            out += [f"{k}: no finite KL on {name}; the reader's own prefill is {why}.", ""]
        a, b = meta["primary"]
        if a in finite and b in finite:
            out += ["The " + lines[-1] + ".", ""]
    return "\n".join(out).rstrip() + "\n"
