"""Long-context merges: phase error by position, and answers against fragment count and offset.

Shared by ``notebooks/07_long_context.ipynb`` (quick defaults) and
``studies/long_context.py`` (the full scale), so both measure the same thing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kvlab.cache.merge import merge
from kvlab.cache.recompute.strategy import Recompute
from kvlab.cache.strategies import Naive, Reprefill, Rerotate, Strategy
from kvlab.errors import MergeError
from kvlab.findings.evalset import EvalSet, generate_evalset, normalize
from kvlab.findings.qa import ask, passage_fragments
from kvlab.measure.metrics import phase_error
from kvlab.measure.references import phase_reference
from kvlab.measure.stats import CI, fmt_ci, gap_closed_ci, mean_ci, paired_diff_ci, paired_p, proportion_ci
from kvlab.models.loaded import LoadedModel


def default_strategies(ratio: float = 0.15, seed: int = 0) -> dict[str, Strategy]:
    """The four strategies the long-context study compares, labelled for tables."""
    return {
        "naive": Naive(),
        "rerotate": Rerotate(),
        f"recompute r={ratio:g}": Recompute(ratio=ratio, policy="deviation", seed=seed),
        "reprefill": Reprefill(),
    }


def token_counter(model: LoadedModel):
    """``str -> int``: the model's token count of a text (no special tokens)."""
    return lambda text: len(model.tokenizer(text, add_special_tokens=False)["input_ids"])


def make_set(
    model: LoadedModel,
    n_fragments: int,
    fragment_tokens: int,
    seed: int = 0,
    people_per_passage: int = 2,
    max_questions: int | None = None,
) -> EvalSet:
    """A generated set whose passages are ``fragment_tokens`` of this model's tokens (at most).

    ``max_questions`` keeps the first questions of the seeded shuffle.
    """
    s = generate_evalset(seed, n_fragments, fragment_tokens, people_per_passage, count_tokens=token_counter(model))
    if max_questions is not None:
        s = EvalSet(s.passages, s.questions[:max_questions], s.seed, s.facts)
    return s


@dataclass
class PhaseProfile:
    """Mean phase error per position, for one strategy and one layer type.

    Attributes
    ----------
    layer_type : str
        As the model's rotary module names it (``"full_attention"``, ``"sliding_attention"``;
        ``"default"`` on a model with one layer type).
    positions : np.ndarray
        ``[T]`` positions the layers of this type keep (a sliding layer: the last ``window - 1``).
    naive, rerotate : np.ndarray
        ``[T]`` radians: mean over layers of the type, KV heads and rotary pairs of the angle
        between the merged key pair and the phase reference's.
    """

    layer_type: str
    positions: np.ndarray
    naive: np.ndarray
    rerotate: np.ndarray


def _mean_by_position(phases, layer_type: str) -> tuple[np.ndarray, np.ndarray]:
    sel = [p for p in phases if p.layer_type == layer_type]
    pos = sel[0].positions
    stack = torch.stack([p.angle.double() for p in sel])  # [layers, heads, T, pairs]
    return pos.numpy(), torch.nanmean(stack.permute(2, 0, 1, 3).reshape(len(pos), -1), dim=1).numpy()


def phase_profile(model: LoadedModel, fragments) -> list[PhaseProfile]:
    """Phase error by position of a naive and a re-rotated merge, per layer type.

    Builds the phase reference (each fragment prefilled alone at its landing position).
    """
    ref = phase_reference(model, fragments)
    naive = phase_error(merge(fragments, "naive", model), ref, model)
    rer = phase_error(merge(fragments, "rerotate", model), ref, model)
    out = []
    for lt in dict.fromkeys(p.layer_type for p in naive):
        pos, a = _mean_by_position(naive, lt)
        _, b = _mean_by_position(rer, lt)
        out.append(PhaseProfile(lt, pos, a, b))
    return out


def run(
    model: LoadedModel,
    fragment_counts: list[int],
    fragment_tokens: int,
    *,
    seed: int = 0,
    people_per_passage: int = 2,
    max_questions: int | None = None,
    greedy_tokens: int = 5,
    ratio: float = 0.15,
    sets: int = 1,
    strategies: dict[str, Strategy] | None = None,
    log=None,
) -> tuple[list[dict], dict]:
    """Answer generated questions behind every strategy, for each fragment count.

    ``sets`` independent seeded sets (other people, facts, filler) are read per count, so a
    count's n can grow past the ``3 * people_per_passage * n_fragments`` questions one set holds.
    ``strategies`` (``label -> Strategy``, ``reprefill`` among them as the reference) replaces
    :func:`default_strategies`.

    Returns
    -------
    rows : list of dict
        :func:`kvlab.findings.qa.ask` rows plus ``n_fragments``, ``set``, ``fragment_tokens``, ``total_tokens``
        and ``first_tokens`` (fragment 0's length, which no merge changes).
    timings : dict
        ``n_fragments -> seconds`` of wall time for that configuration (prefill, merges, answers).
    """
    rows, timings = [], {}
    if sets < 1:
        raise MergeError(f"sets must be >= 1, got {sets}")
    for k in fragment_counts:
        t0 = time.perf_counter()
        n_questions = 0
        for j in range(sets):
            # Set 0 keeps the seed the single-set runs (and notebook 07) use.
            s = make_set(
                model,
                k,
                fragment_tokens,
                seed=seed + k + 1000 * j,
                people_per_passage=people_per_passage,
                max_questions=max_questions,
            )
            frags, probes = passage_fragments(model, s)
            total = sum(f.length for f in frags)
            for r in ask(
                model,
                s,
                strategies or default_strategies(ratio, seed),
                greedy_tokens=greedy_tokens,
                fragments=frags,
                probes=probes,
            ):
                r.update(
                    n_fragments=k,
                    set=j,
                    fragment_tokens=fragment_tokens,
                    total_tokens=total,
                    first_tokens=frags[0].length,
                )
                rows.append(r)
            n_questions += len(s.questions)
        timings[k] = time.perf_counter() - t0
        if log:
            log(
                f"{model.name}: {k} fragments (~{total} tokens), {sets} set(s), {n_questions} questions: {timings[k]:.0f} s"
            )
    return rows, timings


def json_ready(rows: list[dict]) -> list[dict]:
    """Summary rows (:func:`summarize`) with every interval as :meth:`kvlab.CI.as_dict`, for a result file."""
    return [{k: v.as_dict() if isinstance(v, CI) else v for k, v in r.items()} for r in rows]


def cache_of(row: dict) -> tuple:
    """The merged cache a row's question was read behind: one per (fragment count, generated set)."""
    return row["n_fragments"], row.get("set", 0)


def summarize(rows: list[dict], by: tuple[str, ...] = ("n_fragments", "strategy"), *, seed: int = 0) -> list[dict]:
    """Mean and 95% interval of ``kl``, ``span_kl``, ``nll``, ``em`` and ``agree`` per group of rows, over caches.

    Intervals resample caches (:func:`cache_of`), each with all its questions; ``em``, ``agree``
    and ``ref_em`` (the joined prefill's exact match: the full-context ceiling) are rates
    (:func:`kvlab.proportion_ci`: never collapsing at 0 or 1). Agreement with the joined
    prefill counts only where that reference is right, so ``agree_right`` is over the
    ``n_ref_right`` questions whose reference answer is exact; ``ref_top_share`` is the share of
    reference answers that are its single most common answer (a degenerate reference repeats one).

    Returns
    -------
    list of dict
        The ``by`` keys, ``n`` (questions), ``n_caches``, ``kl``, ``span_kl`` and ``nll`` (where
        the rows have them), ``em``, ``agree``, ``ref_em``, ``agree_right`` (each a
        :class:`kvlab.measure.stats.CI`; ``agree_right`` None when the reference is never right),
        ``n_ref_right`` and ``ref_top_share``.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in by), []).append(r)
    out = []
    for key, rs in groups.items():
        caches = [cache_of(r) for r in rs]
        row = dict(zip(by, key), n=len(rs), n_caches=len(set(caches)))
        for m in ("kl", "span_kl", "nll"):
            if m == "kl" or all(m in r for r in rs):
                row[m] = mean_ci([float(r[m]) for r in rs], clusters=caches, seed=seed)
        for m in ("em", "agree", "ref_em"):
            row[m] = proportion_ci([bool(r[m]) for r in rs], clusters=caches, seed=seed)
        right = [r for r in rs if r["ref_em"]]
        row["n_ref_right"] = len(right)
        row["agree_right"] = (
            proportion_ci([bool(r["agree"]) for r in right], clusters=[cache_of(r) for r in right], seed=seed)
            if right
            else None
        )
        refs = [normalize(r["ref_answer"]) for r in rs]
        row["ref_top_share"] = max(refs.count(a) for a in set(refs)) / len(refs)
        out.append(row)
    return out


def pairs(
    rows: list[dict], a: str, b: str, metric: str, where: dict | None, cluster: tuple[str, ...] = ("n_fragments", "set")
) -> tuple[list, list, list]:
    """``metric`` of ``a`` and of ``b`` over the questions both answered, and each pair's cluster label.

    A question is one (``n_fragments``, ``set``, ``question``) among the rows ``where`` selects; its
    label is its values of ``cluster`` (default the cache it was read behind, :func:`cache_of`;
    ``("set",)`` when nested caches of one generated set are pooled).
    """
    where = where or {}

    def pick(s: str) -> dict:
        return {
            (r["n_fragments"], r.get("set", 0), r["question"]): r
            for r in rows
            if r["strategy"] == s and all(r[k] == v for k, v in where.items())
        }

    x, y = pick(a), pick(b)
    keys = sorted(set(x) & set(y))
    labels = [tuple(x[k].get(c, 0) for c in cluster) for k in keys]
    # Values keep their type: a boolean metric (exact match) is a rate, and paired_diff_ci widens its interval.
    return [x[k][metric] for k in keys], [y[k][metric] for k in keys], labels


def paired(rows: list[dict], a: str, b: str, metric: str, *, where: dict | None = None, seed: int = 0) -> CI:
    """CI of ``metric(a) - metric(b)`` over the questions both strategies answered, paired, resampled by cache."""
    x, y, caches = pairs(rows, a, b, metric, where)
    return paired_diff_ci(x, y, clusters=caches, seed=seed)


def named_paired(
    rows: list[dict], a: str, b: str, metric: str, *, where: dict | None = None, seed: int = 0
) -> tuple[CI, float]:
    """:func:`paired` and its two-sided bootstrap p (:func:`kvlab.measure.stats.paired_p`, same resamples), for a named family."""
    x, y, caches = pairs(rows, a, b, metric, where)
    return paired_diff_ci(x, y, clusters=caches, seed=seed), paired_p(x, y, clusters=caches, seed=seed)


def gap_closed(
    rows: list[dict], a: str, b: str, metric: str = "span_kl", *, where: dict | None = None, seed: int = 0
) -> CI:
    """The share of ``b``'s error (``metric``, 0 at the joined prefill) that ``a`` removes, paired, resampled by cache."""
    x, y, caches = pairs(rows, a, b, metric, where)
    return gap_closed_ci(x, y, clusters=caches, seed=seed)


_c = fmt_ci


def table(summary: list[dict], strategies: list[str]) -> str:
    """Per (fragment count, strategy): n, caches, both KLs, exact match, agreement where the reference is right.

    ``summary``: :func:`summarize` rows by (``n_fragments``, ``strategy``), with ``span_kl``.
    """
    lines = [
        f"{'k':>2} {'strategy':<20} {'n':>4} {'caches':>6}  {'first-token KL, nats':<24} "
        f"{'answer-span KL, nats/token':<26} {'exact match':<18} agreement where reprefill is right"
    ]
    for r in sorted(summary, key=lambda r: (r["n_fragments"], strategies.index(r["strategy"]))):
        right = f"{_c(r['agree_right'], '.2f')} (n={r['n_ref_right']})"
        lines.append(
            f"{r['n_fragments']:>2} {r['strategy']:<20} {r['n']:>4} {r['n_caches']:>6}  {_c(r['kl']):<24} "
            f"{_c(r.get('span_kl')):<26} {_c(r['em'], '.2f'):<18} {right}"
        )
    lines.append(
        "95% intervals over caches (a cluster bootstrap: caches resampled, each with all its questions); exact match "
        "against the truth; reprefill's exact match is the full-context ceiling"
    )
    return "\n".join(lines)


def at_scale(doc: dict, path: str) -> list[str]:
    """Lines stating a committed long-context study (``studies/long_context.py``'s JSON) for a conclusions cell.

    Per fragment count: naive against rerotate in answer-span KL and exact match, each with its
    interval, n questions and n caches; the paired difference; the ceiling; and the share of
    rerotate's answer-span KL that recompute closes.
    """
    if "gap_closed" not in doc or any("span_kl" not in r for r in doc["summary"]):
        return [
            f"{doc.get('model', path)}: {path} predates the answer-span measures; run studies/long_context.py again"
        ]
    by = {(r["n_fragments"], r["strategy"]): r for r in doc["summary"]}
    counts = sorted({k for k, _ in by})
    lines = []
    for k in counts:
        n, r, p = by[k, "naive"], by[k, "rerotate"], by[k, "reprefill"]
        d = doc["paired_differences"][f"{k} fragments: naive - rerotate span_kl"]
        de = doc["paired_differences"][f"{k} fragments: naive - rerotate em"]
        gap = next((v for key, v in doc.get("gap_closed", {}).items() if key.startswith(f"{k} fragments:")), None)
        lines.append(
            f"{doc['model']}, {k} fragments of <={doc['args']['tokens']} tokens, {n['n']} questions over "
            f"{n['n_caches']} caches ({path}): answer-span KL naive {_d(n['span_kl'])} against rerotate "
            f"{_d(r['span_kl'])} nats/token (paired difference {_d(d, '+.4f')}, "
            f"{'resolved' if d['lo'] > 0 or d['hi'] < 0 else 'not resolved'}); exact match naive "
            f"{_d(n['em'], '.2f')}, rerotate {_d(r['em'], '.2f')} (paired difference {_d(de, '+.2f')}), "
            f"ceiling {_d(p['em'], '.2f')}"
            + ("" if gap is None else f"; recompute closes {_d(gap, '.0%')} of rerotate's answer-span KL")
        )
    return lines


_d = fmt_ci
